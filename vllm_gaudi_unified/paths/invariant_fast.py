"""The batch-invariant mode's fast route: CUDA flash and the Triton decode kernel, in fixed orders.

Why each part is invariant (a token's result depends on its own request only):

* **self, one new token; self and causal, a unit**: in the token's (the
  unit's) Triton program below, after the context keys of its split 0, its
  request's new keys in the request's order (`NEW_KEYS` per step, causal by
  the tokens' order): keys and order of the request alone.
* **self and causal, several new tokens (not a unit)**: one causal flash varlen call over
  these requests' rows (gathered), each request one segment. Flash's row tiles
  and key blocks are counted from the segment's start, a row's result depends
  on its own q and its segment's keys only (the other rows of a tile have
  their own softmax rows), and `max_q >= 2` keeps flash off its one-row-query
  path (which reorders heads and may split the keys by the batch's size).
* **cached, Triton** (requests with one new token; every request under a
  sliding window): one program per (token, KV head, split) walks the token's
  own slots in position order (the plan lists them by token: `slot_starts`),
  `KEYS` keys a step; split `sp` is the keys `[sp * S, (sp + 1) * S)` of the
  token's slots, `S` = `plan.invariant.split_keys(kv heads)` (a constant of the
  model), so a split's keys and its loop steps are positions of the token's
  context. The batch sets only how many splits are launched (the longest
  context's count): the extra ones write empty partials, and
  `mla_kernel.ordered_combine` folds a token's splits one after the other in
  index order, an empty one leaving the sums as they are (its split count a
  run-time number, the same compiled code for any batch).
* **cached, Triton units** (verify steps: 2 to `unique_tokens` new tokens over a
  context, no window, `plan.invariant.unit_requests`): the request's slots
  are listed once, on its first token; that token's program takes the
  request's rows (its tokens x the KV head's query heads, `UNITS` x G rows,
  a constant of the options) against each key it loads, in the same
  position-fixed splits. A row's dot products, max, sum and `p @ V` are its
  own (rows past the request's tokens are zero queries never stored), and
  the keys and the splits are the request's own: the same bits alone or in
  any batch.
* **cached, flash** (requests with several new tokens, not units, no window): one
  varlen segment per request, its rows against its own gathered context,
  `seqused_k` its context length, non-causal, `max_q >= 2` as above.
* a token of a flash causal segment gets it and its cached partial (Triton
  or flash) from exactly one kernel each (written, not added), merged in that
  order; a one-token request's or a unit's token gets all its pairs from its
  Triton program (no merge: an empty partial beside it merges exactly).
  With no flash segment in the step the rows come normalized: the kernel's
  (`FINAL`) where no token has more than one split, else the combine's;
  both divide as `merge.normalize` does (IEEE's division of the same fp32
  numbers; one real split has weight exp(0) = 1): the same bits.
  The requests on their own calls (`invariant.own_rows`) are left out
  when those run (`own`): their entries are the arrays' last ones. Which
  kernel a request's pairs take depends on its own new-token count alone.
No product here takes its shape from cuBLAS's choice for the batch: the
kernels' tiles are compile-time constants.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Final, Partial, merge_all
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.tiles import compute_dtype
from vllm_gaudi_unified.plan import invariant as plan_invariant


def applies(batch, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap) -> bool:
    """CUDA flash for these inputs and the Triton kernel for this cache (`unique.kernel_unique_applies`)."""
    from vllm_gaudi_unified.paths.unique import kernel_unique_applies

    return (fused.kernel_for(batch, q, soft_cap, value_cache.shape[-1]) == "flash"
            and kernel_unique_applies(key_cache, value_cache))


def fast_partial(q, k, v, key_cache, value_cache, batch, scale: float, k_scale=None, v_scale=None,
                 own: bool = False, final: bool = False) -> Partial | Final:
    """Self and causal pairs in flash per request (of the requests with several new tokens, not units),
    cached keys (Triton slots, with the new keys of one-token requests and units, or the request's flash
    segment); merged in that order. `own`: not the own-calls requests' rows (those come
    from their own calls): the prefixes of the `ctx_*` and `seg_*` arrays before theirs. `final` (no
    partial follows: no sinks): where the Triton kernel is the step's only path, its rows normalized by the
    kernel or its splits' combine (`Final`)."""
    n, plan = q.shape[0], batch.plan
    rows, segs, blocks, max_q, max_k = plan.ctx_own_from if own else (
        batch.ctx_rows.shape[0], batch.ctx_used.shape[0], batch.ctx_blocks.shape[0], *plan.ctx_max)
    causal_rows = plan.seg_own_from[0] if own else batch.seg_rows.shape[0]
    if final and not rows and not causal_rows:
        return _slots_partial(q, k, v, key_cache, value_cache, batch, scale, k_scale, v_scale, final=True)
    cached = _slots_partial(q, k, v, key_cache, value_cache, batch, scale, k_scale, v_scale)
    if rows:
        ids = batch.ctx_blocks[:blocks]
        kk = read_blocks(key_cache, ids, k_scale, q.dtype).flatten(0, 1)  # [keys, Hkv, D]
        vv = read_blocks(value_cache, ids, v_scale, q.dtype).flatten(0, 1)
        ctx_rows = batch.ctx_rows[:rows]
        part = fused.flash_varlen(q[ctx_rows], kk, vv, batch.ctx_cu_q[:segs + 1].to(torch.int32),
                                  batch.ctx_cu_k[:segs + 1].to(torch.int32), max_q, max_k, scale, causal=False,
                                  seqused_k=batch.ctx_used[:segs].to(torch.int32))
        cached = _placed(part, ctx_rows, n, cached)
    first = _causal_partial(q, k, v, batch, scale, own)
    return merge_all([p for p in (first, cached) if p is not None])


