"""The unique path's verify units on the matmul route (the Gaudi route: torch ops an HPU graph holds).

A unit is one (request, cache block) slot; its rows are the request's new tokens x the query heads of
a KV head, so a block is read once for all of them (`PlanOptions.unique_tokens`). Per KV head one
batched product over every unit reads that head's keys in place (a strided view of the block as
stored, no copy), then one softmax over all heads, and per KV head `p @ V` again on V as stored.

The tiles whose real rows miss some key (a request's partial last block: its unused slots may hold
NaN, and `0 * NaN` would reach every row of the tile) take `p @ V` again on masked V, all heads in one
product; their rows replace those tiles' rows in the merge.

The merge folds a request's units densely before anything is scattered (`unit_chunks`): its slots are
laid out in chunks of `UNIT_CHUNK`, one request's each, and a chunk's rows are reduced over that dense
axis (its maxima by one `amax`, its rows scaled to their token's max and summed), so the scatter max and
the `index_add` into the tokens take a chunk's rows, not every slot's (the atomics of 8 rows to one address
were a third of a 64 x 8 step). The requests' own new pairs (`request_pairs`) are merged beside them.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.merge import Partial, compute_dtype, rescale_weights, rescaled, scatter_max
from vllm_gaudi_unified.paths.tiles import attend, product_dtype, score_product

#: Dropped rows the units' rows without a token are added into, spread: added into one, they would queue on
#: its addresses.
DROP_ROWS = 64
#: Slots of one request folded densely before the scatter into its tokens (`unit_chunks`): the scatter takes
#: this many times fewer rows; a request's last chunk pads up to it.
UNIT_CHUNK = 8
#: Scores, softmax and `p @ V` one KV head at a time (each head's scores and probabilities a few MB, read back
#: from L2, and no stacked copy of every head's), rather than one softmax over all heads' stacked scores.
UNIT_HEADWISE = True


def unit_chunks(rows: torch.Tensor, live: torch.Tensor, n: int, groups: int, per_chunk: int) -> torch.Tensor:
    """The slots `[S]` of each request laid out densely: `[Nc, per_chunk]` slot indices (S: none), a chunk's
    slots one request's (same `rows`, `live`), every live slot once. `groups`: at most so many distinct rows
    (the requests; `n + 1` always holds). Chunks bounded from the shapes alone (`Nc = (S + G (C - 1)) // C`,
    G = min(groups, S)): one-hot ranks and cumulative sums, no sort and no shape that follows the data."""
    s, c = rows.shape[0], per_chunk
    g = min(groups, s)
    nc = (s + g * (c - 1)) // c
    first = torch.zeros(n + 1, dtype=torch.int32, device=rows.device).index_fill_(0, rows, 1)
    group = (torch.cumsum(first, 0) - 1)[rows].clamp(max=g - 1)  # [S]: rows' rank among the distinct rows
    onehot = (group[:, None] == torch.arange(g, device=rows.device)) & live[:, None]
    ranks = torch.cumsum(onehot.to(torch.int32), 0)  # [S, G]
    rank = ranks.gather(1, group[:, None])[:, 0] - 1  # a live slot's place among its request's
    chunks = (ranks[-1] + c - 1) // c
    base = torch.cumsum(chunks, 0) - chunks  # [G] a request's first chunk
    pos = torch.where(live, base[group] * c + rank, nc * c).to(torch.int64)
    layout = torch.full((nc * c + 1,), s, dtype=torch.int64, device=rows.device)
    return layout.scatter_(0, pos, torch.arange(s, device=rows.device))[:nc * c].view(nc, c)


def units_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
                  mask: torch.Tensor, masked: torch.Tensor, scale: float, soft_cap: float | None,
                  pairs: tuple[Partial, torch.Tensor] | None = None, groups: int | None = None) -> Partial:
    """q `[n, Hq, D]` (the step's queries), k/v `[slots, K, Hkv, D]` (the units' blocks as stored), the
    units' tokens and which are real `[slots, R]` (`unique.unit_tokens`), mask `[slots, 1, K]` (the
    slot's visible keys), `masked`: the slots whose real rows may miss a key (`unique._partial_slots`),
    `pairs`: the requests' own new pairs as rows and their tokens (`request_pairs`), `groups`: at most so
    many requests hold a unit (`unit_chunks`; default n + 1) -> Partial `[n]`."""
    n = q.shape[0]
    t, r = tokens.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    hq, d = q.shape[1:]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    op = product_dtype(q.dtype)
    q, k, v = q.to(op), k.to(op), v.to(op)  # no-ops but for fp16 (its products in fp32)
    mask = mask & real[:, :, None]  # [T, R, K]
    # rows (r, g) per KV head: the gathered queries written once in the products' layout
    qh = q[tokens.clamp(max=n - 1)].view(t, r, hkv, g, d).transpose(1, 2).reshape(t, hkv, r * g, d)
    if UNIT_HEADWISE:
        ms, tots, acc, pm = [], [], [], []
        for h in range(hkv):
            sh = score_product(qh[:, h], k[:, :, h].transpose(1, 2)).view(t, r, g, nk).to(dt) * scale
            if soft_cap is not None:
                sh = soft_cap * torch.tanh(sh / soft_cap)
            sh = sh.masked_fill(~mask[:, :, None], float("-inf"))
            ph, mh, th = masked_softmax_for(sh)(sh)
            ph = ph.to(v.dtype).view(t, r * g, nk)
            acc.append(torch.matmul(ph, v[:, :, h]))
            ms.append(mh)
            tots.append(th)
            pm.append(ph[masked])
        m, total = (torch.stack(x, 2).reshape(t, r, hq) for x in (ms, tots))
        p_masked = torch.stack(pm, 1)
    else:
        scores = torch.stack([score_product(qh[:, h], k[:, :, h].transpose(1, 2)) for h in range(hkv)], 1)
        scores = scores.view(t, hkv, r, g, nk).to(dt) * scale  # [T, Hkv, R, G, K]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~mask[:, None, :, None], float("-inf"))
        p, m, total = masked_softmax_for(scores)(scores)
        p = p.to(v.dtype).view(t, hkv, r * g, nk)
        acc = [torch.matmul(p[:, h], v[:, :, h]) for h in range(hkv)]  # [T, R*G, Dv] each, V as stored
        m, total = (x.transpose(1, 2).reshape(t, r, hq) for x in (m, total))  # [T, R, Hq]
        p_masked = p[masked]
    # The masked tiles again on masked V, all heads in one product; a slot listed twice is added once.
    s = masked.shape[0]
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    vz = torch.where(mask.any(1)[masked][:, :, None, None], v[masked], zero).transpose(1, 2)  # [S, Hkv, K, Dv]
    fix = torch.matmul(p_masked, vz).view(s, hkv, r, g, dv).transpose(1, 2).reshape(s * r, hq, dv)
    listed = torch.arange(s, device=q.device)
    once = torch.zeros(t, dtype=listed.dtype, device=q.device).scatter_(0, masked, listed)[masked] == listed
    fixed = torch.zeros(t, dtype=torch.bool, device=q.device).index_fill_(0, masked, True)
    # A request's slots in dense chunks: maxima, then rows scaled to their token's max, reduced per chunk.
    layout = unit_chunks(tokens[:, 0], real[:, 0], n, n + 1 if groups is None else groups, UNIT_CHUNK)  # [Nc, C]
    nc = layout.shape[0]
    used = layout < t
    slot = layout.clamp(max=t - 1)
    head = slot[:, 0]
    drop = n + torch.arange(nc * r, device=q.device) % DROP_ROWS
    into = torch.where((used[:, :1] & real[head]).reshape(-1), tokens[head].reshape(-1), drop)  # [Nc*R]
    fix_into = torch.where((once[:, None] & real[masked]).reshape(-1), tokens[masked].reshape(-1), drop[:s * r])
    new_max = torch.full((n + DROP_ROWS, hq), float("-inf"), dtype=dt, device=q.device)
    if pairs is not None:
        new_max = scatter_max(pairs[0].max, pairs[1], new_max)
    chunk_max = torch.where(used[:, :, None, None], m[slot], float("-inf")).amax(1)  # [Nc, R, Hq]
    new_max = scatter_max(chunk_max.view(-1, hq), into, new_max)
    row_max = new_max.gather(0, into[:, None].expand(-1, hq)).view(nc, 1, r, hq)
    seen, w = rescale_weights(m[slot], row_max)  # [Nc, C, R, Hq], once for every head group and the sums
    seen = seen & used[:, :, None, None]
    adds = seen & ~fixed[slot][:, :, None, None]  # a masked slot's rows: its fix's
    out = []
    for h in range(hkv):
        hs = slice(h * g, (h + 1) * g)
        rows_h = rescaled(acc[h].view(t, r, g, dv)[slot], adds[..., hs], w[..., hs]).sum(1)  # [Nc, R, G, Dv]
        out.append(torch.zeros((n + DROP_ROWS, g, dv), dtype=dt, device=q.device)
                   .index_add(0, into, rows_h.reshape(-1, g, dv)))
    out = out[0] if hkv == 1 else torch.cat(out, 1)
    fix_w = rescale_weights(m[masked].reshape(s * r, hq), new_max.gather(0, fix_into[:, None].expand(-1, hq)))
    out = out.index_add(0, fix_into, rescaled(fix, *fix_w))
    sums = torch.zeros_like(new_max).index_add(0, into, rescaled(total[slot], seen, w).sum(1).reshape(-1, hq))
    if pairs is not None:
        rows, where = pairs
        seen_p, w_p = rescale_weights(rows.max, new_max.gather(0, where[:, None].expand(-1, hq)))
        out = out.index_add(0, where, rescaled(rows.acc, seen_p, w_p))
        sums = sums.index_add(0, where, rescaled(rows.sum, seen_p, w_p))
    return Partial(out[:n], new_max[:n], sums[:n])


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
