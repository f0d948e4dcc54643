"""A verify step's unique units on the torch route in chunks of a request's blocks: one product per chunk.

A unit (`PlanOptions.unique_tokens`) is a request's new tokens x the query heads of a KV head, and
`unique.unique_partial` gives it one slot per cache block: a product of the unit's rows against one block
read in place, and a Partial per (block, row) for the merge. Each slot then takes its own copy of the
unit's queries, and writes its own accumulators (`rows x D` per block and KV head, as many bytes as a
quarter of the block's K and V at 8 tokens x 4 heads): passes over more bytes than the cache read itself.

Here a request's blocks are cut into chunks of `C` blocks (`mla_chunks.chunk_slots`: the chunk table built on
the device from the bucket's arrays, no host sync), gathered once into the layout the products take,
`[chunks, Hkv, C * block_size, D]` (V's unseen keys zeroed in that pass, so no NaN of an unused slot reaches
`p @ V`), and each KV head's rows meet the `C` blocks in one product: `C` times fewer query copies and
partials to merge, for one more pass over the blocks (the gather). The chunks' Partials merge into their
tokens as the slots' do; the requests' own new keys stay with `unique.request_pairs`.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.hpu import masked_softmax_for
from vllm_gaudi_unified.merge import Partial, merge, scatter_merge
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.mla_chunks import _unit_rows, chunk_slots
from vllm_gaudi_unified.paths.tiles import compute_dtype, product_dtype
from vllm_gaudi_unified.paths.unique import DROP_ROWS, request_pairs, unique_partial

#: Keys a chunk aims at (`C = max(1, UNIT_CHUNK_KEYS // block_size)` blocks); 0: units read one block per slot.
UNIT_CHUNK_KEYS = 512
#: Rows per KV head (the unit's tokens x query heads per KV head) from which the units take the chunks.
UNIT_CHUNK_MIN_ROWS = 16
KEYS_FIRST = False


def unit_chunks_apply(q: torch.Tensor, key_cache: torch.Tensor, batch) -> bool:
    """A static fact of the bucket and the heads (a bucket's graph is fixed): units of many rows per KV head."""
    rows = batch.plan.unique_units * (q.shape[1] // key_cache.shape[2])
    return UNIT_CHUNK_KEYS > 0 and batch.plan.unique_units > 1 and rows >= UNIT_CHUNK_MIN_ROWS


def tiles_unique_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch, scale: float,
                         soft_cap: float | None, k_scale=None, v_scale=None,
                         new: tuple[torch.Tensor, torch.Tensor] | None = None) -> Partial | None:
    """The unique path on the matmul tiles (`unique.unique_partial`'s contract): units of many rows per KV head
    (`unit_chunks_apply`) in chunks, the others one block per slot."""
    if not unit_chunks_apply(q, key_cache, batch):
        return unique_partial(q, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale, new=new)
    if batch.unique_rows.shape[0] == 0:
        return None
    out = chunked_units_partial(q, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale)
    return out if new is None else merge(out, request_pairs(q, *new, batch, scale, soft_cap))


def chunked_units_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch, scale: float,
                          soft_cap: float | None, k_scale=None, v_scale=None) -> Partial:
    """The units' cached pairs as one Partial row per token (module docstring); rows without a token (ragged
    drafts' padding, chunks without a request) go to `unique.DROP_ROWS` dropped rows, spread."""
    n, hq, d = q.shape
    _, bs, hkv, _ = key_cache.shape
    g, u = hq // hkv, batch.plan.unique_units
    per = max(1, UNIT_CHUNK_KEYS // bs)
    blocks, lo, hi, token = chunk_slots(batch, n, per, q.device, min(n, batch.plan.bucket.num_logits))
    nc, keys = blocks.shape[0], per * bs
    within = torch.arange(bs, device=q.device)
    visible = ((within >= lo[..., None]) & (within < hi[..., None])).view(nc, 1, keys)  # [Nc, 1, C * bs]
    op, dt = product_dtype(q.dtype), compute_dtype(q.dtype)
    as_heads = lambda x: x.to(op).permute(0, 3, 1, 2, 4).reshape(nc, hkv, keys, -1)  # noqa: E731  [Nc, Hkv, C*bs, D]
    k = as_heads(read_blocks(key_cache, blocks, k_scale, q.dtype))
    v = torch.where(visible[..., None], as_heads(read_blocks(value_cache, blocks, v_scale, q.dtype)), 0.0)
    rows, real = _unit_rows(batch, token, n, u)  # [Nc, u]: each chunk's request's tokens
    qh = q[rows.clamp(max=n - 1)].to(op).view(nc, u, hkv, g, d).transpose(1, 2).reshape(nc, hkv, u * g, d)
    if KEYS_FIRST:  # scores [Nc, Hkv, C * bs, u * g]: K as gathered is the product's first operand
        s = torch.matmul(k, qh.transpose(2, 3)).to(dt) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        s = s.masked_fill(~visible[..., None], float("-inf"))
        m = s.amax(-2)
        p = torch.exp(s - torch.where(m > float("-inf"), m, 0.0)[:, :, None, :])
        total = p.sum(-2)
        acc = torch.matmul(p.to(op).transpose(2, 3), v).to(dt)
    else:
        s = torch.matmul(qh, k.transpose(2, 3)).to(dt) * scale  # [Nc, Hkv, u * g, C * bs]
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        s = s.masked_fill(~visible[:, :, None], float("-inf"))
        p, m, total = masked_softmax_for(s)(s)
        acc = torch.matmul(p.to(op), v).to(dt)  # [Nc, Hkv, u * g, Dv]
    as_rows = lambda x: x.view(nc, hkv, u, g, *x.shape[3:]).transpose(1, 2).flatten(0, 1).flatten(1, 2)  # noqa: E731
    drop = n + torch.arange(nc * u, device=q.device) % DROP_ROWS
    index = torch.where(real.reshape(-1), rows.reshape(-1), drop)
    return Partial(*(x[:n] for x in scatter_merge(Partial(as_rows(acc), as_rows(m), as_rows(total)), index,
                                                  n + DROP_ROWS - 1)))
