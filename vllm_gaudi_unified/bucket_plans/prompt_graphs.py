"""Prompt graphs: the few buckets of a plan in which prompts take the prompt route.

A plan's buckets count the five sizes of the tiled paths, so every step has a
bucket. The prompt route (`plan/prompts.py`: each prompt or chunk over its own
context as one fused SDPA call, how vllm-gaudi runs prompts) is much faster for
chunked prompts, but a step on it needs a graph of its bucket *and* its prompt
shape `(num_prompts, prompt_len, prompt_blocks)`: a product no server can warm
whole. So a plan also holds a few *prompt graphs*, the shapes the prompt steps
of its traces need most often, each dimension rounded up to a power of two
(`rounded_shape`), warmed like the other buckets.

At serving time a step is planned on the prompt route first; when no prompt
graph covers it, it is planned again on the tiled route, whose buckets cover
it (`batch.build_unified_batch`). Never a graph compiled while serving, and the
common prompt shapes at the prompt route's speed. A plan without prompt graphs
(made with `--prompt-graphs 0`, or before they existed) plans on the tiled route.
"""
from __future__ import annotations

from collections import Counter
import numpy as np

from vllm_gaudi_unified.bucket import Bucket, pow2
from vllm_gaudi_unified.plan.options import on_route

#: Prompt graphs `buckets generate` learns unless told otherwise (each one more graph to warm): with a robust
#: plan's 44 buckets (`tools/robust.py: DEFAULT_ROBUST_GRAPHS`), 100 graphs in all.
DEFAULT_PROMPT_GRAPHS = 56


def prompt_work(b: Bucket, block_size: int) -> int:
    """(query row, key) pairs of a bucket's prompt call: its padded size, to order graphs by."""
    return b.num_prompts * b.prompt_len * (b.prompt_len + b.prompt_blocks * block_size)


class PromptGraphs:
    """The prompt graphs of a plan and `find`, the smallest one covering a step."""

    def __init__(self, buckets, block_size: int):
        buckets = sorted(set(buckets), key=lambda b: (prompt_work(b, block_size), b))
        for b in buckets:
            if not isinstance(b, Bucket) or not b.num_prompts:
                raise ValueError(f"a prompt graph is a Bucket with num_prompts > 0, got {b!r}")
        self.buckets = buckets
        self._shapes = np.array([b.sizes + b.prompts for b in buckets], np.int64).reshape(len(buckets), 8)

    def __len__(self) -> int:
        return len(self.buckets)

    def find(self, shape: Bucket) -> Bucket | None:
        """The first (smallest prompt call) graph covering `shape`, or None."""
        if not self.buckets or not shape.num_prompts:
            return None
        covers = (self._shapes >= np.asarray(shape.sizes + shape.prompts)).all(1)
        i = int(covers.argmax())
        return self.buckets[i] if covers[i] else None


def rounded_shape(shape: Bucket, settings, cap) -> Bucket:
    """The prompt graph of a step: each of its eight dimensions rounded up to a power of two (shared
    slots: whole tiles), within the settings' limits and the gather cap. Not a bucket of the plan:
    a prompt step has no causal tiles to speak of and a handful of decodes, which the plan's
    buckets, made for the tiled route, would pad with empty tiles."""
    kb = settings.blocks_per_tile
    lim = [int(x) for x in settings.limits()]
    if cap.max_unique_blocks is not None:
        lim[2] = min(lim[2], cap.max_unique_blocks)
    if cap.max_shared_blocks is not None:
        lim[1] = min(lim[1], cap.max_shared_blocks)
    q, _, u, n, c = (max(min(pow2(x), hi), x) for x, hi in zip(shape.sizes, lim))
    tiles = -(-shape.num_shared_blocks // kb)
    s = kb * max(min(pow2(tiles), lim[1] // kb), tiles)
    return Bucket(shape.phase, q, s, u, n, c, *(pow2(x) for x in shape.prompts))


def _choose(hits: Counter, count: int, block_size: int) -> list[Bucket]:
    """`count` graphs among the candidates `hits` (graph -> steps): the most frequent, and an eighth of
    them for the rare long prompts the others leave out, which the tiled route runs slowest (its causal
    tiles grow with the square of a prompt): each time the candidate covering the most of them,
    weighted by `num_prompts x prompt_len^2`."""
    by_count = sorted(hits, key=lambda g: (-hits[g], prompt_work(g, block_size), g))
    ceiling = count // 8 if len(hits) > count else 0
    chosen = by_count[:count - ceiling]
    left = [g for g in hits if PromptGraphs(chosen, block_size).find(g) is None]
    weight = {g: hits[g] * g.num_prompts * g.prompt_len ** 2 for g in left}
    for _ in range(ceiling):
        if not left:
            break
        shapes = np.array([g.sizes + g.prompts for g in left], np.int64)
        covers = (shapes[:, None, :] >= shapes[None, :, :]).all(2)  # [candidate, step shape]
        gain = covers @ np.array([weight[g] for g in left], np.float64)
        best = int(gain.argmax())
        chosen.append(left[best])
        left = [g for g, c in zip(left, covers[best]) if not c]
    return chosen


def prompt_shapes(plan, steps, every: bool = False):
    """The shape of each step of `steps` (TraceSteps) that has prompts, planned on the prompt route;
    `every`: one per step, None for a step without prompts."""
    from vllm_gaudi_unified.plan import plan_step

    s = plan.settings
    options = on_route(s.options, "dense")
    for step in steps:
        if int(step.query_lens.max()) < 2:  # a decode step never takes the prompt route
            if every:
                yield None
            continue
        shape = plan_step(step.query_lens, step.context_lens, step.block_table(), step.block_size,
                          sliding_window=s.sliding_window, options=options).shape
        if shape.num_prompts or every:
            yield shape if shape.num_prompts else None


def on_prompt_graphs(plan, steps) -> np.ndarray:
    """Bool per step of `steps`: whether it runs in one of `plan`'s prompt graphs (so its tiled shape
    needs no bucket)."""
    return np.array([g is not None and plan.prompt_graph(g) is not None for g in prompt_shapes(plan, steps, True)],
                    bool)


def learn_prompt_graphs(plan, steps, max_graphs: int = DEFAULT_PROMPT_GRAPHS) -> tuple[list[Bucket], dict]:
    """The `max_graphs` prompt graphs most steps of `steps` (TraceSteps) need, and how many they cover.

    Each step with prompts is planned on the prompt route (`plan_step`, the rules a server applies);
    its graph is its shape rounded up (`rounded_shape`). The graphs most steps need are kept, and a few
    for the long prompts (`_choose`); a step runs in the smallest kept graph that covers it. A graph whose prompt call gathers more block
    slots than the plan's gather cap is never chosen."""
    if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 0:
        raise ValueError(f"the number of prompt graphs must be an int >= 0, got {max_graphs!r}")
    s = plan.settings
    cap = plan.gather_cap
    hits: Counter = Counter()
    prompt_steps = 0
    for shape in prompt_shapes(plan, steps):
        prompt_steps += 1
        graph = rounded_shape(shape, s, cap)
        if not cap.exceeded(graph) and (cap.max_unique_blocks is None
                                        or graph.num_prompts * graph.prompt_blocks <= cap.max_unique_blocks):
            hits[graph] += 1
    chosen = PromptGraphs(_choose(hits, max_graphs, s.block_size), s.block_size)
    covered = sum(n for g, n in hits.items() if chosen.find(g) is not None)
    info = {"prompt_steps": prompt_steps, "prompt_steps_on_prompt_graphs": covered,
            "prompt_graph_candidates": len(hits)}
    return chosen.buckets, info
