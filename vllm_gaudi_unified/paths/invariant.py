"""The device run of the batch-invariant mode (`plan/invariant.py` says what and why).

A step's requests on their own calls (`plan.invariant.own_calls`: prompts and
prompt chunks) get their rows final from those calls (`own_rows`), when the
step's form allows (`own_final`). Every other request takes one of two routes,
chosen per step by the step's dtype, soft cap, options and device (never by
the batch): the fast route of `invariant_fast.py` where CUDA flash and the
Triton kernel apply, else the tile route here (torch products: Gaudi, CPU,
fp32, soft cap). Both merge self, cached and causal partials in that order.

Tile route: every product has one shape per tile kind (`tiles_per_call` tiles
per call, the last call padded); each (token, chunk) or (token, key tile) partial is written
to its own slot and the slots are folded by a fixed pairwise tree. A one-row call gathers its
V once its scores are taken and its K freed. A share call (`plan.share_*`: one-row tiles of one
whole chunk) is the one-row call with its K and V a view repeating the chunk, read once: a
row's products have the same operand values and shapes as in its own one-row tile.

Own calls, per request, the default's prompt route at the request's own shapes
(`hpu.sdpa_final`: FusedSDPA on a Gaudi, torch SDPA elsewhere; `fused.sdpa_lse`
with statistics: FusedSDPA's, cuDNN, the CPU's flash): the same call with the
same inputs alone or in any batch, so the same bits; nothing of another
request (nor the bucket's padding) is in it.
"""
from __future__ import annotations

from functools import partial

import torch

from vllm_gaudi_unified.merge import Final, Partial, fold_pairwise, merge_all, normalize
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.causal import self_partial
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.prompts import causal_selects, final_rows, merge_split
from vllm_gaudi_unified.paths.tiles import attend, attend_gathered, compute_dtype, slot_mask
from vllm_gaudi_unified.plan.invariant import tiles_per_call


