"""Decode steps in a handful of ops: the route of vLLM's CPU platform (`attend_step(dense_decodes=True)`).

Eager torch on a CPU pays per op, not per byte, at decode sizes: the paths
(self + unique tiles + merge) are ~145 aten ops a layer, where vLLM's CPU
attention is one kernel, and a tiny model's decode step was 3.3x vLLM's.
A step of decodes only (one new token per request, no causal or
shared pairs) needs none of the paths' generality: each token sees its
request's unique blocks and itself. So its keys are laid out as one padded
`[requests, keys]` table of cache slots (once per step, on the host:
`decode_layout`), and each layer runs one gather and one
`scaled_dot_product_attention`.

What each layer's ops cost was measured (torch.profiler on one core): the
gather reads K and V in one `index_select` when the caches are two views of one `[.., K | V]`
memory (vLLM's, `packed_kv`): gathering each non-contiguous view alone cost 4-5x more; the
query heads of one KV head are the query rows of one SDPA head (`[R, Hkv, G, D]`), which takes
torch's fused CPU kernel, where `enable_gqa` went through a slower path; the index and the mask
are made once per step, not per layer, and a step whose rows all see the same number of keys
has no mask.

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
    """A step of decodes, and of prompts on the prompt route (the caller runs their rows final), on the
    CPU, without soft cap, sinks or fp8 cache, whose padded key table is small enough (`MAX_PADDING`,
    `MAX_KEYS`). No causal or shared tiles (phase `--`): every other token is one request's only new token."""
    if (query.device.type != "cpu" or cap is not None or sinks is not None or k_scale is not None
            or is_fp8(key_cache.dtype) or batch.pieces or batch.phase[:2] != "--"):
        return False
    return decode_layout(batch) is not None


