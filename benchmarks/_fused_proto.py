"""Scratch (issue 14, before the layout move): fused causal and unique paths through CUDA flash attention.

Installed into the current core by `install()` for a benchmark run; the landed version lives in the core.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified import attention, unique
from vllm_gaudi_unified.kernels import attend, compute_dtype
from vllm_gaudi_unified.merge import Partial, scatter_merge
from vllm_gaudi_unified.shared import slot_mask


FLASH = torch.ops.aten._flash_attention_forward


def flash(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None):
    left = None if window is None else window - 1
    out, lse = FLASH(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        window_size_left=left, window_size_right=None if window is None else 0)[:2]
    return out, lse


def fused_causal(q, k, v, batch, scale):
    """Every new token against the new tokens of its request up to itself (self pair included)."""
    t = q.shape[0]
    ends = torch.cummax(batch.logits_indices + 1, 0).values
    cu = torch.cat([ends.new_zeros(1), ends, ends.new_full((1,), t)]).to(torch.int32)
    b = batch.bucket
    max_q = max(1, min(t, b.num_causal_tiles * batch.causal_tile)) if b.phase[0] == "c" else 1
    out, lse = flash(q, k, v, cu, cu, max_q, max_q, scale, True, batch.sliding_window)
    lse = lse.t().to(compute_dtype(q.dtype))  # [T, Hq]
    return Partial(out.to(lse.dtype), lse, torch.ones_like(lse))


def fused_unique(q, key_cache, value_cache, batch, scale, soft_cap):
    slots = batch.unique_rows.shape[0]
    if slots == 0:
        return None
    n = q.shape[0]
    if batch.unique_blocks is None:
        k, v = key_cache[:slots], value_cache[:slots]
    else:
        k, v = key_cache[batch.unique_blocks], value_cache[batch.unique_blocks]
    rows = batch.unique_rows
    qr = q[rows.clamp(max=n - 1)][:, None]  # [slots, 1, Hq, D]
    out, lse = FLASH(qr, k, v, None, None, 1, k.shape[1], 0.0, False, False,
                                                       scale=scale)[:2]
    acc, m = out[:, 0], lse[:, :, 0]  # [slots, Hq, D] in bf16, [slots, Hq]
    bs = key_cache.shape[1]
    sel = unique._partial_slots(batch, n, bs)
    mask = slot_mask(batch.unique_lo[sel], batch.unique_hi[sel], bs)[:, None, :]
    fix = attend(qr[sel], k[sel], v[sel], mask, scale, soft_cap)  # the partly seen blocks, masked
    fixed_m = torch.where(fix.sum > 0, fix.max + torch.log(torch.where(fix.sum > 0, fix.sum, 1.0)), float("-inf"))
    fixed_acc = fix.acc / torch.where(fix.sum > 0, fix.sum, 1.0)[..., None]
    acc = acc.index_copy(0, sel, fixed_acc.to(acc.dtype))
    m = m.index_copy(0, sel, fixed_m)
    part = Partial(acc.float(), m, (m > float("-inf")).float())
    return scatter_merge(part, rows, n)


def fused_shared(q, key_cache, value_cache, batch, scale):
    """Each shared tile as one flash segment: its real rows (packed) against its blocks' visible key prefix."""
    tiles, r = batch.shared_rows.shape
    n = q.shape[0]
    kb, bs = batch.shared_blocks.shape[1], key_cache.shape[1]
    k = key_cache[batch.shared_blocks].flatten(0, 2)  # [tiles * kb * bs, Hkv, D]: each tile's blocks once
    v = value_cache[batch.shared_blocks].flatten(0, 2)
    flat = batch.shared_rows.reshape(-1)
    valid = flat < n
    order = torch.argsort((~valid).to(torch.int8), stable=True)  # real rows first, in tile order
    dest = flat[order]
    counts = valid.view(tiles, r).sum(1)
    cu_q = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
    cu_k = (torch.arange(tiles + 1, device=q.device) * (kb * bs)).to(torch.int32)
    used = batch.shared_hi.amax(1).sum(-1).to(torch.int32)  # visible keys of each tile (a prefix)
    out, lse = FLASH(q[dest.clamp(max=n - 1)], k, v, cu_q, cu_k, r, kb * bs, 0.0,
                                                       False, False, scale=scale, seqused_k=used)[:2]
    lse = lse.t().to(compute_dtype(q.dtype))
    part = Partial(out.to(lse.dtype), lse, torch.ones_like(lse))
    return scatter_merge(part, dest, n)


def install(causal=True, decode=True, shared=False):
    """Route the current core's causal (and unique) paths through flash; returns an undo callable."""
    saved_run, saved_unique = attention._run_paths, attention.unique_partial

    def run_paths(query, key, value, key_cache, value_cache, batch, scale, cap):
        phase = batch.phase
        if causal and cap is None and phase[0] == "c":
            yield fused_causal(query, key, value, batch, scale)
        else:
            yield attention.self_partial(query, key, value, scale, cap)
            if phase[0] == "c":
                yield attention.causal_partial(query, key, value, batch, scale, cap)
        if phase[1] == "s" and shared and cap is None and batch.sliding_window is None:
            yield fused_shared(query, key_cache, value_cache, batch, scale)
        elif phase[1] == "s":
            yield attention.shared_partial(query, key_cache, value_cache, batch, scale, cap)
        if phase[2] == "u":
            if decode and cap is None and batch.sliding_window is None:
                yield fused_unique(query, key_cache, value_cache, batch, scale, cap)
            else:
                yield attention.unique_partial(query, key_cache, value_cache, batch, scale, cap)

    attention._run_paths = run_paths
    return lambda: setattr(attention, "_run_paths", saved_run)
