"""The unique path's verify units on the matmul route (the Gaudi route: torch ops an HPU graph holds).

A unit is one (request, cache block) slot; its rows are the request's new tokens x the query heads of
a KV head, so a block is read once for all of them (`PlanOptions.unique_tokens`). Per KV head one
batched product over every unit reads that head's keys in place (a strided view of the block as
stored, no copy), then one softmax over all heads, and per KV head `p @ V` again on V as stored.

The tiles whose real rows miss some key (a request's partial last block: its unused slots may hold
NaN, and `0 * NaN` would reach every row of the tile) take `p @ V` again on masked V, all heads in one
product; their rows replace those tiles' rows in the merge. The merge is one accumulator: each row is
scaled to its token's max and added at its token (a slot's rows that belong to no token at the
dropped rows past `n`), the requests' own new pairs (`request_pairs`) beside them. A request's slots are
gathered in folds of `UNIT_FOLD` (`request_folds`: one sort of the slots by request, on the device), so their
maxima are one `amax` and their scaled rows one sum over the fold's axis, and one row per token of a fold is
scattered: up to a quarter of the atomic adds at 4 (a request's slots lie anywhere in the cache slice the unique
path reads in place).
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.merge import Partial, compute_dtype, rescale_weights, rescaled, scatter_max
from vllm_gaudi_unified.paths.tiles import attend, product_dtype, score_product

#: Dropped rows the units' rows without a token are added into, spread: added into one, they would queue on
#: its addresses.
DROP_ROWS = 64
#: Slots of one request gathered into a fold and summed before the scatter into their tokens (`request_folds`):
#: the scatter's atomic adds fall by up to this factor; a request's last fold pads up to it.
UNIT_FOLD = 4


def units_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
                  mask: torch.Tensor, masked: torch.Tensor, scale: float, soft_cap: float | None,
                  pairs: tuple[Partial, torch.Tensor] | None = None, requests: int | None = None) -> Partial:
    """q `[n, Hq, D]` (the step's queries), k/v `[slots, K, Hkv, D]` (the units' blocks as stored), the
    units' tokens and which are real `[slots, R]` (`unique.unit_tokens`), mask `[slots, 1, K]` (the
    slot's visible keys), `masked`: the slots whose real rows may miss a key (`unique._partial_slots`),
    `pairs`: the requests' own new pairs as rows and their tokens (`request_pairs`), `requests`: at most so many
    requests hold a slot (the bucket's; None: every slot may be one, `request_folds`) -> Partial `[n]`."""
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
    # A request's slots in folds of UNIT_FOLD (`request_folds`): gathered, scaled to their tokens' maxima and summed
    # over the fold's axis, one row per token of a fold scattered.
    live = real[:, 0]
    c = UNIT_FOLD
    layout = request_folds(torch.where(live, tokens[:, 0], n), n, c, t if requests is None else requests)  # [F, C]
    nf = layout.shape[0]
    used = layout < t
    sl = layout.clamp(max=t - 1)
    head = sl[:, 0]
    into = torch.where(real[head] & used[:, :1], tokens[head], drop[:nf * r].view(nf, r)).view(-1)  # [F*R]
    # one accumulator: every token's max first, then each fold scaled to it and added
    new_max = torch.full((n + DROP_ROWS, hq), float("-inf"), dtype=dt, device=q.device)
    if pairs is not None:
        new_max = scatter_max(pairs[0].max, pairs[1], new_max)
    fm = m[sl]  # [F, C, R, Hq]
    new_max = scatter_max(torch.where(used[:, :, None, None], fm, float("-inf")).amax(1).reshape(-1, hq), into, new_max)
    seen, w = rescale_weights(fm, new_max.gather(0, into[:, None].expand(-1, hq)).view(nf, 1, r, hq))
    seen = seen & used[:, :, None, None]  # [F, C, R, Hq]: once for every head group and the sums
    adds = seen & ~fixed[sl][:, :, None, None]  # a masked slot's rows: its fix's
    out = []
    for h in range(hkv):
        hs = slice(h * g, (h + 1) * g)
        rows_h = acc[h].view(t, r, g, dv)
        fold = rescaled(rows_h[sl[:, 0]], adds[:, 0, :, hs], w[:, 0, :, hs])
        for j in range(1, c):  # (a sum of gathered terms, one pointwise pass: not a reduction over a short axis)
            fold = fold + rescaled(rows_h[sl[:, j]], adds[:, j, :, hs], w[:, j, :, hs])
        fold = fold.view(nf * r, g, dv)
        out.append(torch.zeros((n + DROP_ROWS, g, dv), dtype=dt, device=q.device).index_add(0, into, fold))
    out = out[0] if hkv == 1 else torch.cat(out, 1)
    fix_w = rescale_weights(m[masked].reshape(s * r, hq), new_max.gather(0, fix_index[:, None].expand(-1, hq)))
    out = out.index_add(0, fix_index, rescaled(fix, *fix_w))
    sums = torch.zeros_like(new_max).index_add(0, into, rescaled(total[sl], seen, w).sum(1).view(-1, hq))
    if pairs is not None:
        rows, where = pairs
        seen_p, w_p = rescale_weights(rows.max, new_max.gather(0, where[:, None].expand(-1, hq)))
        out = out.index_add(0, where, rescaled(rows.acc, seen_p, w_p))
        sums = sums.index_add(0, where, rescaled(rows.sum, seen_p, w_p))
    return Partial(out[:n], new_max[:n], sums[:n])


def request_folds(key: torch.Tensor, n: int, fold: int, requests: int) -> torch.Tensor:
    """`[F, fold]` slot indices (`key.shape[0]`: none): every slot whose `key` (its request's first token) is below
    `n` once, a request's slots in folds of their own, in order of `key`. F bounds the folds of any `requests`
    requests (`(slots + (fold - 1) x requests) // fold`). One stable sort of the keys, ranks within each run of
    equal keys and a cumulative sum of the runs' folds: no shape that follows the data."""
    t = key.shape[0]
    nf = min(t, (t + (fold - 1) * requests) // fold)
    sk, order = torch.sort(key, stable=True)  # the live slots by request, the others (n) last
    i = torch.arange(t, device=key.device)
    start = torch.ones(t, dtype=torch.bool, device=key.device)
    start[1:] = sk[1:] != sk[:-1]
    run = torch.cumsum(start.to(torch.int64), 0) - 1  # [T] each sorted slot's run of one request
    first = torch.full((t,), t, dtype=torch.int64, device=key.device).scatter_reduce_(0, run, i, "amin")
    count = torch.zeros(t, dtype=torch.int64, device=key.device).index_add_(0, run, torch.ones_like(run))
    folds = (count + fold - 1) // fold
    pos = (torch.cumsum(folds, 0) - folds)[run] * fold + i - first[run]
    pos = torch.where((sk < n) & (pos < nf * fold), pos, nf * fold)
    layout = torch.full((nf * fold + 1,), t, dtype=torch.int64, device=key.device)
    return layout.index_copy_(0, pos, order)[:nf * fold].view(nf, fold)


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
