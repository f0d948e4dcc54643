"""The unique path's verify units on the matmul route (the Gaudi route: torch ops an HPU graph holds).

A unit is one (request, cache block) slot; its rows are the request's new tokens x the query heads of
a KV head, so a block is read once for all of them (`PlanOptions.unique_tokens`). Per KV head one
batched product over every unit reads that head's keys in place (a strided view of the block as
stored, no copy), then one softmax over all heads, and per KV head `p @ V` again on V as stored. The
scores are head-major (`[Hkv, T, R, G, K]`, one mask per slot: a unit's rows past its request's tokens see
the slot's keys too and go to dropped rows) from `HEADS_FIRST_MIN_ROWS` rows per KV head, else token-major
(`[T, Hkv, R, G, K]`, those rows masked out): which is faster depends on the rows (measured).

The tiles whose real rows miss some key (a request's partial last block: its unused slots may hold
NaN, and `0 * NaN` would reach every row of the tile) take `p @ V` again on masked V, all heads in one
product; their rows replace those tiles' rows in the merge. The merge is one accumulator: each row is
scaled to its token's max and added at its token (a slot's rows that belong to no token at the
dropped rows past `n`), the requests' own new pairs (`request_pairs`) beside them.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.merge import Partial, compute_dtype, rescale_weights, rescaled, scatter_max
from vllm_gaudi_unified.paths.tiles import attend, product_dtype, score_product

#: Dropped rows the units' rows without a token are added into, spread: added into one, they would queue on
#: its addresses.
DROP_ROWS = 64
#: A KV head's unit rows (tokens x query heads) from which the scores are laid out head-major: measured faster
#: there (32 rows: 64 x 8, ragged 96, heads 64/8/64 and 8/1/128) and slower at 16 and 8 rows (64 x 4, 64 x 2,
#: 16 x 2; at 64 x 4 its compiled softmax is a looped reduction, token-major one pass), docs/benchmarks.md.
HEADS_FIRST_MIN_ROWS = 32
#: Probabilities taken against each token's max over all its units (`scatter_max` of the rows' maxes first),
#: so `p @ V` writes rows already scaled and the merge adds them with no rescale pass.
TOKEN_MAX = False
#: Every KV head's rows added by one `index_add` over `[T*R, Hq, Dv]` (else one per KV head).
ONE_ADD = False
#: The tokens' maxes scattered as integers ordered as the floats (`ordered_bits`): the device's integer atomic
#: max, where a float max is a compare-and-swap loop that many units of one token queue on.
INT_MAX = False


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Floats -> integers of their width in the same order (NaN, made positive, above +inf); its own inverse on
    the integers (`ordered_bits(ordered_bits(x)).view(x.dtype)` is x, a NaN as a positive NaN)."""
    if x.is_floating_point():
        x = torch.where(torch.isnan(x), float("nan"), x).view(torch.int32 if x.dtype == torch.float32 else torch.int64)
    return torch.where(x < 0, x ^ torch.iinfo(x.dtype).max, x)


