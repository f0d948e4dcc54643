"""MLA's one-token requests in the batch-invariant mode: the MLA kernels in position-fixed splits.

A latent step's decodes would otherwise take the invariant tile route (one
torch product per chunk, every (token, chunk) partial of `[128, 512]` fp32
written to its own slot and folded by a tree): that costs the default's MLA
kernel many times over in time and memory (docs/batch_invariance.md, Cost;
where the kernel does not run, `mla_invariant_torch.py` takes them).
Here each one-token request's rows come from the default's MLA kernel (on sm_90
FlashMLA's seesaw schedule, `mla_gluon_seesaw.py`, where its shapes allow; else
`mla_kernel.py`), with every quantity that could follow the batch fixed:

* **which tokens**: the one-token requests (`InvariantPlan.one_rows`), a
  property of the request alone; a program takes one token (`TOKENS`), so
  the grid's size never reaches into a program;
* **which keys, in what order**: the token's own slots (`slot_*`: its
  context's blocks, in position order), split `sp` being keys
  `[sp * S, (sp + 1) * S)` of them (`split_size`: `plan.invariant.SPLIT_KEYS`
  over `MLA_SPLITS_PER`, a constant), walked in 64-key tiles from the split's
  start (the seesaw's pairs of tiles counted from there too); split 0 starts
  from the token's own pair (`SELF`); on the seesaw a token of at most
  `MLA_ONE_SPLIT_KEYS` keys is one split (its own length decides). The batch
  sets only how many splits are launched (the longest context's): the extra
  ones see no key;
* **the products**: one program's tile is its token's 64 heads (`BLOCK_H`)
  by 64 keys, whose shapes, warps and stages are compile-time constants of
  the model (heads, latent and rope dims, block size), never of the batch;
  the rows of other tokens are never in a product;
* **the merge**: a token's splits folded one by one in index order
  (`mla_kernel.ordered_combine`: its real splits, then empty ones adding
  exactly 0), or for a one-split token (the seesaw's `ONE_KEYS`) its rows
  normalized by its own program and left alone by the combine: which form a
  token takes follows its own context only.

Why the splits are small: a few long requests must still fill the SMs (4 x 32k
keys are 4 tokens x 2 head groups, 8 programs a split). The other
requests of the step (prompts, chunks, verify steps) keep the invariant mode's
routes (`invariant.invariant_partial` without the one-token requests' tiles),
and these rows are written over theirs.
"""
from __future__ import annotations

from functools import partial

import torch

from vllm_gaudi_unified.paths import mla_decode, mla_invariant_torch
from vllm_gaudi_unified.paths.tiles import compute_dtype
from vllm_gaudi_unified.plan import invariant as plan_invariant

#: Splits of `plan.invariant.SPLIT_KEYS` (8192) a token's keys are cut in: 2048 keys each at MLA's 64-key tiles.
MLA_SPLITS_PER = 4
#: The seesaw kernel on sm_90 where `mla_decode.gluon_applies` (else the Triton kernel).
MLA_INVARIANT_SEESAW = True
#: On the seesaw kernel, a token of at most this many keys is one split whose rows the kernel writes normalized
#: (no fp32 partial, no combine): a function of the token's own context (0: every token in `split_size` splits).
MLA_ONE_SPLIT_KEYS = 4096


def applies(batch, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap, sink,
            k_scale, v_scale) -> bool:
    """A latent step where the default takes the MLA kernel (`mla_decode.mla_unique_route`: CUDA, Triton, a
    16-bit latent cache, no soft cap), with no sinks and no sliding window: conditions on the step's model,
    dtype, device and options, never on its requests."""
    return (sink is None and batch.sliding_window is None
            and mla_decode.mla_unique_route(batch, q, key_cache, value_cache, soft_cap, k_scale, v_scale) == "kernel")


def route(batch, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap, sink, k_scale,
          v_scale):
    """What gives a latent step's one-token rows, `rows(q, key, key_cache, value_dim, batch, scale, out)`: this
    module's `decode_rows` where the MLA kernel runs (`applies`), else where `mla_invariant_torch.applies`
    its `decode_rows` with the cache's one scale; None: neither (the invariant tile route takes them)."""
    if applies(batch, q, key_cache, value_cache, soft_cap, sink, k_scale, v_scale):
        return decode_rows
    if mla_invariant_torch.applies(batch, key_cache, value_cache, soft_cap, sink, k_scale, v_scale):
        return partial(mla_invariant_torch.decode_rows, kv_scale=k_scale)
    return None


def decodes_only(batch) -> bool:
    """Every request of the step has one new token: `decode_rows` gives all its rows."""
    return batch.one_rows.shape[0] == batch.num_tokens


