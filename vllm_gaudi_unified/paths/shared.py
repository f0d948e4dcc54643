"""Shared path: cache blocks needed by more than one query token.

The planner cut the (token, block) pairs into tiles of `shared_rows` tokens x
`blocks_per_tile` blocks, each tile's blocks used by the same requests, so
every block of a tile is read once for all its tokens (a prefix common to 64
decodes, a chunk over its own context) and the tile's slot intervals say which
slots each token may see.

With CUDA flash (`fused.py`) and a plan whose tiles each see one key prefix
(`StepPlan.shared_prefix_visible`, true for vLLM's steps: only full blocks are
shared), `fused_shared_partial` runs every tile as one flash segment: a tile's
blocks are gathered once for all its rows, its real rows packed together (the
padding rows of a small group cost nothing), and scores stay on the chip. The
tile rows can then be large (a group's rows in one tile: its blocks gathered
once per column chunk, not once per row tile).
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, Scattered, scatter_merge
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.tiles import attend_heads, slot_mask


def shared_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch, scale: float,
                   soft_cap: float | None, k_scale=None, v_scale=None) -> Scattered | None:
    """The tiles' rows unmerged (for `merge.merge_rows`); None when the batch has no shared tile. An fp8
    cache is dequantized per tile, after the gather."""
    if batch.shared_rows.shape[0] == 0:
        return None
    n = q.shape[0]
    tiles, rows_per_tile = batch.shared_rows.shape
    block_size = key_cache.shape[1]
    blocks = batch.shared_blocks
    k = read_blocks(key_cache, blocks, k_scale, q.dtype).flatten(1, 2)  # [tiles, blocks_per_tile * block_size, Hkv, D]
    v = read_blocks(value_cache, blocks, v_scale, q.dtype).flatten(1, 2)
    mask = slot_mask(batch.shared_lo, batch.shared_hi, block_size).flatten(2)  # [tiles, rows, keys]
    tile_attend = attend_heads
    # FusedSDPA with statistics on the same tiles (one head dim: not for MLA's latent)
    if fused.kernel_for(batch, q, soft_cap, value_cache.shape[-1]) == "hpu":
        tile_attend = fused.sdpa_attend
    part = tile_attend(q[batch.shared_rows.clamp(max=n - 1)], k, v, mask, scale, soft_cap)
    index = batch.shared_rows.reshape(-1)
    return Scattered(part, index)


def fused_shared_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch,
                         scale: float, k_scale=None, v_scale=None) -> Partial | None:
    """Each shared tile as one flash segment: its real rows against the first `max_row(hi).sum()` of its
    gathered slots (the plan guarantees they are the ones every real row sees). Rows without a token
    (`n`) are sorted behind the real ones, outside every segment, and dropped by the merge. An fp8
    cache is dequantized after the gather (`read_blocks`), as on the tiles."""
    if batch.shared_rows.shape[0] == 0:
        return None
    n = q.shape[0]
    tiles, rows_per_tile = batch.shared_rows.shape
    keys = batch.shared_blocks.shape[1] * key_cache.shape[1]
    k = read_blocks(key_cache, batch.shared_blocks, k_scale, q.dtype).flatten(0, 2)  # [tiles * keys, Hkv, D]
    v = read_blocks(value_cache, batch.shared_blocks, v_scale, q.dtype).flatten(0, 2)  # (each tile's blocks once)
    rows = batch.shared_rows.reshape(-1)
    real = rows < n
    # Real rows first, tile by tile, padding rows after them: a stable partition by two prefix sums (a sort
    # of these few hundred flags was two kernels of 13 us each on an H100, torch.profiler).
    n_real = torch.cumsum(real, 0)
    place = torch.where(real, n_real - 1, n_real[-1] + torch.arange(rows.shape[0], device=q.device) - n_real)
    dest = torch.empty_like(rows).scatter_(0, place, rows)
    counts = real.view(tiles, rows_per_tile).sum(1)
    cu_q = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
    cu_k = torch.arange(0, (tiles + 1) * keys, keys, device=q.device, dtype=torch.int32)
    used = batch.shared_hi.amax(1).sum(-1).to(torch.int32)
    part = fused.flash_varlen(q[dest.clamp(max=n - 1)], k, v, cu_q, cu_k, rows_per_tile, keys, scale, causal=False,
                              seqused_k=used)
    return scatter_merge(part, dest, n)
