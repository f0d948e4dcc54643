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

from dataclasses import replace

import numpy as np
import torch

from vllm_gaudi_unified.bucket import Bucket, phase_of
from vllm_gaudi_unified.merge import Partial, merge

# ----------------------------------------------------------------------------- plan (host, numpy)


def _pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def plan_step_invariant(query_lens, context_lens, block_table, block_size: int, *, sliding_window, num_blocks,
                        options):
    """`plan.plan_step` for `options.batch_invariant`: the same semantics, the layout of this module."""
    from vllm_gaudi_unified import plan as P  # plan imports this module lazily: no cycle at import time

    opts = options
    q, ctx, bt, nb_ctx = P._validate(query_lens, context_lens, block_table, block_size, sliding_window, num_blocks)
    bs, W = int(block_size), sliding_window
    R, T = q.size, int(q.sum())
    starts = np.cumsum(q) - q
    tok_j, tok_req = P._ranges(np.zeros_like(q), q)
    tok_pos = ctx[tok_req] + tok_j

    # (request, cached block) pairs some token of the request may see.
    first_blk = np.zeros_like(ctx) if W is None else np.maximum(ctx - W + 1, 0) // bs
    pair_blk, pair_req = P._ranges(first_blk, np.maximum(nb_ctx - first_blk, 0))
    phys = bt[pair_req, pair_blk]
    P._first_bad_block(phys, pair_req, pair_blk, num_blocks)
    max_block_id = int(phys.max()) if phys.size else -1

    units = _plan_units(phys, pair_req, pair_blk, q, starts, ctx, tok_pos, bs, W, T, opts)
    causal_q, causal_k, causal_col, causal_width = _plan_causal_tiles(q, starts, W, opts)
    shape = Bucket(phase=phase_of(causal_q.size, units["rows"].shape[0], 0), query_len=T,
                   num_shared_blocks=units["rows"].shape[0], num_unique_blocks=0, num_logits=R,
                   num_causal_tiles=causal_q.size)
    needed = P.PathWork(causal=int(np.minimum(tok_j + 1, W if W is not None else T + 1).sum()),
                        shared=int((units["hi"] - units["lo"]).sum()))
    rows_kb = np.zeros((0, opts.shared_rows), np.int32)
    none3 = np.zeros((0, opts.shared_rows, 1), np.int32)
    empty = np.zeros(0, np.int32)
    return P.StepPlan(
        block_size=bs, sliding_window=W, options=opts, num_requests=R, num_tokens=T, shape=shape, bucket=shape,
        token_seg_start=starts[tok_req].astype(np.int32), causal_q_start=causal_q, causal_k_start=causal_k,
        shared_rows=rows_kb, shared_blocks=np.zeros((0, 1), np.int32), shared_lo=none3, shared_hi=none3,
        unique_rows=empty, unique_blocks=empty, unique_lo=empty, unique_hi=empty,
        logits_indices=(starts + q - 1).astype(np.int32), max_block_id=max_block_id,
        work_needed=needed, work_dense=needed,
        inv_unit_rows=units["rows"], inv_unit_block=units["block"], inv_unit_col=units["col"],
        inv_unit_lo=units["lo"], inv_unit_hi=units["hi"], inv_causal_col=causal_col,
        inv_cached_width=_pow2(int(nb_ctx.max())), inv_causal_width=causal_width)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _plan_units(phys, pair_req, pair_blk, q, starts, ctx, tok_pos, bs, W, T, opts):
    """Units of (one cached block, up to `invariant_rows` query tokens that see it); one row per
    (token, block) pair; padded with empty units to a multiple of `invariant_chunk`."""
    from vllm_gaudi_unified import plan as P

    rs = opts.invariant_rows
    row_j, row_pair = P._ranges(np.zeros_like(pair_req), q[pair_req])  # every token of the pair's request
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
    group, first, count = P._tile(sizes, rs)
    idx, ok = P._chunk_index(first, count, rs)
    n = _round_up(group.size, opts.invariant_chunk)

    def padded(a, fill):
        out = np.full((n,) + a.shape[1:], fill, np.int32)
        out[:a.shape[0]] = a
        return out

    return dict(
        rows=padded(np.where(ok, tok[idx] if tok.size else 0, T), T),
        block=padded(ids[bounds][group] if ids.size else np.zeros(0, np.int64), 0),
        col=padded(np.where(ok, blk[idx] if blk.size else 0, 0), 0),
        lo=padded(np.where(ok, lo[idx] if lo.size else 0, 0), 0),
        hi=padded(np.where(ok, hi[idx] if hi.size else 0, 0), 0))


