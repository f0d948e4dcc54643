"""MLA's one-token requests in the batch-invariant mode where the MLA kernel does not run (the Gaudi route, the CPU).

The tile route (`invariant._one_row_tiles`) would take a decode's chunks as one-row tiles, each with its own
fp32 partial `[Hq, L]` in a slot of its token, K and V gathered apart: at DeepSeek's shapes more than 200 kernels
a step, 3.8x the default's chunks (docs/batch_invariance.md, Cost). Here the same tiles (the plan's `dec_*`
tiles and `share_*` rows: one token and one chunk of `blocks_per_tile` blocks, chunk `c` a token's keys
`[c * K, (c + 1) * K)`) take the default's chunk layout (`mla_chunks.py`): the latents gathered once (the
values are their first `L` dims, never gathered apart), every tile's row shifted by its token's max, so a
chunk's partial is two products and a sum, with no rescale. What makes it invariant:

* **the products at fixed shapes**: the tiles run in calls of `tiles_per_call` tiles (a quarter for tiles
  that miss a key of their chunk: a request's last chunk), the last call padded: the scores
  `[tiles, Hq, L + R] @ [tiles, L + R, K]`, the sum over the keys and `p @ V` `[tiles, Hq, K] @ [tiles, K, L]`
  run per call at one shape, whatever the batch (a library's choice of kernel by shape or batch count never
  follows the batch); a tile's row is one batch entry, which no other entry's arithmetic reads. A token's own
  pair is scored in calls of `tiles_per_call` tokens the same way. Which call a tile lands in follows the
  batch; its kind (whole chunk or not) follows its request alone;
* **the max**: a token's max over its own pair and its tiles' maxima (`scatter_max`: a max is exact in any
  order), so every tile's `e^(s - max)` is on its token's one scale: an elementwise pass;
* **the fold**: a token's tile partials (`p @ V` in the product dtype, sums in fp32) are added in fp32 by a
  fixed pairwise tree over their chunk index (halves, then halves again, `merge.fold_pairwise`'s order; the
  width a power of two, the missing chunks read a row of -0.0, which adds exactly: a wider step gives the same
  bits), then its own pair's weighted value; no `index_add` of floats (its order is the rows' or the atomics').

Every other pass (casts, the mask of a tile's unseen keys, the max over keys, `exp`) is elementwise or a max
over the step at once. Padding tiles (no row) and padding rows go to a dump row.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from vllm_gaudi_unified.merge import Partial, normalize, scatter_max
from vllm_gaudi_unified.paths.kv_quant import one_tensor_scale, read_blocks
from vllm_gaudi_unified.paths.mla_shared import finite_shift, latent_cache
from vllm_gaudi_unified.paths import tiles
from vllm_gaudi_unified.paths.causal import tree_sum
from vllm_gaudi_unified.paths.tiles import compute_dtype, product_dtype, slot_mask
from vllm_gaudi_unified.plan.invariant import pow2, tiles_per_call

_WIDTH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plan -> the fold's width


def applies(batch, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap, sink, k_scale, v_scale) -> bool:
    """A latent cache (`mla_shared.latent_cache`: the values a view of the keys), at most one per-tensor scale,
    no soft cap, sinks or sliding window: conditions on the step's model and options, never on its requests."""
    return (soft_cap is None and sink is None and batch.sliding_window is None and one_tensor_scale(k_scale, v_scale)
            and latent_cache(key_cache, value_cache))


