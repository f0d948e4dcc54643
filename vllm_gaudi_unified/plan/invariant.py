"""Batch-invariant mode: a request's output has the same bits whatever else is in its step.

Why the default mode is not invariant (each hazard was seen in a test, see
tests/test_batch_invariance.py and docs/batch_invariance.md):

1. causal tiles sit on the flattened token axis, so which keys share a tile
   (one softmax and one `p @ V` reduction) depends on the request's offset;
2. a cached block's keys are reduced per shared tile of several blocks when
   other tokens use it, per block when only this token does, so the
   shared/unique classification, which depends on the other requests, changes
   the reduction;
3. the partials of one token are summed by `index_add`, whose order is the
   order of the rows in the step (and, on CUDA, of the atomics);
4. matrix products change shape with the step: `[1, D] @ [D, K]` (a GEMV)
   rounds differently from the same row inside `[R, D] @ [D, K]`, and a library
   may pick another kernel for another batch count.

What this mode does instead, each step planned and run the same way:

* **self**: each token with its own key, the dot product summed by a fixed
  pairwise tree over `head_dim` (elementwise adds only);
* **cached**: every (query token, cached block) pair is one row of a *unit* of
  one block and `invariant_rows` query tokens that read it. Units of a block
  used by many tokens hold several of them, so the block is read and multiplied
  once per unit for all those tokens; a block used by one token gets a unit
  with one real row. Each row gets its own partial over that one block, so the
  pair's numbers never depend on which other rows or blocks are around;
* **causal**: tiles of `causal_tile` x `causal_tile` aligned to the start of
  each request, so a tile holds the same keys whatever the request's offset;
  rows and keys outside the request are masked (an empty partial merges
  exactly);
* every product has one shape, `invariant_chunk` units (or
  `invariant_causal_chunk` causal tiles) per call, the last call padded;
* **merge**: each (token, block) partial is written (not added) to slot
  `[token, logical block]` of a padded `[tokens, L]` array, each causal one to
  `[token, key tile]`, and each array is folded by a fixed pairwise tree over
  `L` (a power of two). Extra empty slots merge exactly, so `L`, which depends
  on the batch, does not change the result. Then self, cached, causal (and
  sinks) are merged in that order.

Padding to a bucket adds rows no request owns and empty units or tiles: they
touch no real row. The costs are the padded rows of units (a decode block is
multiplied for `invariant_rows` rows, of which one is real), the padded last
call of each path, and the per-block partials of shared blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of
from vllm_gaudi_unified.plan.arrays import (cached_pairs, check_causal_tiles, check_covers, chunk_groups, chunk_index,
                                            grow, move_no_row, ranges, step_tokens)
from vllm_gaudi_unified.plan.options import PathWork, PlanOptions
from vllm_gaudi_unified.plan.step_plan import StepPlan


@dataclass(frozen=True, eq=False)
class InvariantPlan(StepPlan):
    """A batch-invariant step: causal tiles counted from each request's first token, cached
    blocks as units; the shared/unique arrays of `StepPlan` are empty (no such paths here)."""

    unit_rows: np.ndarray  #: [units, invariant_rows] query token per unit row (query_len: none)
    unit_block: np.ndarray  #: [units] the one cache block of each unit
    unit_col: np.ndarray  #: [units, invariant_rows] logical index of the block in the row's request
    unit_lo: np.ndarray  #: [units, invariant_rows] first visible slot
    unit_hi: np.ndarray  #: [units, invariant_rows] end of visible slots
    causal_col: np.ndarray  #: [num_causal_tiles] key tile index within its request
    cached_width: int  #: slots per token for cached partials (a power of two)
    causal_width: int  #: slots per token for causal partials (a power of two)

    @property
    def work_planned(self) -> PathWork:
        b, opts = self.bucket, self.options
        return PathWork(causal=b.num_causal_tiles * opts.causal_tile**2 + b.query_len,
                        shared=b.num_shared_blocks * opts.invariant_rows * self.block_size)


def pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def plan_invariant(q, ctx, bt, nb_ctx, bs: int, W: int | None, num_blocks: int | None,
                   opts: PlanOptions) -> InvariantPlan:
    """`plan_step` for `options.batch_invariant` on checked inputs: the same semantics, the layout of this module."""
    R, T = q.size, int(q.sum())
    starts, tok_j, tok_req, tok_pos = step_tokens(q, ctx)
    pair_req, pair_blk, phys, _, max_block_id = cached_pairs(ctx, nb_ctx, bt, bs, W, num_blocks)

    units = _plan_units(phys, pair_req, pair_blk, q, starts, ctx, tok_pos, bs, W, T, opts)
    causal_q, causal_k, causal_col, causal_width = _plan_causal_tiles(q, starts, W, opts)
    shape = Bucket(phase=phase_of(causal_q.size, units["rows"].shape[0], 0), query_len=T,
                   num_shared_blocks=units["rows"].shape[0], num_unique_blocks=0, num_logits=R,
                   num_causal_tiles=causal_q.size)
    needed = PathWork(causal=int(np.minimum(tok_j + 1, W if W is not None else T + 1).sum()),
                        shared=int((units["hi"] - units["lo"]).sum()))
    rows_kb = np.zeros((0, opts.shared_rows), np.int32)
    none3 = np.zeros((0, opts.shared_rows, 1), np.int32)
    empty = np.zeros(0, np.int32)
    return InvariantPlan(
        block_size=bs, sliding_window=W, options=opts, num_requests=R, num_tokens=T, shape=shape, bucket=shape,
        token_seg_start=starts[tok_req].astype(np.int32), causal_q_start=causal_q, causal_k_start=causal_k,
        shared_rows=rows_kb, shared_blocks=np.zeros((0, 1), np.int32), shared_lo=none3, shared_hi=none3,
        unique_rows=empty, unique_blocks=empty, unique_lo=empty, unique_hi=empty,
        logits_indices=(starts + q - 1).astype(np.int32), max_block_id=max_block_id,
        work_needed=needed, shared_prefix_visible=False,
        unit_rows=units["rows"], unit_block=units["block"], unit_col=units["col"],
        unit_lo=units["lo"], unit_hi=units["hi"], causal_col=causal_col,
        cached_width=pow2(int(nb_ctx.max())), causal_width=causal_width)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _plan_units(phys, pair_req, pair_blk, q, starts, ctx, tok_pos, bs, W, T, opts):
    """Units of (one cached block, up to `invariant_rows` query tokens that see it); one row per
    (token, block) pair; padded with empty units to a multiple of `invariant_chunk`."""
    rs = opts.invariant_rows
    row_j, row_pair = ranges(np.zeros_like(pair_req), q[pair_req])  # every token of the pair's request
    req, blk, ids = pair_req[row_pair], pair_blk[row_pair], phys[row_pair]
    tok = starts[req] + row_j
    hi = np.minimum(bs, ctx[req] - blk * bs)
    lo = np.zeros_like(hi) if W is None else np.clip(tok_pos[tok] - W + 1 - blk * bs, 0, hi)
    keep = lo < hi
    req, blk, ids, tok, lo, hi = req[keep], blk[keep], ids[keep], tok[keep], lo[keep], hi[keep]
    order = np.lexsort((blk, tok, ids))  # by block id, then token: units of one block
    blk, ids, tok, lo, hi = blk[order], ids[order], tok[order], lo[order], hi[order]
    bounds = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if ids.size else np.zeros(0, np.int64)
    sizes = np.diff(np.r_[bounds, ids.size]).astype(np.int64)
    group, first, count = chunk_groups(sizes, rs)
    idx, ok = chunk_index(first, count, rs)
    n = _round_up(group.size, opts.invariant_chunk)

    def padded(a, fill, dtype=np.int32):  # tokens, slots and columns fit int32 (plan/arrays.py limits)
        out = np.full((n,) + a.shape[1:], fill, dtype)
        out[:a.shape[0]] = a
        return out

    return dict(
        rows=padded(np.where(ok, tok[idx] if tok.size else 0, T), T),
        block=padded(ids[bounds][group] if ids.size else np.zeros(0, np.int64), 0, np.int64),  # ids need 64 bits
        col=padded(np.where(ok, blk[idx] if blk.size else 0, 0), 0),
        lo=padded(np.where(ok, lo[idx] if lo.size else 0, 0), 0),
        hi=padded(np.where(ok, hi[idx] if hi.size else 0, 0), 0))


def _plan_causal_tiles(q, starts, W, opts):
    """(query tile a, key tile b <= a) of each request with two or more new tokens, tiles counted
    from the request's first token; padded to a multiple of `invariant_causal_chunk`."""
    c = opts.causal_tile
    n_tiles = np.where(q >= 2, -(-q // c), 0)
    a, a_req = ranges(np.zeros_like(q), n_tiles)
    first_b = np.zeros_like(a) if W is None else np.maximum(a * c - W + 1, 0) // c
    check_causal_tiles(int((a - first_b + 1).sum()), c)
    b, owner = ranges(first_b, a - first_b + 1)
    req, a = a_req[owner], a[owner]
    width = pow2(int(n_tiles.max()) if n_tiles.size else 1)
    n = _round_up(b.size, opts.invariant_causal_chunk)
    T = int(q.sum())

    def padded(x, fill):
        out = np.full(n, fill, np.int32)
        out[:x.size] = x
        return out

    return (padded(starts[req] + a * c, T), padded(starts[req] + b * c, 0), padded(b, 0), width)


def pad_invariant(plan: InvariantPlan, bucket: Bucket) -> InvariantPlan:
    """`pad_plan` for an invariant plan: empty units, tiles and rows, never a changed real one."""
    check_covers(bucket, plan.shape)
    T, Tp = plan.bucket.query_len, bucket.query_len

    def rows(a):
        return move_no_row(a, T, Tp)

    nu, nc, nq = bucket.num_shared_blocks, bucket.num_causal_tiles, bucket.num_unique_blocks
    empty = np.zeros(0, np.int32)
    return replace(
        plan, bucket=bucket,
        token_seg_start=np.concatenate([plan.token_seg_start, np.arange(T, Tp, dtype=np.int32)]),
        causal_q_start=grow(rows(plan.causal_q_start), nc, Tp), causal_k_start=grow(plan.causal_k_start, nc, 0),
        causal_col=grow(plan.causal_col, nc, 0),
        unit_rows=grow(rows(plan.unit_rows), nu, Tp), unit_block=grow(plan.unit_block, nu, 0),
        unit_col=grow(plan.unit_col, nu, 0), unit_lo=grow(plan.unit_lo, nu, 0), unit_hi=grow(plan.unit_hi, nu, 0),
        # A bucket made for the default mode may have unique slots: empty ones, never read.
        unique_rows=np.full(nq, Tp, np.int32), unique_blocks=np.zeros(nq, np.int32) if nq else empty,
        unique_lo=np.zeros(nq, np.int32), unique_hi=np.zeros(nq, np.int32),
        logits_indices=grow(plan.logits_indices, bucket.num_logits, 0))


