"""MLA's shared pairs in latent space: each shared tile as one product of all its rows' heads against its latents.

In latent space every query head attends to the same latent (one KV head,
`mla.latent_views`), so the rows of a shared tile (tokens whose requests share
its blocks: 64 decodes over one prefix) times their heads are one matrix of
queries, `[rows * heads, L + R] @ [L + R, keys]`, then `p @ latent[:, :L]`
(the values a view of the keys): rows then heads, as the query is stored, so
nothing is transposed, and the tile's latents are gathered once for all its
rows (a prefix is read once per row chunk of its group: `plan/shared.py`). The
generic tiles computed the same pairs with the heads permuted in front of the
rows and more passes over fp32 scores (slower on an H100: `python -m benchmarks.mla_decode`,
column `cuda_generic_shared`).

`latent_attend` is the product the torch latent routes share (this one and the
dense decode route of `mla_decode.py`; the chunks of `mla_chunks.py` run its
two halves, `latent_scores` and `latent_values`, with their token's max between
them), written for few passes over the scores: the scale goes into the first product (`baddbmm_` into an empty
buffer, beta 0), the mask is one in-place add of a bias (none when every row
sees every key), the max is exact in bf16, and `e^(s - max)` is taken in place
in bf16 and summed in fp32, so `sum` and `acc` see the same rounded
probabilities (`LATENT_SOFTMAX`). Plain torch ops: the Gaudi route and the CPU
run it, with no host sync (its shapes are the bucket's).
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, scatter_merge
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.kv_quant import one_tensor_scale, read_blocks
from vllm_gaudi_unified.paths.tiles import compute_dtype, product_dtype, slot_mask


#: Where `latent_attend` takes e^(s - max) of 16-bit inputs: 'product' (bf16, in place: two passes fewer
#: over the scores) or 'compute' (fp32, rounded once for `p @ V`, as the generic tiles do). Measured on an
#: H100 (`python -m benchmarks.mla_decode`, column `gaudi_product_softmax`): the same error both ways (the scores' own bf16 rounding dominates),
#: 'product' 15-35% faster.
LATENT_SOFTMAX = "product"


def latent_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Values are the first dims of the keys in the same memory, one KV head (`mla.latent_views`)."""
    return (key_cache.dim() == 4 and key_cache.shape[2] == 1 and value_cache.shape[-1] < key_cache.shape[-1]
            and value_cache.data_ptr() == key_cache.data_ptr() and value_cache.stride() == key_cache.stride()
            and key_cache.stride(-1) == 1)


def mla_shared_applies(batch, key_cache: torch.Tensor, value_cache: torch.Tensor, cap, k_scale, v_scale) -> bool:
    """A latent cache (`latent_cache`), no soft cap, at most one per-tensor scale (`kv_quant.one_tensor_scale`:
    an fp8 cache is dequantized as gathered), some shared tile."""
    return (cap is None and one_tensor_scale(k_scale, v_scale) and batch.shared_rows.shape[0] > 0
            and latent_cache(key_cache, value_cache))