class DecodeLayout:
    """A decode step's keys as a padded table of flat cache slots (`block * block_size + slot`).

    Row r lists the slots its token sees, then, as padding, its first one again: every slot read is
    one the row may see (finite unless the model wrote a non-finite key there, which then reaches that
    row alone), so no pass zeroes unseen slots. The last column of `visible` is the token itself."""

    def __init__(self, table: torch.Tensor, visible: torch.Tensor, unread_rows: bool, full: bool,
                 tokens: torch.Tensor | None = None):
        self.tokens = tokens  #: [R] the decodes' tokens in the step (None: tokens 0 .. R - 1, a step of decodes)
        self.table = table  #: [R, L] int64 cache slots
        self.visible = visible  #: [R, L + 1] bool
        self.unread_rows = unread_rows  #: some row has no cached key (its padding read another row's slot)
        self.full = full  #: every row sees all L + 1 keys: no mask
        self._index = None  # (self_slots, [R * (L + 1)] or [R * L] index), made by the step's first layer
        self._masks: dict[torch.dtype, torch.Tensor | None] = {}

    def index(self, self_slots: torch.Tensor | None) -> torch.Tensor:
        """The flat gather index of the step (the new tokens' slots last when `self_slots` are given)."""
        if self._index is None or self._index[0] is not self_slots:
            table = self.table
            if self_slots is not None:
                own = self_slots[:len(table)] if self.tokens is None else self_slots[self.tokens]
                table = torch.cat([table, own[:, None]], dim=1)
            self._index = (self_slots, table.reshape(-1))
        return self._index[1]

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive `[R, 1, 1, L + 1]` mask (0 seen, -inf padding), None when every key is seen."""
        if dtype not in self._masks:
            self._masks[dtype] = None if self.full else torch.zeros(self.visible.shape, dtype=dtype).masked_fill_(
                ~self.visible, float("-inf"))[:, None, None, :]
        return self._masks[dtype]


def decode_layout(batch) -> DecodeLayout | None:
    """The batch's `DecodeLayout` from the plan's unique arrays, once per batch; None past the bounds.
    The decodes are the tokens off the prompt route (with phase `--`, each its request's only one)."""
    if batch in _LAYOUTS:
        return _LAYOUTS[batch]
    plan, T, bs = batch.plan, batch.num_tokens, batch.block_size
    tokens = None
    R = T
    if plan.prompt_rows is not None and plan.prompt_rows.size:
        on_route = np.zeros(T + 1, bool)
        on_route[np.minimum(plan.prompt_rows.reshape(-1), T)] = True  # padding rows (no row) land on T
        tokens = np.flatnonzero(~on_route[:T])
        R = tokens.size
    rows = np.asarray(plan.unique_rows)
    live = np.flatnonzero(rows < T)  # slots with a token (not padding, not a dead slot of the slice)
    order = np.argsort(rows[live], kind="stable")
    live = live[order]
    tok = rows[live]
    if tokens is not None:  # token -> its row of the layout
        row_of = np.full(T, R, np.int64)
        row_of[tokens] = np.arange(R)
        tok = row_of[tok]
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
        layout = DecodeLayout(torch.from_numpy(table), torch.from_numpy(visible),
                              bool((per_row == 0).any() and width), full=bool((per_row == width).all()),
                              tokens=None if tokens is None else torch.from_numpy(tokens))
    _LAYOUTS[batch] = layout
    return layout


def packed_kv(key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor | None:
    """`[slots, Hkv, Dk + Dv]` over both caches when they are views of one memory whose slots hold a
    head's key then its value (vLLM's per-layer cache, `backend.split_kv_cache`), else None."""
    dk, dv = key_cache.shape[-1], value_cache.shape[-1]
    ks, vs = key_cache.stride(), value_cache.stride()
    if (key_cache.dtype != value_cache.dtype or ks != vs or key_cache.shape[:3] != value_cache.shape[:3]
            or ks[3] != 1 or ks[2] < dk + dv or ks[0] != ks[1] * key_cache.shape[1]
            or key_cache.untyped_storage().data_ptr() != value_cache.untyped_storage().data_ptr()
            or value_cache.storage_offset() != key_cache.storage_offset() + dk):
        return None
    nb, bs, hkv = key_cache.shape[:3]
    return key_cache.as_strided((nb * bs, hkv, dk + dv), (ks[1], ks[2], 1))


def dense_decodes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, batch, scale: float, self_slots: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Attention of the decodes of a step (`dense_decodes_apply`); `[query rows, Hq, Dv]`, the rows of
    the prompt route and padding rows 0.

    `self_slots`: `[tokens]` flat cache slots where the step's new K/V already are (a server writes
    them before attending): each layer then gathers every key of a decode in one index, instead of
    gathering the cached ones and copying the new ones after them."""
    layout = decode_layout(batch)
    R, L = layout.visible.shape
    rows = query.shape[0]
    hq, dk = query.shape[1:]
    hkv, dv = key.shape[1], value.shape[-1]
    tokens = layout.tokens
    if tokens is not None:  # a step with prompts too: its decodes' rows
        query, key, value = query.index_select(0, tokens), key.index_select(0, tokens), value.index_select(0, tokens)
    index = layout.index(self_slots)
    n = index.numel() // R  # keys gathered per row (L, or L - 1 when the new ones are appended)
    packed = packed_kv(key_cache, value_cache)
    if packed is not None:  # one gather of K | V
        x = packed.index_select(0, index).view(R, n, hkv, dk + dv)
        if self_slots is None:
            x = torch.cat([x, torch.cat([key[:R], value[:R]], dim=-1)[:, None]], dim=1)
        if layout.unread_rows:  # a row with no cached key read some other slot: zero what it may not see
            x = torch.where(layout.visible[:, :, None, None], x, 0.0)
        x = x.transpose(1, 2)  # [R, Hkv, L, Dk + Dv]
        k, v = x[..., :dk], x[..., dk:]
    else:
        kv = []
        for new, cache in ((key, key_cache), (value, value_cache)):
            x = cache.reshape(-1, *cache.shape[2:]).index_select(0, index).view(R, n, *cache.shape[2:])
            if self_slots is None:
                x = torch.cat([x, new[:R, None]], dim=1)
            if layout.unread_rows:
                x = torch.where(layout.visible[:, :, None, None], x, 0.0)
            kv.append(x.transpose(1, 2))  # [R, Hkv, L, D]
        k, v = kv
    q = query[:R].unflatten(1, (hkv, hq // hkv))  # [R, Hkv, G, Dk]: a KV head's query heads are its rows
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask(query.dtype), scale=scale)
    out = out.reshape(R, hq, dv)
    if tokens is not None:
        return out.new_zeros((rows, hq, dv)).index_copy_(0, tokens, out)
    return out if rows == R else F.pad(out, (0, 0, 0, 0, 0, rows - R))
