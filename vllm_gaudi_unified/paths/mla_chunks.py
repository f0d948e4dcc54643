"""MLA's unique pairs in chunks of a token's blocks, every shape from the bucket: the route an HPU graph holds.

The dense decode route (`mla_decode.dense_mla_partial`) lays a step's tokens
out as one `[tokens, keys]` table whose width follows the step, so a graph
captured at warmup would replay the warmup step's table. Here each token's
unique blocks (the unique path's bucket-sized arrays: `unique_rows`,
`unique_blocks`, `unique_lo`/`unique_hi`) are cut into chunks of `C` blocks
(`MLA_CHUNK_KEYS` keys) that never hold two tokens. A token with `c` slots
takes `ceil(c / C)` chunks, so a step has at most `(u + min(n, u) (C - 1)) // C`
of them (u unique slots, n query rows: both the bucket's; `num_chunks`); the table of
chunks is built on the device by sorts, cumulative sums and gathers of
bucket-shaped tensors, with no host sync and no shape that follows the data.

Per chunk, the latents are gathered once as `[chunks, C * block_size, L + R]`
(the values: their first `L` dims) and scored by all query heads of the
chunk's token in one batched product (`mla_shared.latent_scores`). The chunks
then share their token's max instead of keeping their own: the chunk maxima
and the token's own score (its own pair is one more key, scored by the same
product) go into a per-token max by `merge.scatter_max` (`[n, H]`, small), so
every chunk's `e^(s - max)` is on its token's scale (`mla_shared.latent_values`,
in place), its values product is written in the product dtype, and one
`index_add` of `[chunks, H, L]` into a fp32 `[n, H, L]` (the own key's weighted
value in it from the start) and one of the row sums `[chunks, H]` give each
token's Partial: no fp32 partial per chunk, no rescale passes, no separate merge
of the self pair. It returns what the other
latent routes return: one Partial row per token, the self pair inside.

In a verify step (`StepPlan.drafts_in_units`) a slot is a request's unit: its
chunk is gathered once and scored by all the request's tokens x heads in one
product (`unique_units * H` rows), and each token's drafts (its request's new
keys up to it, `mla_drafts.draft_scores`) start its max and sums where its own
key does otherwise, so the step has no causal tiles to merge (H200, 128 x (2
over 4k): 5.19 -> 3.84 ms). A unit's slots sit on its first token's row, so at
most one token per request holds a slot: the bound takes the requests
(`num_logits`), not the tokens (3.82 -> 3.32 ms; 1 + 2 tokens 6.03 -> 4.63).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_gaudi_unified.merge import Partial, scatter_max
from vllm_gaudi_unified.paths.causal import self_partial
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.mla_decode import _slot_order
from vllm_gaudi_unified.paths.mla_drafts import draft_scores
from vllm_gaudi_unified.paths.mla_shared import finite_shift, latent_scores, latent_values
from vllm_gaudi_unified.paths.tiles import compute_dtype, product_dtype

#: Keys a chunk aims at (`C = max(1, MLA_CHUNK_KEYS // block_size)` blocks). Smaller chunks waste fewer keys
#: on the bound's padding (`n` chunks' worth at most), larger ones write fewer values products `[chunks, H, L]`
#: to sum. Measured on an H100 under the Gaudi route (`python -m benchmarks.mla_decode --chunk-keys`).
MLA_CHUNK_KEYS = 1024
#: Whether the chunks' mask (0 or -inf per key) and their shift (the token's max per row) enter the scores as
#: products of inner dim 1 (`_add_outer`: `baddbmm_`, one pass in the product's own epilogue) rather than
#: broadcast adds, which take the slow general elementwise kernel over `[chunks, H, keys]` (H200, 128 x 4k:
#: two such adds 0.47 of 2.21 ms).
MLA_CHUNK_RANK1 = True


def chunk_blocks(block_size: int) -> int:
    return max(1, MLA_CHUNK_KEYS // block_size)


def num_chunks(slots: int, rows: int, per_chunk: int) -> int:
    """The bound from the bucket: `sum_t ceil(c_t / C) <= sum_t (c_t + C - 1) / C <= (u + T (C - 1)) / C`,
    T = `min(rows, slots)` tokens with a slot (an integer, so its floor); reached when every token's last
    chunk holds one slot (16 chunks fewer than `ceil(u / C) + T` at 128 decodes x 32 blocks, C = 8)."""
    return (slots + min(rows, slots) * (per_chunk - 1)) // per_chunk


def chunk_layout(batch, n: int, block_size: int, device, heads: int | None = None):
    """-> (keys `[Nc, C * bs]` flat cache slots, visible `[Nc, C * bs]`, token `[Nc]` (n: no token)). `heads`:
    at most so many tokens hold a slot (default n; a verify step's units: one per request, `num_logits`).

    Slots sorted by token (`_slot_order`, every call: an HPU graph captured after an eager call on the same
    batch would otherwise hold the kept order, not its sort); token t's chunks start at the running sum of
    `ceil(c / C)`; chunk j of token t holds its sorted slots `[j * C, (j + 1) * C)`. An entry past the
    token's slots, or a key outside its slot's visible range, is not visible and reads the chunk's first
    visible key instead (a finite value the token may see, or one it sees anyway), so no unused slot's NaN
    reaches `p @ V`."""
    u = batch.unique_rows.shape[0]
    per_chunk = chunk_blocks(block_size)
    nc = num_chunks(u, n if heads is None else heads, per_chunk)
    order, starts, _ = _slot_order(batch, n, device, keep=False)  # (an HPU graph's capture is not detectable)
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
                       key: torch.Tensor | None = None, kv_scale=None, drafts: bool = False) -> Partial | None:
    """The unique pairs of any step, one Partial row per token (module docstring); with `key` (the new tokens'
    latents `[n, 1, L + R]`) each token's own pair too, as one more key of the token (`attention._run_paths`
    skips the self path beside a latent route). `drafts` (a verify step, `StepPlan.drafts_in_units`): each
    slot is a request's unit (`unique_units` tokens), its chunk scored by all its tokens x heads in one product,
    and each token's causal pairs (`mla_drafts.draft_scores`) start its sums where its own key did. An fp8 cache
    is dequantized as gathered, with its one scale `kv_scale` (`kv_quant.read_blocks`: the cast to the product
    dtype it needs anyway, and one multiply)."""
    units = batch.plan.unique_units if drafts else 1
    if batch.unique_rows.shape[0] == 0 and not drafts:
        return None if key is None else self_partial(q, key, key[..., :value_dim], scale, None)
    n, hq, d = q.shape
    dt, op = compute_dtype(q.dtype), product_dtype(q.dtype)
    heads = min(n, batch.plan.bucket.num_logits) if drafts else n  # (a unit's slots: its first token's row)
    keys, visible, token = chunk_layout(batch, n, key_cache.shape[1], q.device, heads)
    rows, real = _unit_rows(batch, token, n, units)  # [Nc, units]: the tokens of each chunk's unit
    kv = read_blocks(key_cache.view(-1, d), keys, kv_scale, op).to(op)  # [Nc, C * bs, L + R]: keys; values their dims
    bias = torch.zeros(visible.shape, dtype=op, device=q.device).masked_fill_(~visible, float("-inf"))
    s = latent_scores(q[rows.clamp(max=n - 1)].flatten(1, 2), kv, None if MLA_CHUNK_RANK1 else bias[:, None, None, :],
                      scale)  # [Nc, units * H, C * bs]
    if MLA_CHUNK_RANK1:
        _add_outer(s, None, bias)
    into = torch.where(real, rows, n).reshape(-1)  # [Nc * units] each row's token (n: none)
    # the token's max over its chunks and its own keys (row n: the padding rows'), the shift of every e^
    start = torch.full((n + 1, hq), float("-inf"), dtype=dt, device=q.device)
    if drafts:
        own, own_keys = draft_scores(q, key, batch, scale, units)  # [n, H, units]
    elif key is not None:
        own = latent_scores(q, key.to(op), None, scale).to(dt)  # [n, H, 1], rounded as the chunks' scores
        own_keys = key[:, None, 0]
    if key is not None:
        start = torch.cat([own.amax(-1), start[n:]])
    top = scatter_max(s.amax(-1).to(dt).view(-1, hq), into, start)  # [n + 1, H] (exact: maxima of product-dtype values)
    shift = finite_shift(top)
    rows_shift = shift[into].view(s.shape[:2])
    if MLA_CHUNK_RANK1:  # s - shift in place: `latent_values` takes the scores as they are
        _add_outer(s, -rows_shift.to(op), None)
        rows_shift = None
    acc, total = latent_values(s, rows_shift, kv, value_dim)  # [Nc, units * H, L], [Nc, units * H]
    if key is None:
        out = torch.zeros((n + 1, hq, value_dim), dtype=dt, device=q.device)
        out_sum = torch.zeros_like(shift)
    else:  # the own keys' weights and values start the token's sums
        w = torch.exp(own - shift[:n, :, None])
        out = F.pad(torch.bmm(w, own_keys[..., :value_dim].to(dt)), (0, 0, 0, 0, 0, 1))
        out_sum = F.pad(w.sum(-1), (0, 0, 0, 1))
    out = out.index_add_(0, into, acc.view(-1, hq, value_dim).to(dt))
    out_sum = out_sum.index_add_(0, into, total.view(-1, hq))
    return Partial(out[:n], top[:n], out_sum[:n])


def _add_outer(s: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None) -> None:
    """`s[b, i, j] += rows[b, i] * cols[b, j]` in place (None: ones), as a product of inner dim 1 (`baddbmm_`)."""
    b, m, k = s.shape
    one = torch.ones((), dtype=s.dtype, device=s.device)
    rows = one.expand(b, m) if rows is None else rows
    cols = one.expand(b, k) if cols is None else cols
    s.baddbmm_(rows[..., None], cols[:, None, :])


def _unit_rows(batch, token: torch.Tensor, n: int, units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows of each chunk (`token`: its slot's row, n for none): the unit's `units` tokens from it
    (`[Nc, units]`), and which are real (below n, of the same request: `token_seg_start`)."""
    rows = token[:, None] + torch.arange(units, device=token.device, dtype=token.dtype)
    if units == 1:
        return rows, rows < n
    seg = batch.token_seg_start[rows.clamp(max=n - 1)]
    return rows, (rows < n) & (seg == token[:, None])
