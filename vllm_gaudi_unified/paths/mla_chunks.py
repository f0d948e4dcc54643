"""MLA's unique pairs in chunks of a token's blocks, every shape from the bucket: the route an HPU graph holds.

The dense decode route (`mla_decode.dense_mla_partial`) lays a step's tokens
out as one `[tokens, keys]` table whose width follows the step, so a graph
captured at warmup would replay the warmup step's table. Here each token's
unique blocks (the unique path's bucket-sized arrays: `unique_rows`,
`unique_blocks`, `unique_lo`/`unique_hi`) are cut into chunks of `C` blocks
(`MLA_CHUNK_KEYS` keys) that never hold two tokens. A token with `c` slots
takes `ceil(c / C)` chunks, so a step has at most `ceil(u / C) + min(n, u)`
of them (u unique slots, n query rows: both the bucket's); the table of
chunks is built on the device by sorts, cumulative sums and gathers of
bucket-shaped tensors, with no host sync and no shape that follows the data.

Per chunk, the latents are gathered once as `[chunks, C * block_size, L + R]`
(the values: their first `L` dims) and attended by all query heads of the
chunk's token in two batched products (`mla_shared.latent_attend`); the chunks
are merged into their tokens (`merge.scatter_merge`) and the token's own pair
is merged in (`causal.self_partial`), so it returns what the other latent
routes return: one Partial row per token, the self pair inside.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.merge import Partial, merge, scatter_merge
from vllm_gaudi_unified.paths.causal import self_partial
from vllm_gaudi_unified.paths.mla_decode import _slot_order
from vllm_gaudi_unified.paths.mla_shared import latent_attend
from vllm_gaudi_unified.paths.tiles import product_dtype

#: Keys a chunk aims at (`C = max(1, MLA_CHUNK_KEYS // block_size)` blocks). Smaller chunks waste fewer keys
#: on the bound's padding (`n` chunks' worth at most), larger ones write fewer partials `[chunks, H, L]` to
#: merge. Measured on an H100 under the Gaudi route (docs/benchmarks.md, MLA, run 7).
MLA_CHUNK_KEYS = 1024


def chunk_blocks(block_size: int) -> int:
    return max(1, MLA_CHUNK_KEYS // block_size)


def num_chunks(slots: int, rows: int, per_chunk: int) -> int:
    """The bound from the bucket: `sum_t ceil(c_t / C) <= ceil(u / C) + (tokens with a slot)`."""
    return -(-slots // per_chunk) + min(rows, slots)


def chunk_layout(batch, n: int, block_size: int, device):
    """-> (keys `[Nc, C * bs]` flat cache slots, visible `[Nc, C * bs]`, token `[Nc]` (n: no token)).

    Slots sorted by token (`_slot_order`, every call: an HPU graph captured after an eager call on the same
    batch would otherwise hold the kept order, not its sort); token t's chunks start at the running sum of
    `ceil(c / C)`; chunk j of token t holds its sorted slots `[j * C, (j + 1) * C)`. An entry past the
    token's slots, or a key outside its slot's visible range, is not visible and reads the chunk's first
    visible key instead (a finite value the token may see, or one it sees anyway), so no unused slot's NaN
    reaches `p @ V`."""
    u = batch.unique_rows.shape[0]
    per_chunk = chunk_blocks(block_size)
    nc = num_chunks(u, n, per_chunk)
    order, starts = _slot_order(batch, n, device, keep=False)  # (an HPU graph's capture is not detectable)
    count = starts[1:] - starts[:-1]  # [n] slots per token
    chunks = (count + per_chunk - 1) // per_chunk
    ends = torch.cumsum(chunks, 0)
    chunk = torch.arange(nc, device=device, dtype=ends.dtype)
    token = torch.searchsorted(ends, chunk, right=True)  # [Nc]; n past the last token's chunks
    t = token.clamp(max=n - 1)
    pos = (chunk - (ends[t] - chunks[t]))[:, None] * per_chunk + torch.arange(per_chunk, device=device)
    live = (token < n)[:, None] & (pos < count[t][:, None])  # [Nc, C]
    slot = order[(starts[t][:, None] + pos).clamp(max=u - 1)]
    blocks = slot if batch.unique_blocks is None else batch.unique_blocks[slot]
    zero = torch.zeros((), dtype=batch.unique_lo.dtype, device=device)
    lo = torch.where(live, batch.unique_lo[slot], zero)[..., None]
    hi = torch.where(live, batch.unique_hi[slot], zero)[..., None]
    within = torch.arange(block_size, device=device)
    visible = ((within >= lo) & (within < hi)).flatten(1)  # [Nc, C * bs]
    keys = (blocks.to(torch.int64)[..., None] * block_size + within).flatten(1)
    first = keys.gather(1, visible.to(torch.int32).argmax(1, keepdim=True))  # (the first visible key)
    return torch.where(visible, keys, first), visible, token


def chunks_mla_partial(q: torch.Tensor, key_cache: torch.Tensor, value_dim: int, batch, scale: float,
                       key: torch.Tensor | None = None) -> Partial | None:
    """The unique pairs of any step, one Partial row per token (module docstring); with `key` (the new
    tokens' latents `[n, 1, L + R]`) each token's own pair merged in too (`attention._run_paths` skips
    the self path beside a latent route)."""
    own = None if key is None else self_partial(q, key, key[..., :value_dim], scale, None)
    if batch.unique_rows.shape[0] == 0:
        return own
    n, hq, d = q.shape
    keys, visible, token = chunk_layout(batch, n, key_cache.shape[1], q.device)
    kv = key_cache.view(-1, d)[keys]  # [Nc, C * bs, L + R]: keys, and values as their first dims
    bias = torch.zeros(visible.shape, dtype=product_dtype(q.dtype), device=q.device)
    bias = bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]
    part = latent_attend(q[token.clamp(max=n - 1)], kv, bias, value_dim, scale)  # [Nc, H, L], [Nc, H]
    part = scatter_merge(part, token, n)
    return part if own is None else merge(part, own)
