"""Causal path: new tokens against new tokens of the same request.

With a fused kernel (`fused.py`; CUDA flash) the whole path is one varlen call,
`fused_causal_partial`: each request's new tokens are one segment, causal,
the self pair included, and the kernel's LSE makes the rows mergeable. Else
(and always for the reference checks) it comes in two parts. The *self* pair (a token and its own key) is elementwise and always
computed, so every real row sees at least one key. The strict-causal pairs come
in square tiles on the flattened token axis, listed by the planner only where
some pair is needed; a mask per tile keeps pairs inside one request, in order,
and inside the sliding window; in an encoder-only step (`plan/bidirectional.py`) inside one request,
in any order (a window: on either side).
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, Scattered
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.tiles import attend, compute_dtype, score_product


def self_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 soft_cap: float | None, fixed_order: bool = False) -> Partial:
    """Each token against its own key: q/k/v `[T, H, D]` -> Partial `[T, Hq, D]`.

    `fixed_order` (the batch-invariant mode): the dot products are summed by a fixed
    pairwise tree over `head_dim` (elementwise adds), whatever kernel `sum` would pick. Else, on an accelerator,
    one small product per token and KV head (`score_product`: no fp32 copy of q); `acc` keeps the values' own
    dtype (the merge scales it in the compute dtype, where a 16-bit value is exact): a step's every row
    (a bucket's padding rows too) writes half the bytes."""
    t, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    dt = compute_dtype(q.dtype)
    if fixed_order or q.device.type not in ("cuda", "hpu"):  # (the CPU's product takes fp32 copies anyway)
        products = q.to(dt).view(t, hkv, hq // hkv, d) * k.to(dt).view(t, hkv, 1, d)
        s = (tree_sum(products) if fixed_order else products.sum(-1)).reshape(t, hq) * scale
    else:
        s = score_product(q.reshape(t * hkv, hq // hkv, d), k.reshape(t * hkv, d, 1)).to(dt).reshape(t, hq) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    acc = (v.to(dt) if fixed_order else v)[:, :, None, :].expand(t, hkv, hq // hkv, dv).reshape(t, hq, dv)
    return Partial(acc, s, torch.ones_like(s))


def tree_sum(x: torch.Tensor, overwrite: bool = False, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by a fixed pairwise tree: halves, then halves again (zero-padded to a power of two);
    `overwrite`: the partial sums are written over x's first halves but the last (a new tensor of one sum a
    row: x's storage not held by the result; the same adds, the same bits)."""
    d = dim % x.dim()
    n = x.shape[d]
    if n & (n - 1):
        x = torch.cat([x, x.new_zeros(x.shape[:d] + ((1 << (n - 1).bit_length()) - n,) + x.shape[d + 1:])], d)
    while x.shape[d] > 1:
        h = x.shape[d] // 2
        low, high = x.narrow(d, 0, h), x.narrow(d, h, h)
        x = low.add_(high) if overwrite and h > 1 else low + high
    return x.select(d, 0)


def causal_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, scale: float,
                   soft_cap: float | None) -> Scattered | None:
    """Strict-causal pairs within each request, the tiles' rows unmerged (for `merge.merge_rows`); None when
    the batch lists no causal tile."""
    if batch.causal_q_start.numel() == 0:
        return None
    n = q.shape[0]
    offsets = torch.arange(batch.causal_tile, device=q.device)
    rows = batch.causal_q_start[:, None] + offsets  # [tiles, tile]; >= n: no row
    keys = batch.causal_k_start[:, None] + offsets  # [tiles, tile]
    rows_in, keys_in = rows.clamp(max=n - 1), keys.clamp(max=n - 1)
    r, kk = rows[:, :, None], keys[:, None, :]
    seg = batch.token_seg_start[rows_in][:, :, None]
    if batch.plan.bidirectional:  # encoder-only: every other token of the request (same request start)
        mask = (batch.token_seg_start[keys_in][:, None, :] == seg) & (kk != r) & (kk < n) & (r < n)
    else:
        mask = (kk >= seg) & (kk < r) & (r < n)
    if batch.sliding_window is not None:  # two-sided in an encoder-only step (`plan/bidirectional.py`)
        mask &= ((r - kk).abs() if batch.plan.bidirectional else r - kk) < batch.sliding_window
    tile_attend = attend
    if fused.kernel_for(batch, q, soft_cap, v.shape[-1]) == "hpu":  # FusedSDPA with statistics on the same tiles
        tile_attend = fused.sdpa_attend
    part = tile_attend(q[rows_in], k[keys_in], v[keys_in], mask, scale, soft_cap)
    index = rows.clamp(max=n).reshape(-1)
    return Scattered(part, index)


def fused_causal_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, scale: float) -> Partial:
    """Self and strict-causal pairs of every token in one flash varlen call (`fused.flash_varlen`).

    Segments are the requests, read from `logits_indices` (each request's last token;
    padded requests repeat 0, made empty segments by the running max), plus one segment of
    the padding tokens, so no row is left unwritten. `max_q` bounds a request's new tokens
    by what the bucket holds: a request of q tokens has strict-causal pairs in at least
    ceil((q - 1) / tile) tiles, so q <= num_causal_tiles * causal_tile + 1 (a window of 1 has no such
    pair: then `max_q` is every token).

    Non-finite values are contained (`fused.contain_bad_values`): flash gives masked keys a zero
    weight, and 0 * NaN in `P @ V` would reach earlier rows of the request and rows outside the window."""
    t = q.shape[0]
    ends = torch.cummax(batch.logits_indices + 1, 0).values
    cu = torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), t)]).to(torch.int32)
    b = batch.bucket
    max_q = t if batch.sliding_window == 1 else max(1, min(t, b.num_causal_tiles * batch.causal_tile + 1))
    max_q = max(max_q, min(t, b.prompt_len))  # prompt-route requests are segments too (their rows are replaced)
    v, bad = fused.clean_causal_values(v, batch.token_seg_start, batch.sliding_window)
    part = fused.flash_varlen(q, k, v, cu, cu, max_q, max_q, scale, causal=True, window=batch.sliding_window)
    return fused.mark_bad_rows(part, bad)
