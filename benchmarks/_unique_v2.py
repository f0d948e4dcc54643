"""The unique path as of run 3 (benchmarks/NOTES.md): V masked by a `where` over every block slot.

Kept for `python -m benchmarks.suite --core v2-unique` (an A/B of run 5 in the same process); the code is the
repository's own `unique.unique_partial` / `kernels._attend_one_row` before run 5.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.kernels import attend, compute_dtype
from vllm_gaudi_unified.merge import Partial, scatter_merge
from vllm_gaudi_unified.shared import slot_mask


def _attend_one_row(q, k, v, mask, scale, soft_cap) -> Partial:
    t, _, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    every = torch.matmul(q.reshape(t, hq, d), k.reshape(t, nk * hkv, d).transpose(1, 2))  # [T, Hq, K*Hkv]
    scores = torch.diagonal(every.view(t, hkv, g, nk, hkv), dim1=1, dim2=4)  # [T, G, K, Hkv]: head h vs h // g
    scores = scores.permute(0, 3, 1, 2).to(dt) * scale  # [T, Hkv, G, K]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    visible = mask[:, 0]  # [T, K]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    p, m, total = masked_softmax_for(scores)(scores)
    p_every = torch.zeros((t, hkv, g, nk, hkv), dtype=v.dtype, device=v.device)
    torch.diagonal(p_every, dim1=1, dim2=4).copy_(p.permute(0, 2, 3, 1))
    vz = torch.where(visible[:, :, None, None], v, torch.zeros((), dtype=v.dtype, device=v.device))
    acc = torch.matmul(p_every.view(t, hq, nk * hkv), vz.view(t, nk * hkv, d)).to(dt)  # [T, Hq, D]
    return Partial(acc, m.reshape(t, hq), total.reshape(t, hq))


def unique_partial(q, key_cache, value_cache, batch, scale, soft_cap):
    slots = batch.unique_rows.shape[0]
    if slots == 0:
        return None
    n = q.shape[0]
    if batch.unique_blocks is None:
        k, v = key_cache[:slots], value_cache[:slots]
    else:
        k, v = key_cache[batch.unique_blocks], value_cache[batch.unique_blocks]
    mask = slot_mask(batch.unique_lo, batch.unique_hi, key_cache.shape[1])[:, None, :]
    rows = batch.unique_rows
    qr = q[rows.clamp(max=n - 1)][:, None]
    if k.shape[2] > 1:
        part = _attend_one_row(qr, k, v, mask, scale, soft_cap)
    else:
        part = attend(qr, k, v, mask, scale, soft_cap)
    return scatter_merge(part, rows, n)