def token_max(m: torch.Tensor, index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """`merge.scatter_max(m, index, start)`; with `INT_MAX` through `ordered_bits`."""
    if not INT_MAX:
        return scatter_max(m, index, start)
    idx = index[:, None].expand(-1, m.shape[1])
    return ordered_bits(ordered_bits(start).scatter_reduce(0, idx, ordered_bits(m), "amax")).view(start.dtype)


def units_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor,
                  mask: torch.Tensor, masked: torch.Tensor, scale: float, soft_cap: float | None,
                  pairs: tuple[Partial, torch.Tensor] | None = None) -> Partial:
    """q `[n, Hq, D]` (the step's queries), k/v `[slots, K, Hkv, D]` (the units' blocks as stored), the
    units' tokens and which are real `[slots, R]` (`unique.unit_tokens`), mask `[slots, 1, K]` (the
    slot's visible keys), `masked`: the slots whose real rows may miss a key (`unique._partial_slots`),
    `pairs`: the requests' own new pairs as rows and their tokens (`request_pairs`) -> Partial `[n]`."""
    n = q.shape[0]
    t, r = tokens.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    hq, d = q.shape[1:]
    g = hq // hkv
    dt = compute_dtype(q.dtype)
    op = product_dtype(q.dtype)
    q, k, v = q.to(op), k.to(op), v.to(op)  # no-ops but for fp16 (its products in fp32)
    drop = n + torch.arange(t * r, device=q.device) % DROP_ROWS  # [T*R]
    index = torch.where(real.reshape(-1), tokens.reshape(-1), drop)
    # rows (r, g) per KV head: the gathered queries written once in the products' layout
    qg = q[tokens.clamp(max=n - 1)].view(t, r, hkv, g, d)
    heads_first = r * g >= HEADS_FIRST_MIN_ROWS
    if heads_first:  # head-major: one mask per slot (a unit's rows without a token see its keys, and are dropped)
        qh = qg.permute(2, 0, 1, 3, 4).reshape(hkv, t, r * g, d)
        scores = torch.cat([score_product(qh[h], k[:, :, h].transpose(1, 2)) for h in range(hkv)])
        scores = scores.view(hkv, t, r, g, nk).to(dt) * scale  # [Hkv, T, R, G, K]
    else:  # token-major: the rows without a token masked out
        mask = mask & real[:, :, None]  # [T, R, K]
        qh = qg.transpose(1, 2).reshape(t, hkv, r * g, d)
        scores = torch.stack([score_product(qh[:, h], k[:, :, h].transpose(1, 2)) for h in range(hkv)], 1)
        scores = scores.view(t, hkv, r, g, nk).to(dt) * scale  # [T, Hkv, R, G, K]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.masked_fill(~(mask[None, :, :, None] if heads_first else mask[:, None, :, None]), float("-inf"))
    as_rows = lambda x: (x.permute(1, 2, 0, 3) if heads_first else x.transpose(1, 2)).reshape(t * r, hq)  # noqa: E731
    new_max = torch.full((n + DROP_ROWS, hq), float("-inf"), dtype=dt, device=q.device)
    if pairs is not None:
        new_max = scatter_max(pairs[0].max, pairs[1], new_max)
    if TOKEN_MAX:  # each token's max first: the probabilities against it, so the rows need no rescale
        m = as_rows(scores.amax(-1))
        new_max = token_max(m, index, new_max)
        ref = new_max.gather(0, index[:, None].expand(-1, hq))
        ref = torch.where(ref == float("-inf"), 0.0, ref).view(t, r, hkv, g)
        p = torch.exp(scores - (ref.permute(2, 0, 1, 3) if heads_first else ref.transpose(1, 2))[..., None])
        total = as_rows(p.sum(-1))
    else:
        p, m, total = masked_softmax_for(scores)(scores)
        m, total = as_rows(m), as_rows(total)
    p = p.to(v.dtype).view(*scores.shape[:2], r * g, nk)
    acc = [torch.matmul(p[h] if heads_first else p[:, h], v[:, :, h]) for h in range(hkv)]  # [T, R*G, Dv], V as stored
    # The masked tiles again on masked V, all heads in one product; a slot listed twice is added once.
    s = masked.shape[0]
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    seen = mask[masked, 0] if heads_first else mask.any(1)[masked]  # [S, K]
    vz = torch.where(seen[:, :, None, None], v[masked], zero).transpose(1, 2)  # [S, Hkv, K, Dv]
    fix = torch.matmul(p[:, masked].transpose(0, 1) if heads_first else p[masked], vz)
    fix = fix.view(s, hkv, r, g, dv).transpose(1, 2).reshape(s * r, hq, dv)
    listed = torch.arange(s, device=q.device)
    once = torch.zeros(t, dtype=listed.dtype, device=q.device).scatter_(0, masked, listed)[masked] == listed
    fix_rows = (masked[:, None] * r + torch.arange(r, device=q.device)).reshape(-1)  # [S*R]
    fix_index = torch.where(once[:, None].expand(s, r).reshape(-1), index[fix_rows], drop[:s * r])
    fixed = torch.zeros(t, dtype=torch.bool, device=q.device).index_fill_(0, masked, True)
    acc_index = torch.where(fixed[:, None].expand(t, r).reshape(-1), drop, index)  # their rows: the fix's
    # one accumulator: every row's max first, then each row scaled to its token's and added
    if TOKEN_MAX:  # (already scaled: a row that saw no key adds exactly 0 whatever its V held)
        seen = m != float("-inf")
        rows = torch.stack([a.view(t, r, g, dv) for a in acc], 2).view(t * r, hq, dv) if hkv > 1 else acc[0]
        out = torch.zeros((n + DROP_ROWS, hq, dv), dtype=dt, device=q.device)
        out = out.index_add(0, acc_index, torch.where(seen[..., None], rows.view(t * r, hq, dv).to(dt), 0.0))
        out = out.index_add(0, fix_index, torch.where(seen[fix_rows][..., None], fix.to(dt), 0.0))
        sums = torch.zeros_like(new_max).index_add(0, index, total)
    else:
        new_max = token_max(m, index, new_max)
        row_max = new_max.gather(0, index[:, None].expand(-1, hq))
        seen, w = rescale_weights(m, row_max)  # once for every head group, the fix's rows and the sums
        if ONE_ADD:
            rows = torch.stack([a.view(t, r, g, dv) for a in acc], 2).view(t * r, hq, dv) if hkv > 1 else acc[0]
            out = torch.zeros((n + DROP_ROWS, hq, dv), dtype=dt, device=q.device)
            out = out.index_add(0, acc_index, rescaled(rows.view(t * r, hq, dv), seen, w))
        else:
            out = []
            for h in range(hkv):
                hs = slice(h * g, (h + 1) * g)
                row_acc = rescaled(acc[h].view(t * r, g, dv), seen[:, hs], w[:, hs])
                out.append(torch.zeros((n + DROP_ROWS, g, dv), dtype=dt, device=q.device).index_add(0, acc_index,
                                                                                                  row_acc))
            out = out[0] if hkv == 1 else torch.cat(out, 1)
        out = out.index_add(0, fix_index, rescaled(fix, seen[fix_rows], w[fix_rows]))
        sums = torch.zeros_like(new_max).index_add(0, index, rescaled(total, seen, w))
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