def _causal_partial(q, k, v, batch, scale: float, own: bool = False) -> Partial | None:
    """The self and causal pairs of the requests with several new tokens but the units: one flash segment
    each, on their rows gathered (`own`: not the own-calls requests'). Non-finite values contained as on
    the default path (`fused.clean_causal_values`)."""
    plan = batch.plan
    rows, segs, max_q = plan.seg_own_from if own else (batch.seg_rows.shape[0], batch.seg_cu.shape[0] - 1,
                                                        plan.seg_max)
    if not rows:
        return None
    idx, cu = batch.seg_rows[:rows], batch.seg_cu[:segs + 1].to(torch.int32)
    w = batch.sliding_window
    v, bad = fused.clean_causal_values(v, batch.token_seg_start, w)
    part = fused.flash_varlen(q[idx], k[idx], v[idx], cu, cu, max_q, max_q, scale, causal=True, window=w)
    return _placed(fused.mark_bad_rows(part, bad[idx]), idx, q.shape[0])


def _placed(part: Partial, rows: torch.Tensor, n: int, into: Partial | None = None) -> Partial:
    """`part`'s rows written (index_copy: each row once) at `rows` of `into` (default: n empty rows)."""
    if into is None:
        acc = part.acc.new_zeros((n,) + part.acc.shape[1:])
        into = Partial(acc, part.max.new_full((n, part.max.shape[1]), float("-inf")),
                       part.sum.new_zeros(n, part.sum.shape[1]))
    return Partial(*(x.index_copy(0, rows, y) for x, y in zip(into, part)))


def _slots_partial(q, k, v, key_cache, value_cache, batch, scale, k_scale=None,
                   v_scale=None, final: bool = False) -> Partial | Final | None:
    """The Triton kernel over each token's slots (sorted by token, then position: `slot_starts` from the
    plan) in position-fixed splits of `plan.invariant.split_keys` keys (a constant of the model's KV heads),
    the splits folded in index order by `mla_kernel.ordered_combine`. A unit
    (`plan.invariant.unit_requests`, a verify step) has its slots on its first token, whose programs
    take the request's rows (`UNITS` = `plan.slot_units` tokens x the KV head's query heads); every
    other token's program writes its own rows (empty ones where it has no slot). The programs of the
    one-token requests and of the units (`slot_take`) take their request's new keys too (`k`, `v`: a decode's
    self pair, a unit's self and causal pairs), in split 0 after its context keys, in the request's order.
    `final` (nothing else in the step): the rows in q's dtype, no Partial returned: with one split the kernel's
    `FINAL` rows, else the combine's; both divide as IEEE's, so they are `merge.normalize`'s of the Partial
    bit for bit."""
    from vllm_gaudi_unified.paths import mla_kernel, unique, unique_kernel

    if batch.slot_rows.shape[0] == 0 and batch.one_rows.shape[0] == 0:
        return None
    n, hq, d = q.shape
    _, bs, hkv, _ = key_cache.shape
    g, plan = hq // hkv, batch.plan
    split = plan_invariant.split_keys(hkv)
    splits, units = max(1, -(-plan.slot_most * bs // split)), plan.slot_units
    dt = compute_dtype(q.dtype)
    in_kernel = final and splits == 1
    out = torch.empty((n, hq, d), dtype=q.dtype if final else dt, device=q.device) if final or splits > 1 else None
    acc = torch.empty((1,) if in_kernel else (n, splits, hq, d), dtype=dt, device=q.device)  # (in_kernel: its dtype)
    m = acc if in_kernel else torch.empty((n, splits, hq), dtype=dt, device=q.device)
    total = acc if in_kernel else torch.empty_like(m)
    ks, ks_strides, k_factor = unique._scale_args(k_scale)
    vs, vs_strides, v_factor = unique._scale_args(v_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    starts = batch.slot_starts
    unique_kernel.unique_kernel[(n, hkv, splits)](
        q, key_cache, value_cache, key_cache if ks is None else ks, value_cache if vs is None else vs,
        starts, starts, batch.slot_blocks, batch.slot_lo, batch.slot_hi, batch.token_seg_start, n, acc, m, total,
        scale * k_factor, v_factor,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3], *ks_strides, *vs_strides,
        HQ=hq, G=g, ROWS=max(16, unique._pow2(units * g)), D=d, D_PAD=max(16, unique._pow2(d)), BS=bs,
        KEYS=unique.KERNEL_KEYS, SPLITS=splits, SLICE=False, K_SCALES=unique._scale_mode(ks),
        V_SCALES=unique._scale_mode(vs), SPLIT_KEYS=split, UNITS=units,
        **unique._new_args((k, v), q, scale, v_factor, units, batch.slot_take), out_ptr=out if in_kernel else acc,
        FINAL=in_kernel, EXACT_DIV=in_kernel, SORTED=True, WORK=False, num_warps=unique.KERNEL_WARPS,
        num_stages=unique.KERNEL_STAGES)
    if in_kernel:
        return Final(out)
    if splits == 1:
        return Partial(acc[:, 0], m[:, 0], total[:, 0])
    om, ol = (None, None) if final else torch.empty((2, n, hq), dtype=dt, device=q.device)
    mla_kernel.ordered_combine[(n * hq,)](acc, m, total, starts, out, out if final else om, out if final else ol,
                                          splits, hq, DV=d, DV_PAD=max(16, unique._pow2(d)), starts_ptr=starts, BS=bs,
                                          ONE_KEYS=0, TOKENS=False, FINAL=final, EXACT_DIV=final)
    return Final(out) if final else Partial(out, om, ol)
