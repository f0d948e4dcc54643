"""The `exponential` bucket plan, made from the server settings alone (no trace needed).

**exponential**, the classic baseline (what the earlier Gaudi implementation did,
in this plugin's six-field shape): per phase, an exponential range per dimension
(`base**k`, rounded up to the dimension's step, capped at the settings' limit):
query tokens in `[1, max_num_batched_tokens]` (`[1, max_num_seqs]` for phases
without causal work: there every request has one token), shared block slots in
`[0, limit]`, unique blocks in `[0, num_blocks]`. Like the 4-tuple of the
earlier scheme, the number of logits and of causal tiles follow the query
length: `min(query_len, max_num_seqs)` logits and the full lower triangle of
causal tiles. Combinations no step can reach are dropped (more unique blocks
than the requests can hold; more shared slots than the query rows allow; fewer
tokens or logits than the smallest step of the phase has, `plan/smallest.py`:
e.g. `c-u` needs 3 tokens, and batch-invariant mode has no unique phases).

Speculative decoding (`settings.num_speculative_tokens = k > 0`) widens the
decodes: each brings up to `1 + k` tokens (its last sampled token and its
drafts), causal among themselves, over its own context (read once for all of
them by the unique path's units: `ServerSettings` plans with `unique_tokens = 1 + k`,
which adds no size to a bucket). Such a step has causal work, but
only on the diagonal: `1 + k <= causal_tile` tokens of one request meet at
most two tile rows, so a step of `q` decode tokens needs at most `2 *
ceil(q / causal_tile) - 1` causal tiles, not the full triangle. The plan adds
these speculative-decode cells: causal query lengths up to `max_num_seqs *
(1 + k)` with that many tiles, so drafts pad to buckets of their own size
instead of the prefill buckets' triangles.

This is the plan the plugin builds at start when no plan file is given, so it is
serve-time code: it imports nothing offline.
"""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.bucket import Q, S, U, bucket_from_sizes
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.bucket_plans.cost import Hardware, ModelSpec
from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
from vllm_gaudi_unified.plan.smallest import can_hold_a_step
from vllm_gaudi_unified.plan.split import GatherCap


def exp_values(lo: int, hi: int, base: float = 2.0, step: int = 1) -> list[int]:
    """`lo, lo*base, lo*base**2, ...` rounded up to multiples of `step`, capped at and ending with `hi`."""
    if hi < lo:
        raise ValueError(f"maximum {hi} is below minimum {lo}")
    if lo < 1 or step < 1 or base <= 1:
        raise ValueError(f"exponential range needs lo >= 1, step >= 1 and base > 1 (got {lo}, {step}, {base})")
    out, v = [], float(lo)
    while True:
        x = min(int(-(-int(np.ceil(v - 1e-9)) // step) * step), hi)
        if not out or x > out[-1]:
            out.append(x)
        if x >= hi:
            return out
        v *= base


def max_causal_tiles(query_len: np.ndarray | int, tile: int):
    n = -(-np.asarray(query_len) // tile)
    return n * (n + 1) // 2


def speculative_causal_tiles(query_len: np.ndarray | int, tile: int, num_speculative_tokens: int):
    """Most causal tiles of a step of speculative decodes only (each request at most 1 + k <= tile
    tokens): a diagonal tile per row tile, plus one below it where a request straddles two row tiles."""
    n = -(-np.asarray(query_len) // tile)
    if num_speculative_tokens + 1 > tile:
        return max_causal_tiles(query_len, tile)
    return np.minimum(2 * n - 1, n * (n + 1) // 2)


def exponential_plan(settings: ServerSettings, model: ModelSpec | None = None, hardware: Hardware | None = None,
                     base: float = 2.0, query_step: int = 1, unique_step: int = 1,
                     cap: GatherCap | None = None) -> BucketPlan:
    """The classic baseline; see the module docstring. `cap`: no bucket gathers more block slots
    (sizes beyond it are clipped to it; the planner splits steps beyond it)."""
    model, hardware = model or ModelSpec(), hardware or Hardware()
    lim = settings.limits()
    kb, o = settings.blocks_per_tile, settings.options
    seqs = settings.max_num_seqs
    shared_vals = [0] + exp_values(kb, int(lim[S]), base, kb)
    unique_vals = [0] + (exp_values(1, int(lim[U]), base, unique_step) if lim[U] else [])  # invariant: no unique path
    rows: list[tuple] = []
    k = settings.num_speculative_tokens
    cells = [(False, seqs), (True, int(lim[Q]))]  # (causal, largest query) per kind of step
    if k:
        cells.append(("speculative", min(seqs * (1 + k), int(lim[Q]))))
    for causal, q_hi in cells:
        q_vals = exp_values(2 if causal else 1, q_hi, base, query_step)
        for q in q_vals:
            logits = min(q, seqs)
            tiles = 0 if not causal else int(max_causal_tiles(q, o.causal_tile) if causal is True
                                             else speculative_causal_tiles(q, o.causal_tile, k))
            # What the steps in this query cell can reach at most.
            reqs = min(q, seqs)
            unique_cap = min(reqs * settings.blocks_per_seq, int(lim[U]))
            shared_cap = settings.max_shared_blocks(q, reqs)
            for si, s in enumerate(shared_vals):
                if si > 1 and shared_vals[si - 1] + 1 > shared_cap:
                    continue
                for ui, u in enumerate(unique_vals):
                    if ui > 1 and unique_vals[ui - 1] + 1 > unique_cap:
                        continue
                    rows.append((q, s, u, logits, tiles))
    rows.append(tuple(int(x) for x in lim))  # the configured maxima, always
    cap = cap or GatherCap()
    sizes = np.array(rows, np.int64)
    sizes[:, S] = np.minimum(sizes[:, S], cap.max_shared_blocks or sizes[:, S].max())
    sizes[:, U] = np.minimum(sizes[:, U], cap.max_unique_blocks or sizes[:, U].max())
    limits = bucket_from_sizes(sizes[-1])
    buckets = sorted({b for b in map(bucket_from_sizes, sizes[:-1])
                      if can_hold_a_step(b, settings.block_size, o, settings.sliding_window)} | {limits})
    return BucketPlan(buckets, settings, model, hardware, strategy="exponential", gather_cap=cap,
                      info={"base": base, "query_step": query_step, "unique_step": unique_step,
                            **({"num_speculative_tokens": k} if k else {})})
