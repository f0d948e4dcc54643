"""The unique path's verify units on the matmul route (the Gaudi route: torch ops an HPU graph holds).

A unit is one (request, cache block) slot; its rows are the request's new tokens x the query heads of
a KV head, so a block is read once for all of them (`PlanOptions.unique_tokens`). Per KV head one
batched product over every unit reads that head's keys in place (a strided view of the block as
stored, no copy), then one softmax over all heads, and per KV head `p @ V` again on V as stored.

The tiles whose real rows miss some key (a request's partial last block: its unused slots may hold
NaN, and `0 * NaN` would reach every row of the tile) take `p @ V` again on masked V, all heads in one
product; their rows replace those tiles' rows in the merge. The merge is one accumulator: each row is
scaled to its token's max and added at its token (a slot's rows that belong to no token at the
dropped rows past `n`), the requests' own new pairs (`request_pairs`) beside them. The slots are taken in
folds of `UNIT_FOLD` consecutive ones: the slots of a fold's first request (its smallest row) are its
request's units, so their maxima are one `amax` and their scaled rows one sum over the fold's axis, and
one row per token of the fold is scattered (a quarter of the atomic adds at 4); the other live slots
(strays: another request's in the fold, those past the last whole fold) are listed and scattered one by one.
The planner keeps their count within `(UNIT_FOLD - 1) x (requests + 1)` (`plan.rules.unit_fold_fits`: slots in
request order hold at most `UNIT_FOLD - 1` per request; a cache slice whose requests' blocks interleave more
is gathered in request order).
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.merge import Partial, compute_dtype, rescale_weights, rescaled, scatter_max
from vllm_gaudi_unified.paths.tiles import attend, product_dtype, score_product
from vllm_gaudi_unified.plan.rules import UNIT_FOLD

#: Dropped rows the units' rows without a token are added into, spread: added into one, they would queue on
#: its addresses.
DROP_ROWS = 64


def units_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
                  mask: torch.Tensor, masked: torch.Tensor, scale: float, soft_cap: float | None,
                  pairs: tuple[Partial, torch.Tensor] | None = None, requests: int | None = None) -> Partial:
    """q `[n, Hq, D]` (the step's queries), k/v `[slots, K, Hkv, D]` (the units' blocks as stored), the
    units' tokens and which are real `[slots, R]` (`unique.unit_tokens`), mask `[slots, 1, K]` (the
    slot's visible keys), `masked`: the slots whose real rows may miss a key (`unique._partial_slots`),
    `pairs`: the requests' own new pairs as rows and their tokens (`request_pairs`), `requests`: the bucket's
    (`plan.rules.unit_fold_fits` bounds the strays by it; None: every slot may be one) -> Partial `[n]`."""
    n = q.shape[0]
    t, r = tokens.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    hq, d = q.shape[1:]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    op = product_dtype(q.dtype)
    q, k, v = q.to(op), k.to(op), v.to(op)  # no-ops but for fp16 (its products in fp32)
    drop = n + torch.arange(t * r, device=q.device) % DROP_ROWS  # [T*R]
    mask = mask & real[:, :, None]  # [T, R, K]
    # rows (r, g) per KV head: the gathered queries written once in the products' layout
    qh = q[tokens.clamp(max=n - 1)].view(t, r, hkv, g, d).transpose(1, 2).reshape(t, hkv, r * g, d)
    scores = torch.stack([score_product(qh[:, h], k[:, :, h].transpose(1, 2)) for h in range(hkv)], 1)
    scores = scores.view(t, hkv, r, g, nk).to(dt) * scale  # [T, Hkv, R, G, K]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~mask[:, None, :, None], float("-inf"))
    p, m, total = masked_softmax_for(scores)(scores)
    p = p.to(v.dtype).view(t, hkv, r * g, nk)
    acc = [torch.matmul(p[:, h], v[:, :, h]) for h in range(hkv)]  # [T, R*G, Dv] each, V as stored
    m, total = (x.transpose(1, 2).reshape(t, r, hq) for x in (m, total))  # [T, R, Hq]
    # The masked tiles again on masked V, all heads in one product; a slot listed twice is added once.
    s = masked.shape[0]
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    vz = torch.where(mask.any(1)[masked][:, :, None, None], v[masked], zero).transpose(1, 2)  # [S, Hkv, K, Dv]
    fix = torch.matmul(p[masked], vz).view(s, hkv, r, g, dv).transpose(1, 2).reshape(s * r, hq, dv)
    ranks = torch.arange(s, device=q.device)
    once = torch.zeros(t, dtype=ranks.dtype, device=q.device).scatter_(0, masked, ranks)[masked] == ranks
    fix_index = torch.where((once[:, None] & real[masked]).reshape(-1), tokens[masked].reshape(-1), drop[:s * r])
    fixed = torch.zeros(t, dtype=torch.bool, device=q.device).index_fill_(0, masked, True)
    # Folds of UNIT_FOLD consecutive slots: the slots of a fold's first request (`folded`) summed over the fold's
    # axis and added at that request's tokens, the others (`strays`, listed) one by one.
    c = UNIT_FOLD
    nf, t0 = t // c, t // c * c
    live = real[:, 0]
    key = torch.where(live, tokens[:, 0], n)
    first = key[:t0].view(nf, c).amin(1)  # [F]: the fold's request (its first token; n: none)
    folded = live[:t0].view(nf, c) & (key[:t0].view(nf, c) == first[:, None])  # [F, C]
    stray = live.clone()
    stray[:t0] &= ~folded.reshape(-1)
    f_real = (real[:t0].view(nf, c, r) & folded[:, :, None]).any(1)  # [F, R]
    into = torch.where(f_real, first[:, None] + torch.arange(r, device=q.device), drop[:nf * r].view(nf, r)).view(-1)
    st = listed(stray, t if requests is None else min(t, (c - 1) * (requests + 1)))  # [Ns] (t: none)
    ns = st.shape[0]
    st_ok = st < t
    st = st.clamp(max=t - 1)
    st_index = torch.where((real[st] & st_ok[:, None]).reshape(-1), tokens[st].reshape(-1), drop[:ns * r])
    # one accumulator: every token's max first, then each fold or row scaled to it and added
    new_max = torch.full((n + DROP_ROWS, hq), float("-inf"), dtype=dt, device=q.device)
    if pairs is not None:
        new_max = scatter_max(pairs[0].max, pairs[1], new_max)
    fm = m[:t0].reshape(nf, c, r, hq)
    new_max = scatter_max(torch.where(folded[:, :, None, None], fm, float("-inf")).amax(1).reshape(-1, hq), into, new_max)
    new_max = scatter_max(m[st].reshape(-1, hq), st_index, new_max)
    seen, w = rescale_weights(fm, new_max.gather(0, into[:, None].expand(-1, hq)).view(nf, 1, r, hq))
    seen = seen & folded[:, :, None, None]  # [F, C, R, Hq]: once for every head group and the sums
    adds = seen & ~fixed[:t0].view(nf, c)[:, :, None, None]  # a masked slot's rows: its fix's
    seen_s, w_s = rescale_weights(m[st].reshape(-1, hq), new_max.gather(0, st_index[:, None].expand(-1, hq)))
    adds_s = seen_s & ~fixed[st].repeat_interleave(r)[:, None]
    out = []
    for h in range(hkv):
        hs = slice(h * g, (h + 1) * g)
        fold = rescaled(acc[h][:t0].view(nf, c, r, g, dv), adds[..., hs], w[..., hs]).sum(1).view(nf * r, g, dv)
        one = rescaled(acc[h].view(t, r, g, dv)[st].view(ns * r, g, dv), adds_s[:, hs], w_s[:, hs])
        out.append(torch.zeros((n + DROP_ROWS, g, dv), dtype=dt, device=q.device).index_add(0, into, fold)
                   .index_add(0, st_index, one))
    out = out[0] if hkv == 1 else torch.cat(out, 1)
    fix_w = rescale_weights(m[masked].reshape(s * r, hq), new_max.gather(0, fix_index[:, None].expand(-1, hq)))
    out = out.index_add(0, fix_index, rescaled(fix, *fix_w))
    sums = torch.zeros_like(new_max).index_add(0, into, rescaled(total[:t0].reshape(nf, c, r, hq), seen, w).sum(1)
                                               .view(-1, hq))
    sums = sums.index_add(0, st_index, rescaled(total[st].reshape(-1, hq), seen_s, w_s))
    if pairs is not None:
        rows, where = pairs
        seen_p, w_p = rescale_weights(rows.max, new_max.gather(0, where[:, None].expand(-1, hq)))
        out = out.index_add(0, where, rescaled(rows.acc, seen_p, w_p))
        sums = sums.index_add(0, where, rescaled(rows.sum, seen_p, w_p))
    return Partial(out[:n], new_max[:n], sums[:n])


def listed(flags: torch.Tensor, count: int, fill: int | None = None) -> torch.Tensor:
    """`[count]`: the indices of the first `count` True `flags`, then `fill` (default `flags.shape[0]`: none).
    Compacted by rank (a cumulative sum and one scatter): the k-th True goes to entry k, the others to a dropped
    entry `count`. Cheaper than a top-k on the device (one radix pass per byte over every flag: 26 us of a
    256-decode step at block size 16, H100) and of a shape that follows no data."""
    t = flags.shape[0]
    rank = torch.cumsum(flags.to(torch.int32), 0) - 1
    dest = torch.where(flags & (rank < count), rank, count).to(torch.int64)
    sel = torch.full((count + 1,), t if fill is None else fill, dtype=torch.int64, device=flags.device)
    return sel.index_copy_(0, dest, torch.arange(t, device=flags.device))[:count]


def request_pairs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, scale: float,
                  soft_cap: float | None) -> tuple[Partial, torch.Tensor]:
    """Every request's self and causal pairs, one tile per request of `unique_units` rows and keys (its new
    tokens from its first, `token_seg_start` of its last, `logits_indices`): row i sees key j <= i. A padded
    request repeats index 0 (no larger than the one before it) and has no row. Returns the tile rows and
    their tokens (`n`: none), for `units_partial`'s merge. Only where every request holds at most
    `unique_units` new tokens (`unique.units_take_new_pairs`)."""
    n, u = q.shape[0], batch.plan.unique_units
    last = batch.logits_indices
    first = batch.token_seg_start[last]
    real_req = torch.ones_like(last, dtype=torch.bool)
    real_req[1:] = last[1:] > last[:-1]
    tokens = first[:, None] + torch.arange(u, device=q.device, dtype=first.dtype)  # [R, u]
    real = real_req[:, None] & (tokens <= last[:, None])
    idx = tokens.clamp(max=n - 1)
    causal = torch.ones((u, u), dtype=torch.bool, device=q.device).tril()
    part = attend(q[idx], k[idx], v[idx], real[:, :, None] & real[:, None, :] & causal, scale, soft_cap)
    return part, torch.where(real, tokens, n).reshape(-1)
