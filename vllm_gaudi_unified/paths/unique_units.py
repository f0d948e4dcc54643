"""The unique path's (request, block) units in torch ops (what an HPU graph holds): a verify step's rows.

A unit is one cache block and the new tokens of the one request that reads it; its rows are those tokens x
the query heads of a KV head, one batched product per KV head over the block read as stored (a strided
view: no copy of K or V). A request's blocks are many units, and their rows meet again in the request's
tokens. The per-block way to do that (a softmax per unit, then `merge.scatter_merge` of the per-unit
partials) writes, rescales and reads an fp32 accumulator per (unit, row, head): at 8 rows a unit that is
as many bytes as the cached values themselves. Here the maxima go first: each row's max over its block,
scattered into its token's max over all its blocks, read back, and every unit's probabilities are taken
against the token's max. The units' sums and `p @ V` products are then in one scale: added into their
tokens as they are (one `index_add` each), exact as a softmax over the token's keys is, no rescale pass.
Each KV head runs apart (scores, max, probabilities, product, sum), so no tensor of every head's scores
or products is stacked.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, scatter_max
from vllm_gaudi_unified.paths.tiles import compute_dtype, product_dtype


def units_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
                  real: torch.Tensor, scale: float, soft_cap: float | None,
                  masked_tiles: torch.Tensor | None = None) -> Partial:
    """q `[n, Hq, D]` (the step's tokens), k `[U, K, Hkv, D]` / v `[U, K, Hkv, Dv]` (each unit's block as
    stored), mask `[U, R, K]` (True: the row sees the key), tokens / real `[U, R]` (`unique.unit_tokens`:
    each unit row's token and whether it is one) -> Partial `[n, Hq, Dv]`: every token's pairs over its units.

    A unit's rows see the same keys; rows that are not real, and units without one, go to a dropped token
    and see nothing. `masked_tiles`: the units whose real rows miss some key (a partial last block): V is
    masked on those alone (keys no row sees may hold NaN), the others read V as stored; None: every unit."""
    n, hq, d = q.shape
    u, r = tokens.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    dt, op = compute_dtype(q.dtype), product_dtype(q.dtype)
    dest = torch.where(real, tokens, n).reshape(-1)  # [U * R]; n: dropped
    q, k, v = q.to(op), k.to(op), v.to(op)  # no-ops but for fp16
    qh = q[tokens.clamp(max=n - 1)].view(u, r, hkv, g, d).transpose(1, 2).reshape(u, hkv, r * g, d)
    visible = mask[:, :, None, :]  # [U, R, 1, K]: a row's heads see its keys
    scores = []
    for h in range(hkv):
        s = torch.matmul(qh[:, h], k[:, :, h].transpose(1, 2)).view(u, r, g, nk).to(dt) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        scores.append(s.masked_fill(~visible, float("-inf")))
    row_max = torch.stack([s.amax(-1) for s in scores], 2).view(u * r, hq)  # [U*R, Hq]: small
    start = torch.full((n + 1, hq), float("-inf"), dtype=dt, device=q.device)
    token_max = scatter_max(row_max, dest, start)  # [n + 1, Hq]
    row_token_max = token_max[dest].view(u, r, hkv, g)
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    if masked_tiles is not None and masked_tiles.shape[0]:
        seen = mask[masked_tiles].any(1)[:, :, None, None]  # [M, K, 1, 1]
        v_fix = torch.where(seen, v[masked_tiles], zero)
    elif masked_tiles is None:
        v = torch.where(mask.any(1)[:, :, None, None], v, zero)
    acc, sums = [], []
    for h, s in enumerate(scores):
        p = torch.where(visible, torch.exp(s - row_token_max[:, :, h, :, None]), 0.0)  # [U, R, G, K]
        sums.append(p.sum(-1))
        p = p.to(v.dtype).view(u, r * g, nk)
        a = torch.matmul(p, v[:, :, h])  # [U, R*G, Dv]
        if masked_tiles is not None and masked_tiles.shape[0]:
            a = a.index_copy(0, masked_tiles, torch.matmul(p[masked_tiles], v_fix[:, :, h]))
        acc.append(torch.zeros((n + 1, g, dv), dtype=dt, device=q.device).index_add(
            0, dest, a.view(u * r, g, dv).to(dt)))
    total = torch.zeros((n + 1, hq), dtype=dt, device=q.device).index_add(
        0, dest, torch.stack(sums, 2).view(u * r, hq))
    return Partial(torch.cat(acc, 1)[:n], token_max[:n], total[:n])