def decode_rows(q: torch.Tensor, key: torch.Tensor, key_cache: torch.Tensor, value_dim: int, batch, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """`out` `[n, H, L]` (None: a new one, the rows past the step's tokens zeroed) with the rows of the
    one-token requests written final from the kernel (module docstring): q `[n, H, L + R]`, the new latents
    `key` `[n, 1, L + R]`, the latent cache as keys `[blocks, block_size, 1, L + R]`."""
    from vllm_gaudi_unified.paths import mla_kernel

    n, hq, d = q.shape
    if out is None:
        out = q.new_empty((n, hq, value_dim))
        out[batch.num_tokens:].zero_()
    out = out if out.is_contiguous() else out.contiguous()  # (the kernels write its rows by offset)
    tokens = batch.one_rows
    if tokens.shape[0] == 0:
        return out
    cache = key_cache[:, :, 0]  # [blocks, block_size, L + R]: one latent head
    split_keys, keys = split_size(), mla_decode.MLA_KEYS
    if split_keys % keys:
        raise ValueError(f"the MLA split {split_keys} keys must be a multiple of MLA_KEYS {keys}")
    bs = cache.shape[1]
    starts = batch.slot_starts  # (from the planner, which sorts the slots by token)
    order = torch.arange(batch.slot_rows.shape[0], device=q.device, dtype=starts.dtype)
    m_rows, dt = tokens.shape[0], compute_dtype(q.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = key[:, 0] if key.stride(-1) == 1 else key[:, 0].contiguous()
    seesaw = MLA_INVARIANT_SEESAW and mla_decode.gluon_applies(q, cache, value_dim) and mla_decode._seesaw(
        d, value_dim)
    one = MLA_ONE_SPLIT_KEYS if seesaw else 0
    most = batch.plan.slot_most * bs  # (the grid's splits: enough for the longest context)
    splits = 1 if most <= one else max(1, -(-most // split_keys))
    combine = splits > 1 or not one  # (else every token's rows come normalized from the kernel)
    acc = torch.empty((m_rows, splits, hq, value_dim) if combine else (1,), dtype=dt, device=q.device)
    m = torch.empty((m_rows, splits, hq), dtype=dt, device=q.device)
    total = torch.empty_like(m)
    consts = mla_decode.kernel_constants(hq, d, value_dim, bs)
    if seesaw:
        from vllm_gaudi_unified.paths import mla_gluon_seesaw

        keep = mla_decode.MLA_GLUON_DESC_CACHE and not torch.cuda.is_current_stream_capturing()
        kn_desc, kr_desc = mla_decode._gluon().cache_descriptors(cache, value_dim, 64, keep, halves=True)
        mla_gluon_seesaw.mla_gluon_seesaw_kernel[(hq // 64, splits, m_rows)](
            q, k, kn_desc, kr_desc, order, starts, batch.slot_blocks, batch.slot_lo, batch.slot_hi, acc, m, total,
            scale, splits, q.stride(0), q.stride(1), k.stride(0), HQ=hq, DV=value_dim, DR=d - value_dim, BS=bs,
            KEYS=64, SLICE=False, SELF=True, REGS=mla_decode.MLA_GLUON_SEESAW_REGS, FINAL=False, seg_ptr=starts,
            UNITS=1, UNIT_ROWS=False, num_warps=4, tok_ptr=tokens, TOKENS=True, SPLIT_KEYS=split_keys, out_ptr=out,
            ONE_KEYS=one)
    else:
        mla_kernel.mla_kernel[(-(-hq // consts["BLOCK_H"]), splits, m_rows)](
            q, k, cache, order, starts, batch.slot_blocks, batch.slot_lo, batch.slot_hi, acc, m, total, scale,
            splits, q.stride(0), q.stride(1), k.stride(0), cache.stride(0), cache.stride(1),
            SLICE=False, SELF=True, FINAL=False, tok_ptr=tokens, TOKENS=True, SPLIT_KEYS=split_keys, seg_ptr=None,
            UNITS=1, UNIT_ROWS=False, **consts)
    if combine:
        mla_kernel.ordered_combine[(m_rows * hq,)](acc, m, total, tokens, out, out, out, splits, hq, DV=value_dim,
                                                   DV_PAD=consts["DV_PAD"], starts_ptr=starts, BS=bs, ONE_KEYS=one,
                                                   TOKENS=True, FINAL=True, EXACT_DIV=False)
    return out


def split_size() -> int:
    """Keys per split: `plan.invariant.SPLIT_KEYS` cut in `MLA_SPLITS_PER` (while whole `MLA_KEYS` tiles),
    a constant of the module, never of the batch."""
    per = max(1, min(MLA_SPLITS_PER, plan_invariant.SPLIT_KEYS // mla_decode.MLA_KEYS))
    return plan_invariant.SPLIT_KEYS // per
