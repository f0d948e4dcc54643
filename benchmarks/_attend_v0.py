"""`attend` as of run 1 (benchmarks/NOTES.md): q, K and V copied up to fp32 before both products.

Kept for `python -m benchmarks.suite --core v0`. The one computation every path repeats: a batch of
query-row tiles against key tiles.

Each path gathers its rows and keys into `[tiles, rows, heads, head_dim]` /
`[tiles, keys, kv_heads, head_dim]`, builds a boolean mask, and calls `attend`,
which returns one `Partial` row per (tile, row). GQA is done by grouping query
heads per KV head inside the matmul, so K/V are never repeated in memory.
"""
from __future__ import annotations

import torch

# Shared with the core: with q/k/v upcast first, the core's `scores_to_partial` casts are no-ops, so
# it computes what run 1's copy did.
from vllm_gaudi_unified.paths.tiles import compute_dtype, scores_to_partial
from vllm_gaudi_unified.merge import Partial


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           soft_cap: float | None) -> Partial:
    """q `[T, R, Hq, D]`, k/v `[T, K, Hkv, D]`, mask `[T, R, K]` (True = visible) -> Partial `[T*R, Hq, D]`.

    Keys no row of a tile may see are zeroed in `v` first: a poisoned cache slot
    (NaN, inf) times a zero probability would still be NaN.
    """
    t, r, hq, d = q.shape
    hkv = k.shape[2]
    dt = compute_dtype(q.dtype)
    qg = (q.to(dt) * scale).view(t, r, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # [T, Hkv, G, R, D]
    kt = k.to(dt).permute(0, 2, 3, 1)  # [T, Hkv, D, K]
    scores = torch.matmul(qg.reshape(t, hkv, -1, d), kt).view(t, hkv, hq // hkv, r, -1)
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    seen = mask.any(1)  # [T, K]
    vv = torch.where(seen[:, :, None, None], v.to(dt), 0.0).permute(0, 2, 1, 3)  # [T, Hkv, K, D]
    return scores_to_partial(scores, vv, mask)