def latent_scores(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`scale * q @ kv^T` `[B, M, K]` in q's product dtype, `bias` (`latent_attend`) added in place."""
    op = product_dtype(q.dtype)
    b, mrows, _ = q.shape
    kv = kv.to(op)
    # scale * q.k straight out of the product (beta 0: the buffer is not read), then the mask in place
    s = torch.empty((b, mrows, kv.shape[1]), dtype=op, device=q.device).baddbmm_(
        q.to(op), kv.transpose(1, 2), beta=0.0, alpha=scale)
    if bias is not None:
        s.view(b, bias.shape[1], -1, kv.shape[1]).add_(bias)
    return s


def latent_values(s: torch.Tensor, shift: torch.Tensor | None, kv: torch.Tensor, value_dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores `[B, M, K]` (`latent_scores`, overwritten) against `shift` `[B, M]` (the compute dtype, finite;
    None: `s` holds `s - shift` already) -> (`sum_k e^(s - shift) v_k` `[B, M, value_dim]` in the product dtype,
    `sum_k e^(s - shift)` `[B, M]` in the compute dtype): both over the same rounded probabilities
    (`LATENT_SOFTMAX`)."""
    op, dt = s.dtype, compute_dtype(s.dtype)
    if shift is not None:
        shift = shift[..., None]
    if LATENT_SOFTMAX == "product" or op == dt:  # in place, in the product dtype: two passes fewer
        p = (s if shift is None else s.sub_(shift.to(op))).exp_()
        total = p.sum(-1, dtype=dt)
    else:  # e^(s - shift) in the compute dtype, rounded once for `p @ V` (the generic tiles' numerics)
        p = (s.to(dt) if shift is None else torch.sub(s, shift)).exp_()
        total = p.sum(-1)
        p = p.to(op)
    return torch.bmm(p, kv.to(op)[..., :value_dim]), total  # (bmm: matmul copied the strided values first)


def finite_shift(m: torch.Tensor) -> torch.Tensor:
    """A max as the shift of `e^(s - shift)`: 0 where it is -inf (no key seen: every e^ is 0 anyway)."""
    return torch.where(m == float("-inf"), torch.zeros((), dtype=m.dtype, device=m.device), m)


def latent_attend(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor | None, value_dim: int, scale: float
                  ) -> Partial:
    """q `[B, M, D]` (M = rows x heads, row-major), latents `[B, K, D]` (values: the first `value_dim` dims),
    `bias` None (every row sees every key) or `[B, rows, 1, K]` in q's product dtype (0 visible, -inf not,
    NaN: a bad value the row sees), added to all heads of its row -> Partial `[B, M, value_dim]`, `[B, M]` in
    the compute dtype. The latents must hold no non-finite value a row may not see (`p = 0` times NaN is
    NaN): the callers zero those."""
    kv = kv.to(product_dtype(q.dtype))  # (once: the two products' operand)
    s = latent_scores(q, kv, bias, scale)
    m = s.amax(-1).to(compute_dtype(q.dtype))  # (exact: a max of the product dtype's values)
    acc, total = latent_values(s, finite_shift(m), kv, value_dim)
    return Partial(acc.to(m.dtype), m, total)


def latent_shared_partial(q: torch.Tensor, key_cache: torch.Tensor, value_dim: int, batch, scale: float,
                          kv_scale=None) -> Partial | None:
    """The shared tiles of a latent step (`key_cache` `[blocks, block_size, 1, L + R]`): per tile, its
    rows' heads against its gathered latents, merged into the tokens by `scatter_merge`. A latent no
    row of its tile may see, or one that is not finite, is zeroed; the rows that may see a non-finite
    one get NaN scores (they alone carry it, as on the generic tiles). An fp8 cache is dequantized as
    gathered, with its one scale `kv_scale`."""
    if batch.shared_rows.shape[0] == 0:
        return None
    n, hq, d = q.shape
    tiles, rows = batch.shared_rows.shape
    bs = key_cache.shape[1]
    kv = read_blocks(key_cache, batch.shared_blocks, kv_scale, q.dtype).reshape(tiles, -1, d)  # each tile's blocks
    visible = slot_mask(batch.shared_lo, batch.shared_hi, bs).flatten(2)  # [tiles, rows, K]
    finite = fused.finite_rows(kv)  # [tiles, K]
    zero = torch.zeros((), dtype=kv.dtype, device=kv.device)
    kv = torch.where((finite & visible.any(1))[..., None], kv, zero)
    bias = torch.zeros(visible.shape, dtype=product_dtype(q.dtype), device=q.device)
    bias = bias.masked_fill_(~visible, float("-inf")).masked_fill_(visible & ~finite[:, None, :], float("nan"))
    qt = q[batch.shared_rows.clamp(max=n - 1)].reshape(tiles, rows * hq, d)  # rows then heads: no transpose
    acc, m, total = latent_attend(qt, kv, bias[:, :, None, :], value_dim, scale)
    part = Partial(acc.view(tiles * rows, hq, value_dim), m.view(-1, hq), total.view(-1, hq))
    return scatter_merge(part, batch.shared_rows.reshape(-1), n)
