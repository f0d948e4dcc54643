"""Attention work of a trace: needed, planned (tiled) and the dense design's, per path.

    python -m benchmarks.trace_work TRACE [--limit N] [--json OUT] [planner flags]

`vllm-gaudi-unified trace-stats` with one more column, the dense design this project started from,
defined here as work counts (`dense_work`) and as a plan the device code runs (`dense_plan`, the `dense`
variant of `benchmarks.speed`):
the causal path in 512-row slices over the flattened batch (every key slice at or below the query slice,
cross-request tiles included), the shared path as one tile of every new token against every shared
block, the unique path over the contiguous cache slice `[0, max id]`. The package itself knows nothing
of it: benchmarks compare the planner against it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of
from vllm_gaudi_unified.plan import PathWork, PlanOptions, StepPlan, plan_step
from vllm_gaudi_unified.tools import trace_stats
from vllm_gaudi_unified.tools.cli import Parser

DENSE_SLICE = 512  #: rows of the dense design's causal slices


def dense_work(plan: StepPlan) -> PathWork:
    """Score pairs the dense design computes for the step of `plan` (a default-mode, unpadded plan):
    the same shared/unique split of the cached blocks as the planner, without its tiling."""
    T, bs = plan.num_tokens, plan.block_size
    slices = -(-T // DENSE_SLICE)
    causal = sum(DENSE_SLICE * min(T, (a + 1) * DENSE_SLICE) for a in range(slices))
    shared_ids = np.unique(plan.shared_blocks[(plan.shared_hi > 0).any(axis=1)])
    unique_ids = np.flatnonzero(plan.unique_rows < T) if plan.unique_blocks is None else plan.unique_blocks
    unique = (int(unique_ids.max()) + 1) * bs if unique_ids.size else 0
    return PathWork(causal=causal, shared=T * shared_ids.size * bs, unique=unique)


def dense_plan(query_lens, context_lens, block_table, block_size: int, num_blocks: int) -> StepPlan:
    """The dense design as a `StepPlan` (no sliding window): see the module's docstring."""
    q, ctx = np.asarray(query_lens, np.int64), np.asarray(context_lens, np.int64)
    bt, bs = np.asarray(block_table, np.int64), int(block_size)
    base = plan_step(q, ctx, bt, bs, num_blocks=num_blocks,
                     options=PlanOptions(causal_tile=DENSE_SLICE, unique_layout="slice", prompt_route="tiles"))
    R, T = q.size, int(q.sum())
    # The planner's rule for shared: a cached block used by two requests, or by a request with several new tokens.
    nb_ctx = -(-ctx // bs)
    pair_req = np.repeat(np.arange(R), nb_ctx)
    pair_blk = np.arange(pair_req.size) - np.repeat(np.cumsum(nb_ctx) - nb_ctx, nb_ctx)
    phys = bt[pair_req, pair_blk]
    uses = np.bincount(phys, minlength=num_blocks)
    is_shared = (uses[phys] > 1) | (q[pair_req] > 1)
    S = np.unique(phys[is_shared])
    tok_req = np.repeat(np.arange(R), q)
    if S.size:  # one tile: every token x every shared block, visible slots [0, hi) where its request holds it
        req_hi = np.zeros((R, S.size), np.int64)
        sel = np.flatnonzero(is_shared)
        req_hi[pair_req[sel], np.searchsorted(S, phys[sel])] = np.clip(ctx[pair_req[sel]] - pair_blk[sel] * bs, 0, bs)
        shared_hi = req_hi[tok_req][None]
        shared_rows, shared_blocks = np.arange(T, dtype=np.int64)[None], S[None].astype(np.int64)
    else:
        shared_hi = np.zeros((0, T, 1), np.int64)
        shared_rows, shared_blocks = np.zeros((0, T), np.int64), np.zeros((0, 1), np.int64)
    if base.causal_q_start.size:  # every key slice at or below each query slice of the flattened batch
        n = -(-T // DENSE_SLICE)
        a, b = np.tril_indices(n)
        causal_q, causal_k = a.astype(np.int64) * DENSE_SLICE, b.astype(np.int64) * DENSE_SLICE
    else:
        causal_q = causal_k = np.zeros(0, np.int64)
    nu = base.bucket.num_unique_blocks
    shape = Bucket(phase=phase_of(causal_q.size, S.size, nu), query_len=T, num_shared_blocks=int(S.size),
                   num_unique_blocks=nu, num_logits=R, num_causal_tiles=int(causal_q.size))
    opts = PlanOptions(causal_tile=DENSE_SLICE, shared_rows=max(T, 1), shared_tile_keys=max(int(S.size), 1) * bs,
                       unique_layout="slice", prompt_route="tiles")
    return replace(base, options=opts, shape=shape, bucket=shape, causal_q_start=causal_q, causal_k_start=causal_k,
                   shared_rows=shared_rows, shared_blocks=shared_blocks, shared_lo=np.zeros_like(shared_hi),
                   shared_hi=shared_hi, shared_prefix_visible=False)  # its one tile mixes requests' blocks


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.trace_work", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_stats.add_arguments(p)
    return trace_stats.run(p.parse_args(argv), measures={"dense": dense_work})


if __name__ == "__main__":
    sys.exit(main())
