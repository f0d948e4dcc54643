"""Decode steps in a handful of ops: the route of vLLM's CPU platform (`attend_step(dense_decodes=True)`).

Eager torch on a CPU pays per op, not per byte, at decode sizes: the paths
(self + unique tiles + merge) are ~145 aten ops a layer, where vLLM's CPU
attention is one kernel, and a tiny model's decode step was 3.3x vLLM's
(issue 24). A step of decodes only (one new token per request, no causal or
shared pairs) needs none of the paths' generality: each token sees its
request's unique blocks and itself. So its blocks are laid out as one padded
`[requests, blocks]` table (once per step, on the host: `decode_layout`), and
each layer gathers them, appends the new key/value, zeroes what no token may
see (a NaN slot must not reach a probability of 0), and runs one
`scaled_dot_product_attention` with the visibility mask: ~12 aten ops.

Not for graphs or the HPU (shapes follow the step, not the bucket); the
paths stay the product's route and what `unified_attention` runs.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.nn.functional as F

from vllm_gaudi_unified.paths.kv_quant import is_fp8
from vllm_gaudi_unified.plan.arrays import ranges

#: The padded key table may hold at most this many times the step's live keys (ragged contexts) and
#: this many entries, else the paths run (they read whole blocks, but only live ones).
MAX_PADDING = 2.0
MAX_KEYS = 1 << 20

_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # batch -> its layout (one per step)


def dense_decodes_apply(batch, query: torch.Tensor, key_cache: torch.Tensor, cap, sinks, k_scale) -> bool:
    """A step of decodes only, on the CPU, without soft cap, sinks or fp8 cache, whose padded key table
    is small enough (`MAX_PADDING`, `MAX_KEYS`)."""
    if (query.device.type != "cpu" or cap is not None or sinks is not None or k_scale is not None
            or is_fp8(key_cache.dtype) or batch.pieces or batch.phase[:2] != "--"
            or batch.num_tokens != batch.num_requests):
        return False
    return decode_layout(batch) is not None


def decode_layout(batch):
    """(cache slots `[R, L]`, visible `[R, L + 1]`, whether some row has no cached key), from the plan's
    unique arrays, once per batch; None past the bounds. Row r lists the flat cache slots
    (`block * block_size + slot`) its token sees, then, as padding, its first one again: every slot
    read is one the row may see (finite unless the model wrote a non-finite key there, which then
    reaches that row alone), so no pass zeroes unseen slots. The last visible column is the token itself."""
    if batch in _LAYOUTS:
        return _LAYOUTS[batch]
    plan, R, bs = batch.plan, batch.num_requests, batch.block_size
    rows = np.asarray(plan.unique_rows)
    live = np.flatnonzero(rows < R)  # slots with a token (not padding, not a dead slot of the slice)
    order = np.argsort(rows[live], kind="stable")
    live = live[order]
    tok = rows[live]
    ids = live if plan.unique_blocks is None else np.asarray(plan.unique_blocks)[live]
    lo, hi = np.asarray(plan.unique_lo)[live], np.asarray(plan.unique_hi)[live]
    per_row = np.bincount(tok, weights=hi - lo, minlength=R).astype(np.int64)
    width = int(per_row.max()) if tok.size else 0
    total = int(per_row.sum())
    layout = None
    if R * width <= max(MAX_PADDING * total, R) and R * (width + 1) <= MAX_KEYS:
        slots, owner = ranges(ids * bs + lo, hi - lo)  # token-major: entries are sorted by token
        row = tok[owner]
        pos = np.arange(total) - (np.cumsum(per_row) - per_row)[row]
        table = np.zeros((R, width), np.int64)
        table[row, pos] = slots
        seen = np.arange(width) < per_row[:, None]
        if width:
            table = np.where(seen, table, table[:, :1])  # padding: the row's first slot again
        visible = np.ones((R, width + 1), bool)
        visible[:, :-1] = seen
        layout = torch.from_numpy(table), torch.from_numpy(visible), bool((per_row == 0).any() and width)
    _LAYOUTS[batch] = layout
    return layout


def dense_decodes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, batch, scale: float, self_slots: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Attention of a decode step (`dense_decodes_apply`); `[query rows, Hq, D]`, padding rows 0.

    `self_slots`: `[requests]` flat cache slots where the new tokens' K/V already are (a server writes
    them before attending): each layer then gathers every key in one index, instead of gathering the
    cached ones and copying the new ones after them."""
    table, visible, unread_rows = decode_layout(batch)
    R = batch.num_requests
    hq, d = query.shape[1:]
    if self_slots is not None:
        table = torch.cat([table, self_slots[:R, None]], dim=1)
    kv = []
    for new, cache in ((key, key_cache), (value, value_cache)):
        if self_slots is not None:
            x = cache.view(-1, *cache.shape[2:])[table]  # [R, L + 1, Hkv, D]
        elif table.shape[1]:
            x = torch.cat([cache.view(-1, *cache.shape[2:])[table], new[:R, None]], dim=1)
        else:
            x = new[:R, None]
        if unread_rows:  # a row with no cached key read some other slot: zero what it may not see
            x = torch.where(visible[:, :, None, None], x, 0.0)
        kv.append(x.transpose(1, 2))  # [R, Hkv, L + 1, D]
    out = F.scaled_dot_product_attention(query[:R, :, None], kv[0], kv[1], attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=True)  # [R, Hq, 1, D]
    out = out.reshape(R, hq, d)
    return out if query.shape[0] == R else F.pad(out, (0, 0, 0, 0, 0, query.shape[0] - R))
