"""The unique path's verify units on the Gaudi route (torch ops and the fused SDPA call an HPU graph holds).

A unit is one (request, cache block) slot; its rows are the request's new tokens x the query heads of
a KV head, so a block is read once for all of them (`PlanOptions.unique_tokens`). With `FUSED` (16-bit
inputs, no soft cap, one head dim) every unit is one fused call with statistics (`fused.sdpa_lse`:
FusedSDPA's on a Gaudi, cuDNN's on CUDA), a KV head's rows (tokens x query heads) the queries of one head
over the block as stored (no copy of K or V, no score in memory); its LSE is the rows' max and their sum 1.
The slots whose real rows miss a key (a request's partial last block: its unused slots may hold NaN)
are computed again on the matmul tiles (`tiles.attend`, masked), and their rows and statistics take the
place of the call's. Otherwise (the matmul form): per KV head one batched product over every unit reads
that head's keys in place (a strided view of the block as stored), then one softmax over all heads, and
per KV head `p @ V` again on V as stored. The
scores are head-major (`[Hkv, T, R, G, K]`, one mask per slot: a unit's rows past its request's tokens see
the slot's keys too and go to dropped rows) from `HEADS_FIRST_MIN_ROWS` rows per KV head, else token-major
(`[T, Hkv, R, G, K]`, those rows masked out): which is faster depends on the rows (measured); the masked
tiles take `p @ V` again on masked V, all heads in one product, their rows replacing those tiles' rows.

The merge is one accumulator: each row is scaled to its token's max and added at its token (a slot's rows
that belong to no token at the dropped rows past `n`), the requests' own new pairs (`request_pairs`) beside
them.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.merge import Partial, compute_dtype, dense_max, rescale_weights, rescaled, scatter_max
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.tiles import attend, product_dtype, score_product

#: Dropped rows the units' rows without a token are added into, spread: added into one, they would queue on
#: its addresses.
DROP_ROWS = 64
#: A KV head's unit rows (tokens x query heads) from which the scores are laid out head-major: measured faster
#: there (32 rows: 64 x 8, ragged 96, heads 64/8/64 and 8/1/128) and slower at 16 and 8 rows (64 x 4, 64 x 2,
#: 16 x 2; at 64 x 4 its compiled softmax is a looped reduction, token-major one pass), docs/benchmarks.md.
HEADS_FIRST_MIN_ROWS = 32
#: The units through one fused call with statistics (`fused.sdpa_lse`) where it takes them, else the matmul
#: form: measured faster at every verify step (docs/benchmarks.md, "Speculative verify steps").
FUSED = True
#: Copies of the tokens' max the units' row maxima are scattered into (a unit's rows into copy `unit % MAX_COPIES`),
#: then reduced over the copies, where `merge.scatter_max` takes the scatter form and a unit holds at most
#: `MAX_COPIES_UNIT_ENTRIES` maxima (rows x query heads): a request's adjacent units hit the same tokens, and a
#: scatter with a max queues on an address many of a thread block's entries hit. Compiled and replayed on an
#: H200 (alternately, one process): 64 x (4 over 3k) at heads 8/1/128 (32 entries) 0.156 -> 0.146 ms at 4
#: copies, 0.141 at 8 and 16 (its decode 0.105); the verify steps at heads 32/8/128 (256 entries) mixed: 64 x
#: (8 over 3k) 0.564 -> 0.559 at 4, 0.595 at 8, 0.581 at 16, ragged 96 0.951 -> 0.962 at 8, 0.947 at 16.
MAX_COPIES = 16
MAX_COPIES_UNIT_ENTRIES = 32


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
    if FUSED and soft_cap is None and dv == d and fused.lse_kernel_for(q):
        return _fused_units(qg, k, v, index, drop, mask, masked, scale, n, pairs)
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
    p, m, total = masked_softmax_for(scores)(scores)
    p = p.to(v.dtype).view(*scores.shape[:2], r * g, nk)
    acc = [torch.matmul(p[h] if heads_first else p[:, h], v[:, :, h]) for h in range(hkv)]  # [T, R*G, Dv], V as stored
    m, total = ((x.permute(1, 2, 0, 3) if heads_first else x.transpose(1, 2)).reshape(t * r, hq) for x in (m, total))
    # The masked tiles again on masked V, all heads in one product; a slot listed twice is added once.
    s = masked.shape[0]
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    seen = mask[masked, 0] if heads_first else mask.any(1)[masked]  # [S, K]
    vz = torch.where(seen[:, :, None, None], v[masked], zero).transpose(1, 2)  # [S, Hkv, K, Dv]
    fix = torch.matmul(p[:, masked].transpose(0, 1) if heads_first else p[masked], vz)
    fix = fix.view(s, hkv, r, g, dv).transpose(1, 2).reshape(s * r, hq, dv)
    fix_rows, fix_index, acc_index = _fix_rows(masked, index, drop, t, r)
    # one accumulator: every row's max first, then each row scaled to its token's and added
    new_max = _token_max(m, index, pairs, n, r)
    row_max = new_max.gather(0, index[:, None].expand(-1, hq))
    seen, w = rescale_weights(m, row_max)  # once for every head group, the fix's rows and the sums
    out = []
    for h in range(hkv):
        hs = slice(h * g, (h + 1) * g)
        row_acc = rescaled(acc[h].view(t * r, g, dv), seen[:, hs], w[:, hs])
        out.append(torch.zeros((n + DROP_ROWS, g, dv), dtype=dt, device=q.device).index_add(0, acc_index, row_acc))
    out = out[0] if hkv == 1 else torch.cat(out, 1)
    out = out.index_add(0, fix_index, rescaled(fix, seen[fix_rows], w[fix_rows]))
    sums = torch.zeros_like(new_max).index_add(0, index, rescaled(total, seen, w))
    return _with_pairs(out, new_max, sums, pairs, n)


def _fused_units(qg, k, v, index, drop, mask, masked, scale, n, pairs) -> Partial:
    """`units_partial` through `fused.sdpa_lse` (`FUSED`): qg `[T, R, Hkv, G, D]` the gathered queries, index and
    drop `[T*R]` the rows' tokens and dropped rows, the rest as `units_partial`'s."""
    t, r, hkv, g, d = qg.shape
    hq, nk, dv = hkv * g, k.shape[1], v.shape[-1]
    dt = compute_dtype(qg.dtype)
    qh = qg.permute(0, 2, 1, 3, 4).reshape(t, hkv, r * g, d)
    out, lse = fused.sdpa_lse(qh, k.transpose(1, 2), v.transpose(1, 2), None, scale)  # every key of each slot
    rows = out.view(t, hkv, r, g, dv).transpose(1, 2).reshape(t * r, hq, dv)  # acc = the normalised rows, sum 1
    m = lse.view(t, hkv, r, g).transpose(1, 2).reshape(t * r, hq)
    # The masked slots again on the matmul tiles, masked; their rows' statistics replace the call's (which may
    # have met a NaN in an unused slot), their rows are added in place of its (sent to the dropped rows).
    s = masked.shape[0]
    fix = attend(qg[masked].view(s, r, hq, d), k[masked], v[masked], mask[masked].expand(s, r, nk), scale, None)
    fix_rows, fix_index, acc_index = _fix_rows(masked, index, drop, t, r)
    m = m.index_copy(0, fix_rows, fix.max)
    total = torch.ones_like(m).index_copy(0, fix_rows, fix.sum)
    new_max = _token_max(m, index, pairs, n, r)
    seen, w = rescale_weights(m, new_max.gather(0, index[:, None].expand(-1, hq)))
    acc = torch.zeros((n + DROP_ROWS, hq, dv), dtype=dt, device=qg.device).index_add(0, acc_index,
                                                                                     rescaled(rows.to(dt), seen, w))
    acc = acc.index_add(0, fix_index, rescaled(fix.acc, seen[fix_rows], w[fix_rows]))
    sums = torch.zeros_like(new_max).index_add(0, index, rescaled(total, seen, w))
    return _with_pairs(acc, new_max, sums, pairs, n)


def _fix_rows(masked: torch.Tensor, index: torch.Tensor, drop: torch.Tensor, t: int, r: int):
    """(the masked slots' rows `[S*R]`, their tokens: a slot listed twice added once, the units' rows' tokens with
    the masked slots' rows at the dropped rows: the fix's rows take their place)."""
    s = masked.shape[0]
    listed = torch.arange(s, device=masked.device)
    once = torch.zeros(t, dtype=listed.dtype, device=masked.device).scatter_(0, masked, listed)[masked] == listed
    fix_rows = (masked[:, None] * r + torch.arange(r, device=masked.device)).reshape(-1)
    fix_index = torch.where(once[:, None].expand(s, r).reshape(-1), index[fix_rows], drop[:s * r])
    fixed = torch.zeros(t, dtype=torch.bool, device=masked.device).index_fill_(0, masked, True)
    return fix_rows, fix_index, torch.where(fixed[:, None].expand(t, r).reshape(-1), drop, index)


def _token_max(m: torch.Tensor, index: torch.Tensor, pairs, n: int, r: int) -> torch.Tensor:
    """Each token's max `[n + DROP_ROWS, Hq]` over the rows `m` (at `index`, `r` rows a unit) and the requests'
    pairs; spread over `MAX_COPIES` copies where the scatter form runs on few maxima a unit (exact: a max in any
    order)."""
    width, hq = n + DROP_ROWS, m.shape[1]
    new_max = m.new_full((width, hq), float("-inf"))
    if pairs is not None:
        new_max = scatter_max(pairs[0].max, pairs[1], new_max)
    if MAX_COPIES <= 1 or r * hq > MAX_COPIES_UNIT_ENTRIES or dense_max(width, m) or not m.numel():
        return scatter_max(m, index, new_max)
    unit = torch.arange(m.shape[0], device=m.device, dtype=index.dtype) // r
    copies = m.new_full((MAX_COPIES * width, hq), float("-inf"))
    copies = scatter_max(m, index + unit % MAX_COPIES * width, copies)
    return torch.maximum(new_max, copies.view(MAX_COPIES, width, hq).amax(0))


def _with_pairs(out: torch.Tensor, new_max: torch.Tensor, sums: torch.Tensor, pairs, n: int) -> Partial:
    """The accumulators with the requests' own pairs (`request_pairs`) scaled to the tokens' max and added."""
    if pairs is not None:
        rows, where = pairs
        seen, w = rescale_weights(rows.max, new_max.gather(0, where[:, None].expand(-1, new_max.shape[1])))
        out = out.index_add(0, where, rescaled(rows.acc, seen, w))
        sums = sums.index_add(0, where, rescaled(rows.sum, seen, w))
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
