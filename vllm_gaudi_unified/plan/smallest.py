"""The smallest step of each phase: what warmup runs per bucket, and what a bucket plan must be able to hold.

The default planner's rules (`plan/rules.py`) fix how small a step of a phase can be:

- causal work needs a request with at least 2 new tokens;
- a cached block is *shared* when more than one query token reads it: a request with several new
  tokens, or two requests holding the block;
- so *unique* work needs a one-token request reading a block no other request holds. With causal
  work that is a request of its own (the causal request's context is shared): `c-u` and `csu`
  need 3 tokens and 2 requests; without causal work, one of two one-token requests sharing a block
  can hold a block of its own: `-su` needs 2 tokens.
- on the prompt route (`plan/prompts.py`, the default) a request with new tokens over a context no
  other request reads is not on the causal path at all: causal work needs a short draft over a
  block another request holds, so `cs-` and `csu` take one more request, and `c--` and `c-u` occur
  only under a sliding window (or on the tiled route).

A bucket that does not cover its phase's smallest step can never be used by a step of that phase,
and warmup cannot build a batch for it. The planner (not this module) decides each step's shape:
`smallest_steps` plans these candidates, so a phase the planner never produces under some options
(no unique path in batch-invariant mode) comes back as None.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from vllm_gaudi_unified.bucket import PHASES, Bucket


def candidate_steps(phase: str, block_size: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(query_lens, context_lens, block_table) of the smallest steps that may be of `phase`, fewest tokens first.

    Block 1 is the shared (or causal request's) block, 2 a unique one; `---` is one token over an
    empty context. `-su` has a second, larger candidate: under a sliding window shorter than a block a
    one-token request reads its last block only, so its own block needs a third request.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    c, s, u = (p != "-" for p in phase)
    if c:  # the causal request's context is shared; unique work needs a one-token request of its own
        steps = [[(2, [1] if s else [])] + ([(1, [2])] if u else [])]
        if s:  # on the prompt route the causal request must be a short draft over a block another one reads
            steps.append([(2, [1]), (1, [1])] + ([(1, [2])] if u else []))
    elif s:
        steps = [[(1, [1, 2]), (1, [1])], [(1, [1]), (1, [1]), (1, [2])]] if u else [[(1, [1]), (1, [1])]]
    else:
        steps = [[(1, [2] if u else [])]]
    return [_arrays(rows, block_size) for rows in steps]


def _arrays(rows, block_size: int):
    width = max(1, max(len(b) for _, b in rows))
    return (np.array([n for n, _ in rows]), np.array([len(b) * block_size for _, b in rows]),
            np.array([b + [0] * (width - len(b)) for _, b in rows], dtype=np.int64))


@lru_cache(maxsize=64)
def smallest_steps(block_size: int, options, sliding_window: int | None = None) -> dict[str, tuple | None]:
    """Per phase, `(step, shape)`: its first candidate step the planner gives that phase, and that
    shape; None where no candidate gets it (the planner makes no such step under these options)."""
    from vllm_gaudi_unified.plan import plan_step

    out: dict[str, tuple | None] = {}
    for phase in PHASES:
        out[phase] = None
        for step in candidate_steps(phase, block_size):
            shape = plan_step(*step, block_size, sliding_window=sliding_window, options=options).shape
            if shape.phase == phase:
                out[phase] = (step, shape)
                break
    return out


def with_prompt(step, prompt_context: bool, block_size: int, options, sliding_window: int | None = None):
    """`step` and one more request on the prompt route: two new tokens, over one block of context of its
    own when `prompt_context` (the graph has prompt context blocks). Returns (step, shape)."""
    from vllm_gaudi_unified.plan import plan_step

    q, ctx, table = step
    if ((q == 1) & (ctx == 0)).all():  # phase '---': that token would join the route as a prompt of its own
        q, ctx, table = q[:0], ctx[:0], table[:0]
    own = int(table.max()) + 1 if table.size else 1
    width = max(table.shape[1], 1)
    row = np.zeros((1, width), np.int64)
    row[0, 0] = own
    step = (np.append(q, 2), np.append(ctx, block_size if prompt_context else 0),
            np.concatenate([np.pad(table, ((0, 0), (0, width - table.shape[1]))), row]))
    return step, plan_step(*step, block_size, sliding_window=sliding_window, options=options).shape


@lru_cache(maxsize=256)
def smallest_prompt_shape(phase: str, prompt_context: bool, block_size: int, options,
                          sliding_window: int | None = None) -> Bucket | None:
    """The shape of the step warmup runs for a prompt graph of `phase` (its smallest step and a prompt,
    `with_prompt`): a learned graph is raised to cover it; None where the planner makes no such step."""
    found = smallest_steps(block_size, options, sliding_window)[phase]
    return None if found is None else with_prompt(found[0], prompt_context, block_size, options, sliding_window)[1]


def can_hold_a_step(bucket: Bucket, block_size: int, options, sliding_window: int | None = None) -> bool:
    """True when some step of `bucket`'s phase fits in it (it covers the phase's smallest step)."""
    smallest = smallest_steps(block_size, options, sliding_window)[bucket.phase]
    return smallest is not None and bucket.covers(smallest[1])


def lift_to_smallest(sizes: np.ndarray, block_size: int, options, sliding_window: int | None = None) -> np.ndarray:
    """Bucket rows (int64 [n, 5], DIMS order) each raised to cover the smallest step of its phase, rows of a
    phase the planner never makes dropped, duplicates merged: what a plan generator emits, so that every
    bucket of a new plan can be warmed (a learned or skeleton bucket may be smaller, in some size, than any
    step of its phase: e.g. `csu` with one logit, where such steps need two requests)."""
    from vllm_gaudi_unified.bucket import bucket_from_sizes

    smallest = smallest_steps(block_size, options, sliding_window)
    rows = []
    for row in np.asarray(sizes, dtype=np.int64):
        found = smallest[bucket_from_sizes(row.tolist()).phase]
        if found is not None:
            rows.append(np.maximum(row, np.asarray(found[1].sizes, dtype=np.int64)))
    return np.unique(np.array(rows, dtype=np.int64).reshape(-1, sizes.shape[1]), axis=0)