def invariant_output(q, k, v, key_cache, value_cache, batch, scale: float, soft_cap: float | None,
                     sink: Partial | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """The step's rows `[rows, Hq, Dv]` in q's dtype: the own calls' rows final where `own_final`, every
    other row merged (self, cached, causal, then `sink`: the sinks' partial) and normalised."""
    from vllm_gaudi_unified.paths import mla_invariant

    mla = mla_invariant.applies(batch, q, key_cache, value_cache, soft_cap, sink, k_scale, v_scale)
    own = own_final(batch, q, v.shape[-1], soft_cap, sink)
    out = None
    if not (own and batch.plan.calls_only) and not (mla and mla_invariant.decodes_only(batch)):
        part = invariant_partial(q, k, v, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale, own,
                                 decodes=not mla, final=sink is None)
        out = part.out if isinstance(part, Final) else normalize(
            merge_all([part] + ([] if sink is None else [sink])), q.dtype)
    out = own_rows(q, k, v, key_cache, value_cache, batch, scale, k_scale, v_scale, out) if own else out
    return mla_invariant.decode_rows(q, k, key_cache, v.shape[-1], batch, scale, out) if mla else out


def own_final(batch, q: torch.Tensor, value_dim: int, soft_cap, sink) -> bool:
    """Whether the own calls run (else their requests' pairs take the routes' arrays): the prompt route's
    final form (`prompts.final_rows`: no soft cap, no sinks, fused kernels on), values with the keys'
    head dim, and a fused kernel with statistics (`fused.lse_kernel_for`) where a request has context."""
    plan = batch.plan
    if not plan.calls or sink is not None or value_dim != q.shape[-1] or not final_rows(batch, q, soft_cap, None):
        return False
    return fused.lse_kernel_for(q) or all(ctx == 0 for _, _, ctx, _, _ in plan.calls)


def own_rows(q, k, v, key_cache, value_cache, batch, scale: float, k_scale=None, v_scale=None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """`out` (None: zeros) with the rows of each own-calls request written from its own calls: without
    context one causal fused call (`fused.sdpa_lse`, the split form's new-key call: cuDNN on CUDA,
    FusedSDPA with statistics on a Gaudi, the CPU's flash; `hpu.sdpa_final` where none of those runs);
    with context the split form, its context's keys exactly (gathered in position order, no padding key)
    in one call with statistics, its new keys causal in another, merged by their LSE
    (`prompts.merge_split`). Bad new keys and values: where the calls hide later keys' scores by selection
    (`prompts.causal_selects`: CUDA's 16-bit kernels, the CPU's) through the inputs (`fused.poison_keys`: a
    NaN key, a zero value), so exactly the rows that see one come out NaN (a chunk's through its new-key
    call's LSE) and the rows are copied as they come; elsewhere as on the fast route, the values zeroed and
    the rows at or past one set to NaN (`fused.clean_causal_values`). A real context key is seen by every row."""
    from vllm_gaudi_unified.hpu import sdpa_final

    n, hq = q.shape[:2]
    by_head = lambda x: x.unflatten(1, (k.shape[1], hq // k.shape[1]))  # noqa: E731  [L, Hkv, G, D]
    if out is None:  # a step of prompts: every real row is written below, the padding rows are zeroed
        out = q.new_empty((n, hq, v.shape[-1]))
        out[batch.num_tokens:].zero_()
    select = causal_selects(q)  # bad new keys contained through each call's inputs, else zeroed and rows marked
    if select:  # tested once for the step, poisoned per call (no whole copy of k and v held)
        ok = fused.finite_heads(k, v)
    else:
        v, bad = fused.clean_causal_values(v, batch.token_seg_start, None)
    nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
    heads = lambda x: x.unsqueeze(0).transpose(1, 2)  # noqa: E731  [L, H, D] -> [1, H, L, D], a view
    stats = fused.lse_kernel_for(q)
    for start, length, ctx, first, blocks in batch.plan.calls:
        rows = slice(start, start + length)
        qr, kn, vn = heads(q[rows]), *(heads(x) for x in (fused.poison_keys(k[rows], v[rows], ok[rows]) if select
                                                          else (k[rows], v[rows])))
        if ctx == 0:  # the split form's new-key call alone
            rows_out = fused.sdpa_lse(qr, kn, vn, None, scale, causal=True)[0] if stats else sdpa_final(
                qr, kn, vn, None, scale)
        else:
            ids = batch.call_blocks[first:first + blocks]
            kc, vc = (heads(read_blocks(cache, ids, sc, q.dtype).flatten(0, 1)[:ctx])
                      for cache, sc in ((key_cache, k_scale), (value_cache, v_scale)))
            rows_out = merge_split(*fused.sdpa_lse(qr, kc, vc, None, scale),
                                   *fused.sdpa_lse(qr, kn, vn, None, scale, causal=True))
        if select:
            out[rows] = rows_out[0].transpose(0, 1)
        else:  # written in place: no copy; each KV head's rows marked
            torch.where(bad[rows][:, :, None, None], nan, by_head(rows_out[0].transpose(0, 1)), out=by_head(out[rows]))
    return out


def invariant_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, batch, scale: float, soft_cap: float | None,
                      k_scale=None, v_scale=None, own: bool = False, decodes: bool = True,
                      final: bool = False) -> Partial | Final:
    """All keys of every token, merged in a fixed order: self, cached, causal; `own`: not the pairs of the
    own-calls requests (their rows are `own_rows`'); not `decodes`: not the one-token requests' cached
    tiles (their rows are `mla_invariant.decode_rows`'); `final` (nothing merged after): the fast route
    may give its rows normalized (`Final`, `invariant_fast.fast_partial`)."""
    from vllm_gaudi_unified.paths import invariant_fast

    if invariant_fast.applies(batch, q, key_cache, value_cache, soft_cap):
        return invariant_fast.fast_partial(q, k, v, key_cache, value_cache, batch, scale, k_scale, v_scale, own,
                                           final=final and decodes)
    cached = _cached_partial(q, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale, own, decodes)
    parts = (self_partial(q, k, v, scale, soft_cap, fixed_order=True), cached,
             _causal_partial(q, k, v, batch, scale, soft_cap, own))
    return merge_all([p for p in parts if p is not None])


class _Slots:
    """A `[tokens, width]` array of partials plus one dump slot per row of a call; each real
    (token, slot) is written once, never added to, so no order of writes matters."""

    def __init__(self, q: torch.Tensor, width: int, call_rows: int, value_dim: int):
        tokens, hq, d = *q.shape[:2], value_dim  # the values' head dim (MLA: smaller than the keys')
        dtype, device = compute_dtype(q.dtype), q.device
        self.tokens, self.width, self.call_rows = tokens, width, call_rows
        size = tokens * width + call_rows
        self.acc = torch.zeros((size, hq, d), dtype=dtype, device=device)
        self.max = torch.full((size, hq), float("-inf"), dtype=dtype, device=device)
        self.sum = torch.zeros((size, hq), dtype=dtype, device=device)
        self.dump = tokens * width + torch.arange(call_rows, device=device)

    def write(self, part: Partial, rows: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor) -> None:
        dest = torch.where(valid, rows * self.width + cols, self.dump[:valid.numel()].view(valid.shape)).reshape(-1)
        self.acc.index_copy_(0, dest, part.acc)
        self.max.index_copy_(0, dest, part.max)
        self.sum.index_copy_(0, dest, part.sum)

    def fold(self) -> Partial:
        """Each token's `width` slots merged by the fixed pairwise tree of `merge.fold_pairwise`."""
        n, w = self.tokens, self.width
        return fold_pairwise(Partial(*(x[:n * w].view(n, w, *x.shape[1:]) for x in (self.acc, self.max, self.sum))))


def _chunks(total: int, size: int):
    """(start, stop) of each call; the last may be short and is padded by the caller."""
    return ((c, min(c + size, total)) for c in range(0, total, size))


def _calls(total: int, whole: int, size: int):
    """(start, stop, tiles) of each call of one kind: `size` tiles to `whole`, then tail calls of a quarter."""
    tail = max(1, size // 4)
    return [(a, b, size) for a, b in _chunks(whole, size)] + [(whole + a, whole + b, tail)
                                                               for a, b in _chunks(total - whole, tail)]


def _pad_to(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    if x.shape[0] == n:
        return x
    return torch.cat([x, torch.full((n - x.shape[0],) + x.shape[1:], fill, dtype=x.dtype, device=x.device)])


def _cached_partial(q, key_cache, value_cache, batch, scale, soft_cap, k_scale=None, v_scale=None,
                    own: bool = False, decodes: bool = True) -> Partial | None:
    """One-row tiles (unless not `decodes`), then tiles of `invariant_rows` rows, each chunk written to slot
    [token, chunk]; `own`: not the own-calls requests' tiles (the last ones, whole calls)."""
    pre = slice(0, batch.plan.pre_own_from if own else None)
    kinds = [(batch.dec_rows, batch.dec_blocks, batch.dec_lo, batch.dec_hi, batch.dec_col),
             (batch.unit_rows, batch.unit_blocks, batch.unit_lo, batch.unit_hi, batch.unit_col),
             (batch.pre_rows[pre], batch.pre_blocks[pre], batch.pre_lo[pre], batch.pre_hi[pre], batch.pre_col[pre])]
    kinds = kinds if decodes else kinds[1:]
    if all(kind[0].shape[0] == 0 for kind in kinds) and not (decodes and batch.share_rows.shape[0]):
        return None
    n, opts, bs = q.shape[0], batch.plan.options, key_cache.shape[1]
    per_call = tiles_per_call(opts)
    size = per_call * max([1] + [kind[0].shape[1] for kind in kinds if kind[0].shape[0]])  # dump rows a call
    slots = _Slots(q, batch.plan.cached_width, size, value_cache.shape[-1])
    for kind, (all_rows, all_blocks, all_lo, all_hi, all_cols) in enumerate(kinds):
        stacked = all_rows.shape[1] == 1 or (kind == 1 and _units_stacked(q, all_rows.shape[1], batch))
        dec = kind == 0 and decodes
        whole = batch.plan.dec_whole if dec else all_rows.shape[0]  # one-row tiles of whole chunks, then tail calls
        for start, stop, tiles in _calls(all_rows.shape[0], whole, per_call):
            rows = _pad_to(all_rows[start:stop], tiles, n)  # [tiles, rows]
            blocks = _pad_to(all_blocks[start:stop], tiles, 0)
            mask = slot_mask(_pad_to(all_lo[start:stop], tiles, 0), _pad_to(all_hi[start:stop], tiles, 0),
                             bs).flatten(2)  # [tiles, rows, chunk keys]
            read_k = partial(_gather, key_cache, blocks, k_scale, q.dtype)
            qr = q[rows.clamp(max=n - 1)]
            if stacked:  # V gathered once K is freed, its keys no row sees zeroed (a tile's real rows see the same)
                read_v = partial(_gather, value_cache, blocks, v_scale, q.dtype,  # (whole tiles: nothing to zero)
                                 None if dec and stop <= whole else ~mask.any(1)[:, :, None, None])
                part = attend_gathered(qr, read_k, read_v, mask, scale, soft_cap)
            else:
                part = attend(qr, read_k(), _gather(value_cache, blocks, v_scale, q.dtype), mask, scale, soft_cap)
            cols = _pad_to(all_cols[start:stop], tiles, 0)[:, None].expand_as(rows)
            slots.write(part, rows, cols, rows < n)
    for c in range(batch.share_rows.shape[0] if decodes else 0):  # whole chunks read by many one-token rows
        rows, blocks = batch.share_rows[c][:, None], batch.share_blocks[c:c + 1]  # [tiles, 1], [1, chunk blocks]
        kk, vv = (_gather(cache, blocks, sc, q.dtype) for cache, sc in ((key_cache, k_scale), (value_cache, v_scale)))
        mask = (rows < n)[:, :, None].expand(per_call, 1, kk.shape[1])  # a real row sees every key of its chunk
        part = attend_gathered(q[rows.clamp(max=n - 1)], partial(kk.expand, per_call, -1, -1, -1),
                               partial(vv.expand, per_call, -1, -1, -1), mask, scale, soft_cap)
        slots.write(part, rows, batch.share_col[c][:, None], rows < n)
    return slots.fold()


def _gather(cache, blocks, sc, dtype, unseen=None) -> torch.Tensor:
    """A call's K or V `[tiles, chunk keys, Hkv, D]` (fp8: dequantized after the gather), `unseen` keys zeroed."""
    x = read_blocks(cache, blocks, sc, dtype).flatten(1, 2)
    return x if unseen is None else x.masked_fill_(unseen, 0)


def _units_stacked(q: torch.Tensor, rows: int, batch) -> bool:
    """Whether verify units take the one-row form with their rows stacked (`tiles.attend`'s `stacked`): where
    its scores of every head pair (rows x query heads per key and KV head) take no more bytes than the
    copies of K and V the per-head form makes (head dim per key and KV head each), and every real row of a
    unit sees the same keys (no window). A function of the step's shapes and options alone."""
    return batch.sliding_window is None and rows * q.shape[1] <= q.shape[-1]


def _causal_partial(q, k, v, batch, scale, soft_cap, own: bool = False) -> Partial | None:
    """Causal tiles in calls of `invariant_causal_chunk`, each written to slot [token, key tile]; `own`: not
    the own-calls requests' tiles (the last ones, whole calls)."""
    tiles = batch.plan.causal_own_from if own else batch.causal_q_start.shape[0]
    if tiles == 0:
        return None
    n, opts = q.shape[0], batch.plan.options
    c, size = opts.causal_tile, opts.invariant_causal_chunk
    slots = _Slots(q, batch.plan.causal_width, size * c, v.shape[-1])
    offsets = torch.arange(c, device=q.device)
    seg = batch.token_seg_start
    for start, stop in _chunks(tiles, size):
        q_start = _pad_to(batch.causal_q_start[start:stop], size, n)
        k_start = _pad_to(batch.causal_k_start[start:stop], size, 0)
        cols = _pad_to(batch.causal_col[start:stop], size, 0)
        rows, keys = q_start[:, None] + offsets, k_start[:, None] + offsets  # [size, c]
        rows_in, keys_in = rows.clamp(max=n - 1), keys.clamp(max=n - 1)
        first = seg[q_start.clamp(max=n - 1)][:, None]  # the tile's request starts here
        valid = (rows < n) & (seg[rows_in] == first)  # rows of the tile's own request
        kk, r = keys[:, None, :], rows[:, :, None]
        mask = valid[:, :, None] & (kk >= first[:, :, None]) & (kk < r)
        if batch.sliding_window is not None:
            mask &= r - kk < batch.sliding_window
        part = attend(q[rows_in], k[keys_in], v[keys_in], mask, scale, soft_cap)
        slots.write(part, rows, cols[:, None].expand_as(rows), valid)
    return slots.fold()