def _plan_causal_tiles(q, starts, W, opts):
    """(query tile a, key tile b <= a) of each request with two or more new tokens, tiles counted
    from the request's first token; padded to a multiple of `invariant_causal_chunk`."""
    from vllm_gaudi_unified import plan as P

    c = opts.causal_tile
    n_tiles = np.where(q >= 2, -(-q // c), 0)
    a, a_req = P._ranges(np.zeros_like(q), n_tiles)
    first_b = np.zeros_like(a) if W is None else np.maximum(a * c - W + 1, 0) // c
    b, owner = P._ranges(first_b, a - first_b + 1)
    req, a = a_req[owner], a[owner]
    width = _pow2(int(n_tiles.max()) if n_tiles.size else 1)
    n = _round_up(b.size, opts.invariant_causal_chunk)
    T = int(q.sum())

    def padded(x, fill):
        out = np.full(n, fill, np.int32)
        out[:x.size] = x
        return out

    return (padded(starts[req] + a * c, T), padded(starts[req] + b * c, 0), padded(b, 0), width)


def pad_plan_invariant(plan, bucket: Bucket):
    """`plan.pad_plan` for an invariant plan: empty units, tiles and rows, never a changed real one."""
    from vllm_gaudi_unified import plan as P

    P._check_covers(bucket, plan.shape)
    T, Tp = plan.bucket.query_len, bucket.query_len

    def rows(a):
        return np.where(a == T, Tp, a).astype(np.int32)

    def grow(a, n, fill):
        return np.concatenate([a, np.full((n - a.shape[0],) + a.shape[1:], fill, a.dtype)])

    nu, nc, nq = bucket.num_shared_blocks, bucket.num_causal_tiles, bucket.num_unique_blocks
    empty = np.zeros(0, np.int32)
    return replace(
        plan, bucket=bucket,
        token_seg_start=np.concatenate([plan.token_seg_start, np.arange(T, Tp, dtype=np.int32)]),
        causal_q_start=grow(rows(plan.causal_q_start), nc, Tp), causal_k_start=grow(plan.causal_k_start, nc, 0),
        inv_causal_col=grow(plan.inv_causal_col, nc, 0),
        inv_unit_rows=grow(rows(plan.inv_unit_rows), nu, Tp), inv_unit_block=grow(plan.inv_unit_block, nu, 0),
        inv_unit_col=grow(plan.inv_unit_col, nu, 0), inv_unit_lo=grow(plan.inv_unit_lo, nu, 0),
        inv_unit_hi=grow(plan.inv_unit_hi, nu, 0),
        # A bucket made for the default mode may have unique slots: empty ones, never read.
        unique_rows=np.full(nq, Tp, np.int32), unique_blocks=np.zeros(nq, np.int32) if nq else empty,
        unique_lo=np.zeros(nq, np.int32), unique_hi=np.zeros(nq, np.int32),
        logits_indices=grow(plan.logits_indices, bucket.num_logits, 0))


# ----------------------------------------------------------------------------- run (device, torch)


def invariant_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, batch, scale: float, soft_cap: float | None) -> Partial:
    """All keys of every token, merged in a fixed order: self, cached blocks, causal tiles."""
    out = _self_partial(q, k, v, scale, soft_cap)
    for part in (_cached_partial(q, key_cache, value_cache, batch, scale, soft_cap),
                 _causal_partial(q, k, v, batch, scale, soft_cap)):
        if part is not None:
            out = merge(out, part)
    return out


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed pairwise tree (zero-padded to a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        x = torch.nn.functional.pad(x, (0, _pow2(n) - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _self_partial(q, k, v, scale, soft_cap) -> Partial:
    t, hq, d = q.shape
    hkv = k.shape[1]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = _tree_sum(q.to(dt).view(t, hkv, hq // hkv, d) * k.to(dt).view(t, hkv, 1, d)).reshape(t, hq) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    acc = v.to(dt)[:, :, None, :].expand(t, hkv, hq // hkv, d).reshape(t, hq, d)
    return Partial(acc, s, torch.ones_like(s))


def _attend(q, k, v, mask, scale, soft_cap) -> Partial:
    """q `[N, R, Hq, D]`, k/v `[N, K, Hkv, D]`, mask `[N, R, K]` -> Partial `[N*R, Hq, D]`.

    Always one shape per path (N, R, K fixed), so every row of every call takes
    the same arithmetic: products in the inputs' dtype with fp32 accumulation
    (fp64 for fp64), softmax statistics in fp32, `p` rounded to the value dtype.
    """
    n, r, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.view(n, r, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * r, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).to(dt).view(n, hkv, g, r, nk) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    m = scores.amax(-1)
    p = torch.exp(scores - torch.where(m > float("-inf"), m, 0.0)[..., None])
    total = p.sum(-1)
    seen = mask.any(1)  # [N, K]: keys no row may see are zeroed (a poisoned slot times 0 is still NaN)
    vv = torch.where(seen[:, None, :, None], v.permute(0, 2, 1, 3), torch.zeros((), dtype=v.dtype, device=v.device))
    acc = torch.matmul(p.to(v.dtype).reshape(n, hkv, g * r, nk), vv).to(dt).view(n, hkv, g, r, d)
    rows = lambda x: x.permute(0, 3, 1, 2, *range(4, x.dim())).reshape(n * r, hq, *x.shape[4:])
    return Partial(rows(acc), rows(m), rows(total))


class _Slots:
    """A `[tokens, width]` array of partials plus one dump slot per row of a call; each real
    (token, slot) is written once, never added to, so no order of writes matters."""

    def __init__(self, tokens: int, width: int, call_rows: int, hq: int, d: int, dtype, device):
        self.tokens, self.width, self.call_rows = tokens, width, call_rows
        size = tokens * width + call_rows
        self.acc = torch.zeros((size, hq, d), dtype=dtype, device=device)
        self.max = torch.full((size, hq), float("-inf"), dtype=dtype, device=device)
        self.sum = torch.zeros((size, hq), dtype=dtype, device=device)
        self.dump = tokens * width + torch.arange(call_rows, device=device)

    def write(self, part: Partial, rows: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor) -> None:
        dest = torch.where(valid, rows * self.width + cols, self.dump.view(valid.shape)).reshape(-1)
        self.acc.index_copy_(0, dest, part.acc)
        self.max.index_copy_(0, dest, part.max)
        self.sum.index_copy_(0, dest, part.sum)

    def fold(self) -> Partial:
        """Merge each token's `width` slots by a fixed pairwise tree (halves, then halves again)."""
        n, w = self.tokens, self.width
        acc, m, s = (x[:n * w].view(n, w, *x.shape[1:]) for x in (self.acc, self.max, self.sum))
        while w > 1:
            h = w // 2
            acc, m, s = merge(Partial(acc[:, :h], m[:, :h], s[:, :h]), Partial(acc[:, h:], m[:, h:], s[:, h:]))
            w = h
        return Partial(acc[:, 0], m[:, 0], s[:, 0])


def _chunks(total: int, size: int):
    """(start, stop) of each call; the last may be short and is padded by the caller."""
    return ((c, min(c + size, total)) for c in range(0, total, size))


def _pad_to(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    if x.shape[0] == n:
        return x
    return torch.cat([x, torch.full((n - x.shape[0],) + x.shape[1:], fill, dtype=x.dtype, device=x.device)])


def _cached_partial(q, key_cache, value_cache, batch, scale, soft_cap) -> Partial | None:
    units = batch.inv_unit_rows.shape[0]
    if units == 0:
        return None
    n, hq, d = q.shape
    opts = batch.plan.options
    rs, size = batch.inv_unit_rows.shape[1], opts.invariant_chunk
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    slots = _Slots(n, batch.plan.inv_cached_width, size * rs, hq, d, dt, q.device)
    offsets = torch.arange(key_cache.shape[1], device=q.device)
    for start, stop in _chunks(units, size):
        rows = _pad_to(batch.inv_unit_rows[start:stop], size, n)  # [size, rs]
        blocks = _pad_to(batch.inv_unit_block[start:stop], size, 0)
        cols = _pad_to(batch.inv_unit_col[start:stop], size, 0)
        lo = _pad_to(batch.inv_unit_lo[start:stop], size, 0)
        hi = _pad_to(batch.inv_unit_hi[start:stop], size, 0)
        mask = (offsets >= lo[..., None]) & (offsets < hi[..., None])  # [size, rs, block_size]
        part = _attend(q[rows.clamp(max=n - 1)], key_cache[blocks], value_cache[blocks], mask, scale, soft_cap)
        slots.write(part, rows, cols, rows < n)
    return slots.fold()


def _causal_partial(q, k, v, batch, scale, soft_cap) -> Partial | None:
    tiles = batch.causal_q_start.shape[0]
    if tiles == 0:
        return None
    n, hq, d = q.shape
    opts = batch.plan.options
    c, size = opts.causal_tile, opts.invariant_causal_chunk
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    slots = _Slots(n, batch.plan.inv_causal_width, size * c, hq, d, dt, q.device)
    offsets = torch.arange(c, device=q.device)
    seg = batch.token_seg_start
    for start, stop in _chunks(tiles, size):
        q_start = _pad_to(batch.causal_q_start[start:stop], size, n)
        k_start = _pad_to(batch.causal_k_start[start:stop], size, 0)
        cols = _pad_to(batch.inv_causal_col[start:stop], size, 0)
        rows, keys = q_start[:, None] + offsets, k_start[:, None] + offsets  # [size, c]
        rows_in, keys_in = rows.clamp(max=n - 1), keys.clamp(max=n - 1)
        first = seg[q_start.clamp(max=n - 1)][:, None]  # the tile's request starts here
        valid = (rows < n) & (seg[rows_in] == first)  # rows of the tile's own request
        kk, r = keys[:, None, :], rows[:, :, None]
        mask = valid[:, :, None] & (kk >= first[:, :, None]) & (kk < r)
        if batch.sliding_window is not None:
            mask &= r - kk < batch.sliding_window
        part = _attend(q[rows_in], k[keys_in], v[keys_in], mask, scale, soft_cap)
        slots.write(part, rows, cols[:, None].expand_as(rows), valid)
    return slots.fold()