def decode_rows(q: torch.Tensor, key: torch.Tensor, key_cache: torch.Tensor, value_dim: int, batch, scale: float,
                out: torch.Tensor | None = None, kv_scale=None) -> torch.Tensor:
    """`out` `[n, H, L]` (None: a new one, the rows past the step's tokens zeroed) with the rows of the
    one-token requests written final (module docstring): q `[n, H, L + R]`, the new latents `key`
    `[n, 1, L + R]`, the latent cache as keys `[blocks, block_size, 1, L + R]`; `kv_scale`: an fp8 cache's
    one scale (`kv_quant.read_blocks`)."""
    n, hq, d = q.shape
    dt, op = compute_dtype(q.dtype), product_dtype(q.dtype)
    sdt = op if tiles.gaudi_product(q.device.type) else dt  # the scores' dtype (`tiles.score_product`'s)
    per = tiles_per_call(batch.plan.options)
    tail = max(1, per // 4)
    rows, blocks, cols, whole = _tiles(batch, n, per, tail)
    nt, bs = rows.shape[0], key_cache.shape[1]
    keys = blocks.shape[1] * bs
    tok = rows.clamp(max=n - 1)
    kv = read_blocks(key_cache[:, :, 0], blocks, kv_scale, op).to(op).view(nt, keys, d)  # [tiles, K, L + R]
    visible = slot_mask(batch.dec_lo[batch.plan.dec_whole:, 0], batch.dec_hi[batch.plan.dec_whole:, 0], bs).flatten(1)
    tails = nt - whole
    if tails:  # a tail tile's unseen keys: zero latents (NaN may sit there) and -inf scores
        visible = torch.cat([visible, visible.new_zeros((tails - visible.shape[0], keys))])
        kv[whole:].masked_fill_(~visible[:, :, None], 0)
    kvs = kv if sdt == op else kv.to(sdt)
    s = torch.empty((nt, hq, keys), dtype=sdt, device=q.device)
    qt = q[tok].to(sdt)
    for a, b in _calls(whole, nt, per, tail):
        torch.baddbmm(s[a:b], qt[a:b], kvs[a:b].transpose(1, 2), beta=0, alpha=scale, out=s[a:b])
    del qt, kvs
    if tails:
        s[whole:].masked_fill_(~visible[:, None, :], float("-inf"))
    own = _own_scores(q, key, scale, per, sdt)  # [n, H]
    into = torch.where(rows < n, rows, n)
    top = scatter_max(s.amax(-1).to(dt), into, torch.cat([own, own.new_full((1, hq), float("-inf"))]))
    shift = finite_shift(top)  # [n + 1, H]
    # (one elementwise pass: measured faster here than the default's products of inner dim 1 in every call,
    # `mla_chunks.MLA_CHUNK_RANK1`; docs/batch_invariance.md, Cost)
    p = s.sub_(shift[into].to(sdt)[..., None]).exp_()
    p = p if sdt == op else p.to(op)
    del s
    acc = torch.empty((nt + 1, hq, value_dim), dtype=op, device=q.device)
    total = torch.empty((nt + 1, hq), dtype=dt, device=q.device)
    acc[nt], total[nt] = -0.0, -0.0  # the fold's missing chunks: -0.0 adds exactly
    values = kv[..., :value_dim]
    for a, b in _calls(whole, nt, per, tail):
        torch.sum(p[a:b], -1, dtype=dt, out=total[a:b])
        torch.bmm(p[a:b], values[a:b], out=acc[a:b])
    del p, kv, values
    width = _width(batch)
    grid = torch.full((width * n + 1,), nt, dtype=torch.int64, device=q.device)  # [chunk, token] -> its tile
    grid.index_copy_(0, torch.where(rows < n, cols * n + rows, width * n),
                     torch.arange(nt, device=q.device))  # (every real (token, chunk) once; padding: the last entry)
    grid = grid[:width * n]
    out_acc, out_sum = _tree(acc, grid, width, n, dt), _tree(total, grid, width, n, dt)
    w = torch.exp(own - shift[:n])  # the own pair, after the chunks
    own_v = key[:, 0, :value_dim].to(dt)
    out_acc += w[..., None] * own_v[:, None, :]
    out_sum += w
    rows_out = normalize(Partial(out_acc, top[:n], out_sum), q.dtype)
    if out is None:  # (the rows past the step's tokens zeroed, as the kernel route's)
        rows_out[batch.num_tokens:] = 0
        return rows_out
    out[batch.one_rows] = rows_out[batch.one_rows]
    return out


def _tiles(batch, n: int, per: int, tail: int):
    """(rows `[tiles]` (n: none), blocks `[tiles, blocks_per_tile]`, chunk index `[tiles]`, whole): the dec
    tiles that see their whole chunk and the share calls' rows (each its call's chunk), `whole` of them in
    calls of `per`; then the other dec tiles, padded to calls of `tail`."""
    w = batch.plan.dec_whole
    calls, per_share = batch.share_rows.shape
    share_blocks = batch.share_blocks.repeat_interleave(per_share, 0) if calls else batch.share_blocks[:0]
    rest = batch.dec_rows.shape[0] - w
    pad = -(-rest // tail) * tail - rest
    dev = batch.dec_rows.device
    rows = torch.cat([batch.dec_rows[:w, 0], batch.share_rows.reshape(-1), batch.dec_rows[w:, 0],
                      torch.full((pad,), n, dtype=batch.dec_rows.dtype, device=dev)])
    blocks = torch.cat([batch.dec_blocks[:w], share_blocks, batch.dec_blocks[w:],
                        batch.dec_blocks.new_zeros((pad, batch.dec_blocks.shape[1]))])
    cols = torch.cat([batch.dec_col[:w], batch.share_col.reshape(-1), batch.dec_col[w:],
                      batch.dec_col.new_zeros(pad)])
    return rows, blocks, cols, w + calls * per_share


def _calls(whole: int, total: int, per: int, tail: int):
    """(start, stop) of each call: `per` tiles up to `whole`, `tail` tiles after (both exact multiples)."""
    return [(a, a + per) for a in range(0, whole, per)] + [(a, a + tail) for a in range(whole, total, tail)]


def _own_scores(q: torch.Tensor, key: torch.Tensor, scale: float, per: int, sdt: torch.dtype) -> torch.Tensor:
    """Each token's score against its own latent `[n, H]` (compute dtype), in calls of `per` tokens
    `[per, H, L + R] @ [per, L + R, 1]` (the last padded): a token's score is one entry of a fixed shape."""
    n, hq, d = q.shape
    m = -(-n // per) * per
    qs = torch.cat([q, q.new_zeros((m - n, hq, d))]).to(sdt)
    ks = torch.cat([key[:, 0], key.new_zeros((m - n, d))]).to(sdt)[:, :, None]
    s = torch.empty((m, hq, 1), dtype=sdt, device=q.device)
    for a in range(0, m, per):
        torch.baddbmm(s[a:a + per], qs[a:a + per], ks[a:a + per], beta=0, alpha=scale, out=s[a:a + per])
    return s[:n, :, 0].to(compute_dtype(q.dtype))


def _tree(x: torch.Tensor, grid: torch.Tensor, width: int, n: int, dt: torch.dtype) -> torch.Tensor:
    """Each token's tile rows of `x` (`grid` `[width * n]`: chunk-major) added in `dt` by `causal.tree_sum`'s
    tree over the chunk index: the first level as the sum of the grid's two gathered halves (no whole gathered
    copy held), the others in place."""
    if width == 1:
        return x.index_select(0, grid).to(dt)
    h = width // 2
    y = x.index_select(0, grid[:h * n]).to(dt)
    y += x.index_select(0, grid[h * n:])
    return tree_sum(y.unflatten(0, (h, n)), overwrite=True, dim=0)


def _width(batch) -> int:
    """The fold's width: the most chunks of one token in the plan, a power of two (host numbers, once per plan)."""
    plan = batch.plan
    width = _WIDTH.get(plan)
    if width is None:
        cols = [c.max() for c in (plan.dec_col, plan.share_col) if c.size]
        width = _WIDTH[plan] = pow2(int(np.max(cols)) + 1 if cols else 1)
    return width
