"""Shared path: cache blocks needed by more than one query token.

The planner cut the (token, block) pairs into tiles of `shared_rows` tokens x
`blocks_per_tile` blocks, each tile's blocks used by the same requests, so
every block of a tile is read once for all its tokens (a prefix common to 64
decodes, a chunk over its own context) and the tile's slot intervals say which
slots each token may see.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.tiles import attend, slot_mask
from vllm_gaudi_unified.merge import Partial, scatter_merge


def shared_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch, scale: float,
                   soft_cap: float | None, k_scale=None, v_scale=None) -> Partial | None:
    """None when the batch has no shared tile. An fp8 cache is dequantized per tile, after the gather."""
    if batch.shared_rows.shape[0] == 0:
        return None
    n = q.shape[0]
    tiles, rows_per_tile = batch.shared_rows.shape
    block_size = key_cache.shape[1]
    blocks = batch.shared_blocks
    k = read_blocks(key_cache, blocks, k_scale, q.dtype).flatten(1, 2)  # [tiles, blocks_per_tile * block_size, Hkv, D]
    v = read_blocks(value_cache, blocks, v_scale, q.dtype).flatten(1, 2)
    mask = slot_mask(batch.shared_lo, batch.shared_hi, block_size).flatten(2)  # [tiles, rows, keys]
    part = attend(q[batch.shared_rows.clamp(max=n - 1)], k, v, mask, scale, soft_cap)
    return scatter_merge(part, batch.shared_rows.reshape(-1), n)
