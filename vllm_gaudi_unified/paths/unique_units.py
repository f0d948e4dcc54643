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
products is stacked. The requests' own new pairs (`request_pairs`: a few gathered keys, every head in one
product) join the same token max, so a step whose only path this is writes its final rows (`Final`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_gaudi_unified.merge import Final, Partial, normalize, scatter_max
from vllm_gaudi_unified.paths.tiles import clean_values, compute_dtype, mask_scores, product_dtype


#: Each unit's probabilities against its own max, its rows rescaled to the token's max as they are added
#: (one pass over the scores), instead of against the token's max (a second pass: the max first).
RESCALE_IN_ADD = False


#: Rows past the step's tokens that the rows with no token (ragged drafts' padding, dead slots) are added
#: into, spread over them: the adds into one such row from every padding row would queue on the same addresses.
DROP_ROWS = 64


class UnitSet(NamedTuple):
    """Units of one shape: `k` `[U, K, Hkv, D]` / `v` `[U, K, Hkv, Dv]` (each unit's keys, as stored),
    `mask` `[U, R, K]` (True: the row sees the key), `tokens` / `real` `[U, R]` (each row's token; rows that
    are not real go to a dropped token and see nothing)."""
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor
    real: torch.Tensor
    #: (`units_rows`' units) the units whose real rows miss some key (a partial last block): V masked on
    #: those alone, the others read as stored (their keys are all seen, or no row sees any).
    masked_tiles: torch.Tensor | None = None


def units_rows(q: torch.Tensor, units: UnitSet, pairs: UnitSet | None, scale: float, soft_cap: float | None,
               final: bool = False) -> Partial | Final:
    """q `[n, Hq, D]` (the step's tokens) -> every token's pairs over `units` and `pairs` (rows that see
    different keys: a request's causal pairs; a non-finite value reaches exactly the rows that see it,
    `tiles.clean_values`): a Partial `[n, Hq, Dv]`, or with `final` the normalized rows in q's dtype."""
    n, hq, d = q.shape
    u, r = units.tokens.shape
    hkv, dv = units.k.shape[2], units.v.shape[-1]
    g = hq // hkv
    dt, op = compute_dtype(q.dtype), product_dtype(q.dtype)
    dest = _dest(units, n)
    qh = q[units.tokens.clamp(max=n - 1)].to(op).view(u, r, hkv, g, d).transpose(1, 2).reshape(u, hkv, r * g, d)
    k, v = units.k.to(op), units.v.to(op)  # no-ops but for fp16
    visible = units.mask[:, :, None, :]  # [U, R, 1, K]: a row's heads see its keys
    scores = [_scores(qh[:, h], k[:, :, h], visible, scale, soft_cap) for h in range(hkv)]
    token_max = torch.full((n + DROP_ROWS, hq), float("-inf"), dtype=dt, device=q.device)
    unit_max = [x.amax(-1) for x in scores]  # [U, R, G] per KV head
    token_max = scatter_max(torch.stack(unit_max, 2).view(u * r, hq), dest, token_max)
    if pairs is not None:
        p_dest, p_scores, p_v = _pair_scores(q, pairs, scale, soft_cap)
        t, _, _, pr, _ = p_scores.shape
        token_max = scatter_max(p_scores.amax(-1).permute(0, 3, 1, 2).reshape(t * pr, hq), p_dest, token_max)
    row_max = token_max[dest].view(u, r, hkv, g)
    sel = units.masked_tiles
    v_fix = torch.where(units.mask[sel].any(1)[:, :, None, None], v[sel], torch.zeros((), dtype=v.dtype,
                                                                                       device=v.device))
    acc, sums = [], []
    for h, x in enumerate(scores):
        if RESCALE_IN_ADD:  # p against the unit's max (one pass over x), its rows rescaled as they are added
            m, seen = unit_max[h], unit_max[h] != float("-inf")
            w = torch.where(seen, torch.exp(m - row_max[:, :, h]), 0.0).view(u * r, g)
            p = torch.exp(x - torch.where(seen, m, 0.0)[..., None])  # [U, R, G, K]
        else:
            w, p = None, torch.where(visible, torch.exp(x - row_max[:, :, h, :, None]), 0.0)
        sums.append(p.sum(-1).view(u * r, g) * (1.0 if w is None else w))
        p = p.to(v.dtype).view(u, r * g, -1)
        a = torch.matmul(p, v[:, :, h])  # [U, R*G, Dv]; the units that miss a key again, on V with those zeroed
        a = a.index_copy_(0, sel, torch.matmul(p[sel], v_fix[:, :, h])).view(u * r, g, dv).to(dt)
        acc.append(torch.zeros((n + DROP_ROWS, g, dv), dtype=dt, device=q.device).index_add(
            0, dest, a if w is None else a * w[..., None]))
    total = torch.zeros((n + DROP_ROWS, hq), dtype=dt, device=q.device).index_add(0, dest, torch.cat(sums, 1))
    acc = torch.cat(acc, 1)
    if pairs is not None:
        p = torch.where(pairs.mask[:, None, None], torch.exp(p_scores - token_max[p_dest].view(
            t, pr, hkv, g).permute(0, 2, 3, 1)[..., None]), 0.0)  # [T, Hkv, G, R, K]
        total = total.index_add(0, p_dest, p.sum(-1).permute(0, 3, 1, 2).reshape(t * pr, hq))
        a = torch.matmul(p.to(p_v.dtype).reshape(t, hkv, g * pr, -1), p_v).to(dt).view(t, hkv, g, pr, dv)
        acc = acc.index_add(0, p_dest, a.permute(0, 3, 1, 2, 4).reshape(t * pr, hq, dv))
    out = Partial(acc[:n], token_max[:n], total[:n])
    return Final(normalize(out, q.dtype)) if final else out


def _dest(s: UnitSet, n: int) -> torch.Tensor:
    """Each row's token `[U * R]`; rows that are not real go to one of `DROP_ROWS` dropped rows from `n` on."""
    spread = n + torch.arange(s.real.numel(), device=s.real.device).view(s.real.shape) % DROP_ROWS
    return torch.where(s.real, s.tokens, spread).reshape(-1)


def _scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float,
            soft_cap: float | None) -> torch.Tensor:
    """One KV head's scores `[U, R, G, K]` (q `[U, R*G, D]`, k `[U, K, D]` a strided view), -inf where the
    row does not see the key."""
    u, k_len = k.shape[0], k.shape[1]
    s = torch.matmul(q, k.transpose(1, 2)).view(u, visible.shape[1], -1, k_len).to(compute_dtype(q.dtype)) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    return s.masked_fill(~visible, float("-inf"))


def _pair_scores(q: torch.Tensor, s: UnitSet, scale: float, soft_cap: float | None):
    """(rows' tokens, scores `[T, Hkv, G, R, K]`, cleaned values `[T, Hkv, K, Dv]`) of the pairs: every head
    in one product (the keys are gathered, a few per request)."""
    n, hq, d = q.shape
    t, r = s.tokens.shape
    nk, hkv = s.k.shape[1], s.k.shape[2]
    g = hq // hkv
    op = product_dtype(q.dtype)
    qg = q[s.tokens.clamp(max=n - 1)].to(op).view(t, r, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(t, hkv, g * r, d)
    scores = torch.matmul(qg, s.k.to(op).permute(0, 2, 3, 1)).view(t, hkv, g, r, nk).to(compute_dtype(q.dtype)) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    v, bad = clean_values(s.v.to(op), s.mask.any(1))
    return _dest(s, n), mask_scores(scores, s.mask, bad), v
