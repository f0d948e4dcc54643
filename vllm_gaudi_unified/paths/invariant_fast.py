"""The batch-invariant mode's fast route: CUDA flash and the Triton decode kernel, in fixed orders.

Why each part is invariant (a token's result depends on its own request only):

* **self and causal**: one causal flash varlen call, each request's new tokens
  one segment (every request, a decode too: its one row against its own key),
  the padding rows one more. Flash's row tiles and key blocks are counted from
  the segment's start, a row's result depends on its own q and its segment's
  keys only (the other rows of a tile have their own softmax rows), and
  `max_q >= 2` keeps flash off its one-row-query path (which reorders heads
  and may split the keys by the batch's size).
* **cached, Triton** (requests with one new token; every request under a
  sliding window): one program per (token, KV head, split) walks the token's
  own slots in position order, `KEYS` keys a step; split `sp` is the keys
  `[sp * SPLIT_KEYS, (sp + 1) * SPLIT_KEYS)` of the token's slots, so a
  split's keys and its loop steps are positions of the token's context. The
  batch sets only how many splits are launched (the longest context): the
  extra ones write empty partials, and `fold_pairwise` folds a power-of-two
  width whose padding merges exactly (`x` with an empty partial is `x`).
* **cached, flash** (requests with two or more new tokens, no window): one
  varlen segment per request, its rows against its own gathered context,
  `seqused_k` its context length, non-causal, `max_q >= 2` as above.
* each token gets its cached partial from exactly one kernel (written, not
  added), and the causal and cached partials are merged in that order. Which
  kernel a request's pairs take depends on its own new-token count alone.
No product here takes its shape from cuBLAS's choice for the batch: the
kernels' tiles are compile-time constants.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, fold_pairwise, merge_all
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.tiles import compute_dtype
from vllm_gaudi_unified.plan import invariant as plan_invariant


def applies(batch, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap) -> bool:
    """CUDA flash for these inputs and the Triton kernel for this cache (`unique.kernel_unique_applies`)."""
    from vllm_gaudi_unified.paths.unique import kernel_unique_applies

    return (fused.kernel_for(batch, q, soft_cap, value_cache.shape[-1]) == "flash"
            and kernel_unique_applies(key_cache, value_cache))


def fast_partial(q, k, v, key_cache, value_cache, batch, scale: float, k_scale=None, v_scale=None) -> Partial:
    """Self and causal (flash per request), cached (Triton slots or the request's flash segment); merged
    in that order."""
    n = q.shape[0]
    cached = _slots_partial(q, key_cache, value_cache, batch, scale, k_scale, v_scale)
    if batch.ctx_rows.shape[0]:
        kk = read_blocks(key_cache, batch.ctx_blocks, k_scale, q.dtype).flatten(0, 1)  # [keys, Hkv, D]
        vv = read_blocks(value_cache, batch.ctx_blocks, v_scale, q.dtype).flatten(0, 1)
        max_q, max_k = batch.plan.ctx_max
        part = fused.flash_varlen(q[batch.ctx_rows], kk, vv, batch.ctx_cu_q.to(torch.int32),
                                  batch.ctx_cu_k.to(torch.int32), max_q, max_k, scale, causal=False,
                                  seqused_k=batch.ctx_used.to(torch.int32))
        cached = _placed(part, batch.ctx_rows, n, cached)
    return merge_all([p for p in (_causal_partial(q, k, v, batch, scale), cached) if p is not None])


def _causal_partial(q, k, v, batch, scale: float) -> Partial:
    """Every token's self and causal pairs: one flash segment per request, one for the padding rows (so no
    row is left unwritten). Non-finite values contained as on the default path (`fused.clean_causal_values`)."""
    n, real = q.shape[0], batch.num_tokens
    cu, max_q = batch.seg_cu.to(torch.int32), batch.plan.seg_max
    if n > real:
        cu = torch.cat([cu, cu.new_full((1,), n)])
        max_q = max(max_q, n - real)
    w = batch.sliding_window
    v, bad = fused.clean_causal_values(v, batch.token_seg_start, w)
    return fused.mark_bad_rows(fused.flash_varlen(q, k, v, cu, cu, max_q, max_q, scale, causal=True, window=w), bad)


def _placed(part: Partial, rows: torch.Tensor, n: int, into: Partial | None = None) -> Partial:
    """`part`'s rows written (index_copy: each row once) at `rows` of `into` (default: n empty rows)."""
    if into is None:
        acc = part.acc.new_zeros((n,) + part.acc.shape[1:])
        into = Partial(acc, part.max.new_full((n, part.max.shape[1]), float("-inf")),
                       part.sum.new_zeros(n, part.sum.shape[1]))
    return Partial(*(x.index_copy(0, rows, y) for x, y in zip(into, part)))


def _slots_partial(q, key_cache, value_cache, batch, scale, k_scale=None, v_scale=None) -> Partial | None:
    """The Triton kernel over each token's slots (sorted by token, then position) in position-fixed
    splits of `plan.invariant.SPLIT_KEYS` keys, the splits folded by `fold_pairwise`."""
    from vllm_gaudi_unified.paths import unique, unique_kernel

    rows = batch.slot_rows
    if rows.shape[0] == 0:
        return None
    n, hq, d = q.shape
    _, bs, hkv, _ = key_cache.shape
    g = hq // hkv
    starts = torch.searchsorted(rows, torch.arange(n + 1, device=q.device, dtype=rows.dtype))
    order = torch.arange(rows.shape[0], device=q.device, dtype=rows.dtype)  # already sorted by the planner
    splits = batch.plan.slot_splits
    dt = compute_dtype(q.dtype)
    acc = torch.empty((n, splits, hq, d), dtype=dt, device=q.device)
    m = torch.empty((n, splits, hq), dtype=dt, device=q.device)
    total = torch.empty_like(m)
    ks, ks_strides, k_factor = unique._scale_args(k_scale)
    vs, vs_strides, v_factor = unique._scale_args(v_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    unique_kernel.unique_kernel[(n, hkv, splits)](
        q, key_cache, value_cache, key_cache if ks is None else ks, value_cache if vs is None else vs,
        order, starts, batch.slot_blocks, batch.slot_lo, batch.slot_hi, starts, n, acc, m, total,  # (seg: unused)
        scale * k_factor, v_factor,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3], *ks_strides, *vs_strides,
        HQ=hq, G=g, ROWS=max(16, unique._pow2(g)), D=d, D_PAD=max(16, unique._pow2(d)), BS=bs,
        KEYS=unique.KERNEL_KEYS, SPLITS=splits, SLICE=False, K_SCALES=unique._scale_mode(ks),
        V_SCALES=unique._scale_mode(vs), SPLIT_KEYS=plan_invariant.SPLIT_KEYS,
        num_warps=unique.KERNEL_WARPS, num_stages=unique.KERNEL_STAGES)
    return fold_pairwise(Partial(acc, m, total)) if splits > 1 else Partial(acc[:, 0], m[:, 0], total[:, 0])
