"""The unique path's (request, block) units in torch ops (what an HPU graph holds): a verify step's rows.

A unit is one cache block and the new tokens of the one request that reads it; its rows are those tokens x
the query heads of a KV head, one batched product per KV head over the block read as stored (a strided
view: no copy of K or V). A request's blocks are many units, and their rows meet again in the request's
tokens. The per-block way to do that (a softmax per unit, then `merge.scatter_merge` of the per-unit
partials) writes, rescales and reads an accumulator per (unit, row, head): at 8 rows a unit, a quarter of
the bytes of the cached keys and values. Here the maxima go first: each row's max over its unit's keys,
scattered into its token's max over all its units, read back, and every unit's probabilities are taken
against the token's max. The units' sums and `p @ V` products are then in one scale: added into their
tokens as they are (one `index_add` each), exact as a softmax over the token's keys is, no rescale pass.
Each KV head runs apart (scores, max, probabilities, product, sum): no tensor of every head's scores or
products is stacked. The requests' own new pairs (`UnitSet.clean`) are one more set of units in the same
scale, so a step whose only path this is writes its final rows (`Final`) with one division.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_gaudi_unified.merge import Final, Partial, normalize, scatter_max
from vllm_gaudi_unified.paths.tiles import compute_dtype, product_dtype


class UnitSet(NamedTuple):
    """Units of one shape: `k` `[U, K, Hkv, D]` / `v` `[U, K, Hkv, Dv]` (each unit's keys, as stored),
    `mask` `[U, R, K]` (True: the row sees the key), `tokens` / `real` `[U, R]` (each row's token; rows that
    are not real go to a dropped token and see nothing)."""
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor
    real: torch.Tensor
    #: Units whose real rows miss some key (a partial last block): V masked on those alone, the others
    #: read as stored; None: V's keys no row sees zeroed on every unit.
    masked_tiles: torch.Tensor | None = None
    #: The rows see different keys (the causal pairs of a request's new tokens): a non-finite value is
    #: zeroed in V and its NaN put in the scores of exactly the rows that see it (`tiles.clean_values`).
    clean: bool = False


def units_rows(q: torch.Tensor, sets: list[UnitSet], scale: float, soft_cap: float | None,
               final: bool = False) -> Partial | Final:
    """q `[n, Hq, D]` (the step's tokens) -> every token's pairs over the sets' units: a Partial
    `[n, Hq, Dv]`, or with `final` the normalized rows in q's dtype."""
    n, hq, d = q.shape
    hkv, dv = sets[0].k.shape[2], sets[0].v.shape[-1]
    g = hq // hkv
    dt, op = compute_dtype(q.dtype), product_dtype(q.dtype)
    token_max = torch.full((n + 1, hq), float("-inf"), dtype=dt, device=q.device)
    work = []
    for s in sets:
        u, r = s.tokens.shape
        dest = torch.where(s.real, s.tokens, n).reshape(-1)  # [U * R]; n: dropped
        qh = q[s.tokens.clamp(max=n - 1)].to(op).view(u, r, hkv, g, d).transpose(1, 2).reshape(u, hkv, r * g, d)
        k, v = s.k.to(op), s.v.to(op)  # no-ops but for fp16
        visible = s.mask[:, :, None, :]  # [U, R, 1, K]: a row's heads see its keys
        zero = torch.zeros((), dtype=v.dtype, device=v.device)
        seen = s.mask.any(1)[:, :, None]  # [U, K, 1]
        bad = None
        if s.clean:
            finite = torch.isfinite(v).all(-1)  # [U, K, Hkv]
            bad = seen & ~finite
            v = torch.where((seen & finite)[..., None], v, zero)
        elif s.masked_tiles is None:
            v = torch.where(seen[..., None], v, zero)
        scores = [_scores(qh[:, h], k[:, :, h], visible, None if bad is None else bad[:, :, h], scale, soft_cap)
                  for h in range(hkv)]
        row_max = torch.stack([x.amax(-1) for x in scores], 2).view(u * r, hq)  # [U*R, Hq]: small
        token_max = scatter_max(row_max, dest, token_max)
        work.append((s, dest, v, visible, scores))
    acc = [torch.zeros((n + 1, g, dv), dtype=dt, device=q.device) for _ in range(hkv)]
    total = torch.zeros((n + 1, hq), dtype=dt, device=q.device)
    for s, dest, v, visible, scores in work:
        u, r = s.tokens.shape
        row_token_max = token_max[dest].view(u, r, hkv, g)
        fix = s.masked_tiles is not None and s.masked_tiles.shape[0] > 0
        if fix:  # the units that miss a key again, on V with those keys zeroed
            v_fix = torch.where(s.mask[s.masked_tiles].any(1)[:, :, None, None], v[s.masked_tiles], 0.0)
        sums = []
        for h, x in enumerate(scores):
            p = torch.where(visible, torch.exp(x - row_token_max[:, :, h, :, None]), 0.0)  # [U, R, G, K]
            sums.append(p.sum(-1))
            p = p.to(v.dtype).view(u, r * g, -1)
            a = torch.matmul(p, v[:, :, h])  # [U, R*G, Dv]
            if fix:
                a = a.index_copy_(0, s.masked_tiles, torch.matmul(p[s.masked_tiles], v_fix[:, :, h]))
            acc[h] = acc[h].index_add(0, dest, a.view(u * r, g, dv).to(dt))
        total = total.index_add(0, dest, torch.stack(sums, 2).view(u * r, hq))
    out = Partial(torch.cat(acc, 1)[:n], token_max[:n], total[:n])
    return Final(normalize(out, q.dtype)) if final else out


def _scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, bad: torch.Tensor | None, scale: float,
            soft_cap: float | None) -> torch.Tensor:
    """One KV head's scores `[U, R, G, K]` (q `[U, R*G, D]`, k `[U, K, D]` a strided view): -inf where the row
    does not see the key, NaN where it sees a bad value (`bad` `[U, K]`)."""
    u, k_len = k.shape[0], k.shape[1]
    s = torch.matmul(q, k.transpose(1, 2)).view(u, visible.shape[1], -1, k_len).to(compute_dtype(q.dtype)) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    if bad is not None:
        s = torch.where(visible & bad[:, None, None, :], float("nan"), s)
    return s.masked_fill(~visible, float("-inf"))
