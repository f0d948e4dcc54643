"""MLA's one-token requests in the batch-invariant mode: the Triton MLA kernel in position-fixed splits.

A latent step's decodes would otherwise take the invariant tile route (one
torch product per chunk, every (token, chunk) partial of `[128, 512]` fp32
written to its own slot and folded by a tree): that costs the default's MLA
kernel many times over in time and memory (docs/batch_invariance.md, Cost).
Here each one-token request's rows come final from `mla_kernel.py`, which the
default runs too, with every quantity that could follow the batch fixed:

* **which tokens**: the one-token requests (`InvariantPlan.one_rows`), a
  property of the request alone; a program takes one token (`TOKENS`), so
  the grid's size never reaches into a program;
* **which keys, in what order**: the token's own slots (`slot_*`: its
  context's blocks, in position order), split `sp` being keys
  `[sp * SPLIT_KEYS, (sp + 1) * SPLIT_KEYS)` of them (`plan.invariant.SPLIT_KEYS`,
  a constant), walked in `MLA_KEYS` tiles from the split's start; split 0
  starts from the token's own pair (`SELF`). The batch sets only how many
  splits are launched (`slot_splits`, the longest context's): the extra
  ones see no key;
* **the products**: one program's tile is its token's `BLOCK_H` heads by
  `MLA_KEYS` keys, whose shapes, warps and stages are compile-time constants
  of the model (heads, latent and rope dims, block size), never of the batch;
  the rows of other tokens are never in a product;
* **the merge**: a token's splits folded one by one in index order
  (`mla_kernel.ordered_combine`: its real splits, then empty ones adding
  exactly 0), or, with one split for the whole step, normalized in the kernel
  (`FINAL`), which gives the same bits (the weight of a lone split is exp(0)
  = 1).

On sm_90 the default takes FlashMLA's seesaw schedule (`mla_gluon_seesaw.py`)
where its shapes allow; this mode keeps the Triton kernel there too. The other
requests of the step (prompts, chunks, verify steps) keep the invariant mode's
routes (`invariant.invariant_partial` without the one-token requests' tiles),
and these rows are written over theirs.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.paths import mla_decode
from vllm_gaudi_unified.paths.tiles import compute_dtype
from vllm_gaudi_unified.plan import invariant as plan_invariant


def applies(batch, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, soft_cap, sink,
            k_scale, v_scale) -> bool:
    """A latent step where the default takes the MLA kernel (`mla_decode.mla_unique_route`: CUDA, Triton, a
    16-bit latent cache, no soft cap), with no sinks and no sliding window: conditions on the step's model,
    dtype, device and options, never on its requests."""
    return (sink is None and batch.sliding_window is None
            and mla_decode.mla_unique_route(batch, q, key_cache, value_cache, soft_cap, k_scale, v_scale) == "kernel")


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
    split_keys, keys = plan_invariant.SPLIT_KEYS, mla_decode.MLA_KEYS
    if split_keys % keys:
        raise ValueError(f"plan.invariant.SPLIT_KEYS {split_keys} must be a multiple of MLA_KEYS {keys}")
    cache = key_cache[:, :, 0]  # [blocks, block_size, L + R]: one latent head
    bs = cache.shape[1]
    rows = batch.slot_rows
    starts = torch.searchsorted(rows, torch.arange(n + 1, device=q.device, dtype=rows.dtype))
    order = torch.arange(rows.shape[0], device=q.device, dtype=rows.dtype)  # (sorted by the planner)
    splits, m_rows, dt = batch.plan.slot_splits, tokens.shape[0], compute_dtype(q.dtype)
    final = splits == 1
    acc = out if final else torch.empty((m_rows, splits, hq, value_dim), dtype=dt, device=q.device)
    m = torch.empty((m_rows, splits, hq), dtype=dt, device=q.device)
    total = torch.empty_like(m)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = key[:, 0] if key.stride(-1) == 1 else key[:, 0].contiguous()
    consts = mla_decode.kernel_constants(hq, d, value_dim, bs)
    mla_kernel.mla_kernel[(-(-hq // consts["BLOCK_H"]), splits, m_rows)](
        q, k, cache, order, starts, batch.slot_blocks, batch.slot_lo, batch.slot_hi, acc, m, total, scale, splits,
        q.stride(0), q.stride(1), k.stride(0), cache.stride(0), cache.stride(1),
        SLICE=False, SELF=True, FINAL=final, tok_ptr=tokens, TOKENS=True, SPLIT_KEYS=split_keys, **consts)
    if not final:
        mla_kernel.ordered_combine[(m_rows * hq,)](acc, m, total, tokens, out, splits, hq, DV=value_dim,
                                                   DV_PAD=consts["DV_PAD"])
    return out
