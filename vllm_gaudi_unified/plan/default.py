"""The default planner: which (query token, key) pairs each path computes, in tiles.

Pure numpy, no torch, no vLLM: it runs every step, before any device work, and
the bucketing tools replay it over whole traces.

Lengths of one request `r` (positions in the sequence)::

    |---------- context_len ----------|---- query_len ----|
    |  keys read from the KV cache    | new tokens: q/k/v |
    0                            context_len        context_len + query_len

Token `j` of `r` sits at position `p = context_len + j` and attends positions
`max(0, p - sliding_window + 1) .. p` of `r`. The pairs are split, each pair
computed exactly once:

* **self**: every token against its own key (elementwise, always on);
* **causal**: a token against earlier new tokens of its request, in square
  tiles on the flattened token axis; only tiles some pair needs are listed, so
  tiles that pair two requests are never computed;
* **shared**: cache blocks needed by more than one query token (a chunk over its
  own context, a prefix common to several requests). Blocks are grouped by the
  set of requests that use them and each group is cut into tiles of
  `shared_rows` query tokens x `blocks_per_tile` blocks, so a prefix common to
  64 decodes is read once for all 64 and no token meets a block it cannot see;
* **unique**: cache blocks needed by exactly one query token (the usual decode),
  one row per block, computed per block rather than per token; either the
  contiguous cache slice `[0, max id + 1)` (no gather) or only the live blocks
  (gathered), whichever the layout option picks for this step.

Visibility inside a cache block is one interval of slots `[lo, hi)` per
(token, block): `hi` cuts the context (a partial last block, or a block this
token's request does not use), `lo` applies the sliding window. No dense bias
is built on the host: the device makes masks from these small integer arrays.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of
from vllm_gaudi_unified.plan.arrays import (cached_pairs, check_causal_tiles, check_covers, chunk_groups, chunk_index,
                                            grow, move_no_row, ranges, same_id_sum, step_tokens)
from vllm_gaudi_unified.plan.options import PathWork, PlanOptions
from vllm_gaudi_unified.plan.rules import (MAX_SLICE_BLOCKS, causal_spans, group_columns, shared_pairs, shared_tiles,
                                           unique_reads_slice)
from vllm_gaudi_unified.plan.step_plan import StepPlan


# ----------------------------------------------------------------------------- the planner


def plan_default(q, ctx, bt, nb_ctx, bs: int, W: int | None, num_blocks: int | None, opts: PlanOptions) -> StepPlan:
    """`plan_step` in the default mode (see the module docstring) on checked inputs (`arrays.validate`);
    arrays are unpadded: `bucket == shape`."""
    R, T = q.size, int(q.sum())
    starts, tok_j, tok_req, tok_pos = step_tokens(q, ctx)
    seg_start = starts[tok_req]
    pair_req, pair_blk, phys, counts, max_block_id = cached_pairs(ctx, nb_ctx, bt, bs, W, num_blocks)
    pair_hi = np.full(phys.size, bs, np.int64)  # every block is full but a request's last one
    last = (np.cumsum(counts) - 1)[counts > 0]
    pair_hi[last] = ctx[counts > 0] - pair_blk[last] * bs
    if W is None:  # every token of the request sees every block
        is_shared = shared_pairs(phys, q, counts)
    else:  # token j sees the block's last key k while j <= k - context_len + W - 1
        users = np.clip(pair_blk * bs + pair_hi - 1 - ctx[pair_req] + W, 0, q[pair_req])
        is_shared = same_id_sum(phys, max_block_id, users) > 1 if phys.size else np.zeros(0, bool)

    unique = _plan_unique(~is_shared, phys, pair_req, pair_blk, pair_hi, starts, ctx, bs, W, T, opts, counts)
    shared = _plan_shared(is_shared, phys, pair_req, pair_blk, q, starts, ctx, bt, tok_req, tok_pos, bs, W, T, opts)
    causal_q, causal_k, causal_needed = _plan_causal(seg_start, tok_j, T, W, opts.causal_tile)

    kb = opts.blocks_per_tile(bs)
    shape = Bucket(
        phase=phase_of(causal_q.size, shared[0].shape[0], unique[0].size),
        query_len=T, num_shared_blocks=shared[0].shape[0] * kb, num_unique_blocks=unique[0].size,
        num_logits=R, num_causal_tiles=causal_q.size)
    needed = PathWork(causal=causal_needed, shared=int((shared[3] - shared[2]).sum()),
                      unique=int((unique[3] - unique[2]).sum()))
    return StepPlan(
        block_size=bs, sliding_window=W, options=opts, num_requests=R, num_tokens=T, shape=shape, bucket=shape,
        token_seg_start=seg_start, causal_q_start=causal_q, causal_k_start=causal_k,
        shared_rows=shared[0], shared_blocks=shared[1], shared_lo=shared[2], shared_hi=shared[3],
        unique_rows=unique[0], unique_blocks=unique[1], unique_lo=unique[2], unique_hi=unique[3],
        logits_indices=(starts + q - 1), max_block_id=max_block_id,
        work_needed=needed, shared_prefix_visible=shared[4])


def _plan_unique(mask, phys, pair_req, pair_blk, pair_hi, starts, ctx, bs, W, T, opts, counts):
    """One row per block used by exactly one token: the first token of its request (the only
    one that sees it: with a window, later tokens see less far back)."""
    if mask.all():  # the usual decode step: every pair is unique, rows by repeating (no gather)
        rows = np.repeat(starts, counts)
    else:
        phys, pair_req, pair_blk, pair_hi = phys[mask], pair_req[mask], pair_blk[mask], pair_hi[mask]
        rows = starts[pair_req]
    ids, req, blk, hi = phys, pair_req, pair_blk, pair_hi
    lo = np.zeros_like(hi) if W is None else np.clip(ctx[req] - W + 1 - blk * bs, 0, hi)
    if ids.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, (empty if opts.unique_layout == "gather" else None), empty, empty
    span = int(ids.max()) + 1
    if opts.unique_layout == "slice" and span > MAX_SLICE_BLOCKS:
        raise ValueError(f"unique_layout='slice' would read cache blocks [0, {span}) for block id {span - 1}: "
                         f"more than {MAX_SLICE_BLOCKS}; use 'gather' or 'auto'")
    if not unique_reads_slice(ids.size, span - 1, opts):
        return rows, ids, lo, hi
    slot_rows = np.full(span, T, np.int64)
    slot_hi = np.zeros(span, np.int64)
    slot_rows[ids], slot_hi[ids] = rows, hi
    slot_lo = np.zeros(span, np.int64)
    if W is not None:  # without a window every lo is 0
        slot_lo[ids] = lo
    return slot_rows, None, slot_lo, slot_hi


def _plan_shared(mask, phys, pair_req, pair_blk, q, starts, ctx, bt, tok_req, tok_pos, bs, W, T, opts):
    """Tiles of (query tokens x blocks) over groups of blocks with the same set of user requests.

    Every row of a group uses every column of the group (the grouping is exact),
    so a cell's visible slots follow from the row's context length and position
    and the column's first position alone: no per-cell lookup of the block table."""
    qt, kb = opts.shared_rows, opts.blocks_per_tile(bs)
    if not mask.any():
        z = np.zeros((0, qt, kb), np.int64)
        return np.zeros((0, qt), np.int64), np.zeros((0, kb), np.int64), z, z, W is None
    s_phys, s_req, s_blk = phys[mask], pair_req[mask], pair_blk[mask]
    # Columns are (block id, position in the request); pairs sorted by column, requests in order within one.
    col_key = s_phys * bt.shape[1] + s_blk
    order = np.argsort(col_key, kind="stable")
    col_key_sorted, req_sorted = col_key[order], s_req[order]
    col_start = np.flatnonzero(np.r_[True, col_key_sorted[1:] != col_key_sorted[:-1]])
    col_users = np.diff(np.r_[col_start, order.size])
    col_group, collided = group_columns(np.zeros(col_start.size, np.int64), req_sorted, req_sorted, col_start,
                                        col_users)
    if collided.any():  # one group per column: a tile never pairs a token with a block its request lacks
        col_group = np.arange(col_start.size)
    col_phys, col_blk = s_phys[order][col_start], s_blk[order][col_start]
    G = int(col_group.max()) + 1
    # A group's requests are those of its first column (all its columns have the same users).
    first_col = np.full(G, -1, np.int64)
    first_col[col_group[::-1]] = np.arange(col_group.size)[::-1]
    req_idx, gr_group = ranges(col_start[first_col], col_users[first_col])
    gr_req = req_sorted[req_idx]
    # Group-sorted row list (tokens of the group's requests) and column list.
    rows_flat, _ = ranges(starts[gr_req], q[gr_req])
    rows_per_group = np.bincount(gr_group, weights=q[gr_req], minlength=G).astype(np.int64)
    # Within a group, columns in request order: a request's partly filled last block comes last, so a
    # tile's visible keys are one prefix (what the fused kernel's per-segment key count can express).
    col_order = np.lexsort((col_blk, col_group))
    cols_per_group = np.bincount(col_group, minlength=G)
    # Tiles: every (row chunk, column chunk) of each group.
    r_grp, r_first, r_cnt = chunk_groups(rows_per_group, qt)
    c_grp, c_first, c_cnt = chunk_groups(cols_per_group, kb)
    r_chunks, c_chunks = -(-rows_per_group // qt), -(-cols_per_group // kb)
    pair_local, tile_group = ranges(np.zeros(G, np.int64), shared_tiles(rows_per_group, cols_per_group, opts, bs))
    r_off, c_off = np.cumsum(r_chunks) - r_chunks, np.cumsum(c_chunks) - c_chunks
    ri = r_off[tile_group] + pair_local // c_chunks[tile_group]
    ci = c_off[tile_group] + pair_local % c_chunks[tile_group]
    row_idx, row_ok = chunk_index(r_first[ri], r_cnt[ri], qt)
    col_idx, col_ok = chunk_index(c_first[ci], c_cnt[ci], kb)
    rows = np.where(row_ok, rows_flat[row_idx], T)
    cphys = np.where(col_ok, col_phys[col_order][col_idx], 0)
    # Visible slots of a cell: [lo, hi) with hi = the row's context past the block start (0 for padding).
    row_ctx = np.where(row_ok, ctx[tok_req[np.minimum(rows, T - 1)]], 0)  # [tiles, rows]
    col_pos = np.where(col_ok, col_blk[col_order][col_idx] * bs, 0)  # [tiles, blocks]
    hi = np.clip(row_ctx[:, :, None] - col_pos[:, None, :], 0, bs) * col_ok[:, None, :]
    if W is None:
        lo = np.zeros_like(hi)
    else:
        row_lo = tok_pos[np.minimum(rows, T - 1)] - W + 1  # first visible position of the row
        lo = np.clip(row_lo[:, :, None] - col_pos[:, None, :], 0, hi)
    return rows, cphys, lo, hi, W is None and _prefix_visible(row_ctx, row_ok, col_pos, col_ok, bs)


def _prefix_visible(row_ctx, row_ok, col_pos, col_ok, bs: int) -> bool:
    """True when every shared tile's real rows all see the same keys and those keys are a prefix of the
    tile's slots (full blocks, then at most one partial one, then none): then a tile is one segment of a
    fused kernel with a key count (`paths/shared.py`). vLLM shares only full blocks, so this holds for
    its steps; a table that shares a partly filled block falls back to the masked tiles.

    Without a window a cell's `hi` grows with the row's context, so the rows of a tile agree exactly
    when its shortest and longest real contexts do: [tiles, blocks] work, not [tiles, rows, blocks]."""
    big = np.iinfo(np.int64).max
    longest = np.where(row_ok, row_ctx, -1).max(1)[:, None]
    shortest = np.where(row_ok, row_ctx, big).min(1)[:, None]
    top = np.clip(longest - col_pos, 0, bs) * col_ok
    same = (top == np.clip(np.minimum(shortest, longest) - col_pos, 0, bs) * col_ok).all()
    return bool(same and ((top[:, 1:] == 0) | (top[:, :-1] == bs)).all())


def _plan_causal(seg_start, tok_j, T, W, tile):
    """Tiles (query slice, key slice) on the flattened token axis that hold some strict-causal pair."""
    if tok_j.size == 0 or tok_j.max() == 0:  # single-token requests: only self pairs
        empty = np.zeros(0, np.int64)
        return empty, empty, T
    t = np.arange(T)
    klo = seg_start if W is None else np.maximum(seg_start, t - W + 1)
    needs = klo <= t - 1  # at least one earlier new token of the same request is visible
    needed = int(np.minimum(tok_j + 1, W if W is not None else T + 1).sum())
    if not needs.any():
        empty = np.zeros(0, np.int64)
        return empty, empty, needed
    first_q, active, first_k, last_k = causal_spans(t // tile, t, klo, needs, tile)
    first_q, first_k, last_k = first_q[active], first_k[active], last_k[active]
    check_causal_tiles(int((last_k - first_k + 1).sum()), tile)
    k_tiles, owner = ranges(first_k, last_k - first_k + 1)
    return first_q[owner], k_tiles * tile, needed


# ----------------------------------------------------------------------------- padding


def pad_default(plan: StepPlan, bucket: Bucket) -> StepPlan:
    """`pad_plan` in the default mode: padding adds only fully masked work."""
    check_covers(bucket, plan.shape)
    kb = plan.options.blocks_per_tile(plan.block_size)
    if bucket.num_shared_blocks % kb:
        raise ValueError(f"bucket num_shared_blocks {bucket.num_shared_blocks} is not a multiple of the "
                         f"{kb} blocks of a shared tile (block_size {plan.block_size})")
    T, Tp = plan.bucket.query_len, bucket.query_len

    def rows(a):
        return move_no_row(a, T, Tp)

    ns = bucket.num_shared_blocks // kb
    nu = bucket.num_unique_blocks
    return replace(
        plan, bucket=bucket,
        token_seg_start=np.concatenate([plan.token_seg_start, np.arange(T, Tp, dtype=np.int64)]),
        causal_q_start=grow(rows(plan.causal_q_start), bucket.num_causal_tiles, Tp),
        causal_k_start=grow(plan.causal_k_start, bucket.num_causal_tiles, 0),
        shared_rows=grow(rows(plan.shared_rows), ns, Tp), shared_blocks=grow(plan.shared_blocks, ns, 0),
        shared_lo=grow(plan.shared_lo, ns, 0), shared_hi=grow(plan.shared_hi, ns, 0),
        unique_rows=grow(rows(plan.unique_rows), nu, Tp),
        unique_blocks=None if plan.unique_blocks is None else grow(plan.unique_blocks, nu, 0),
        unique_lo=grow(plan.unique_lo, nu, 0), unique_hi=grow(plan.unique_hi, nu, 0),
        logits_indices=grow(plan.logits_indices, bucket.num_logits, 0))


