"""Unique path: cache blocks needed by exactly one query token (the usual decode).

Computed per block, not per token: block slot `b` holds one block and the one
token that sees it, the scores of all blocks come from one batched product, and
the per-block partials are merged back into their tokens. The blocks are either
the contiguous cache slice `[0, num_unique_blocks)` read in place (no gather:
good when most of the slice is live) or the live blocks gathered by id (good
when block ids are scattered over a large cache); the planner picks per step.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, scatter_merge
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.tiles import attend, slot_mask


def unique_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch, scale: float,
                   soft_cap: float | None) -> Partial | None:
    """None when the batch has no unique block."""
    slots = batch.unique_rows.shape[0]
    if slots == 0:
        return None
    n = q.shape[0]
    if batch.unique_blocks is None:
        k, v = key_cache[:slots], value_cache[:slots]  # views: the slice is read in place
    else:
        k, v = key_cache[batch.unique_blocks], value_cache[batch.unique_blocks]
    block_size = key_cache.shape[1]
    mask = slot_mask(batch.unique_lo, batch.unique_hi, block_size)[:, None, :]  # [slots, 1, block_size]
    rows = batch.unique_rows
    part = attend(q[rows.clamp(max=n - 1)][:, None], k, v, mask, scale, soft_cap,
                  masked_tiles=_partial_slots(batch, n, block_size))
    return scatter_merge(part, rows, n)


def fused_unique_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch,
                         scale: float) -> Partial | None:
    """`unique_partial` through flash, one segment per block (`fused.flash_blocks`), K and V read by one
    kernel. Flash sees every slot of a block; the few slots a row sees only part of (`_partial_slots`)
    are computed again on the masked tiles and replace flash's rows before the merge."""
    slots = batch.unique_rows.shape[0]
    if slots == 0:
        return None
    n = q.shape[0]
    if batch.unique_blocks is None:
        k, v = key_cache[:slots], value_cache[:slots]
    else:
        k, v = key_cache[batch.unique_blocks], value_cache[batch.unique_blocks]
    rows = batch.unique_rows
    qr = q[rows.clamp(max=n - 1)]
    part = fused.flash_blocks(qr, k, v, scale)
    bs = key_cache.shape[1]
    sel = _partial_slots(batch, n, bs)
    mask = slot_mask(batch.unique_lo[sel], batch.unique_hi[sel], bs)[:, None, :]
    fix = attend(qr[sel][:, None], k[sel], v[sel], mask, scale, None)
    part = Partial(*(x.index_copy(0, sel, y.to(x.dtype)) for x, y in zip(part, fix)))
    return scatter_merge(part, rows, n)


def fused_unique_applies(batch, key_cache: torch.Tensor) -> bool:
    """Flash per block pays off from `FUSED_UNIQUE_MIN_BLOCK_SIZE` (measured), fits the launch grid, and
    has no sliding window (its first visible block would need a second masked slot per request)."""
    return (key_cache.shape[1] >= fused.FUSED_UNIQUE_MIN_BLOCK_SIZE and batch.sliding_window is None
            and batch.unique_rows.shape[0] <= fused.MAX_FLASH_BATCH)


def _partial_slots(batch, n: int, block_size: int) -> torch.Tensor:
    """Indices of every slot with a real row that sees only part of its block, padded with other slots.

    A request's unique blocks are full but its last context block (`hi < block_size`) and, with a
    sliding window, its first visible one (`lo > 0`): at most 2 per request, so a fixed count per
    bucket (`num_logits` >= requests) covers them; the rest of the count is filled with other slots,
    which masking leaves unchanged. Slots without a row (padding, dead slots of the slice) are dropped
    by the merge and need no mask."""
    slots = batch.unique_rows.shape[0]
    per_request = 1 if batch.sliding_window is None else 2
    count = min(slots, per_request * batch.bucket.num_logits)
    partial = (batch.unique_rows < n) & ((batch.unique_lo > 0) | (batch.unique_hi < block_size))
    return torch.topk(partial.to(torch.int32), count, sorted=False).indices
