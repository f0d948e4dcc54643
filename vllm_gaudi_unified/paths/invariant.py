"""The device run of the batch-invariant mode (`plan/invariant.py` says what and why).

A step's requests on their own calls (`plan.invariant.own_calls`: prompts and prompt chunks) get their rows
final from those calls (`own_rows`), when the step's form allows (`own_final`). Every other request takes one of
two routes, chosen per step by the step's dtype, soft cap, options and device (never by the batch): the fast
route of `invariant_fast.py` where CUDA flash and the Triton kernel apply, else the tile route here (torch
products: Gaudi, CPU, fp32, soft cap). Both merge self, cached and causal partials in that order.

Tile route: every product has one shape per tile kind (`tiles_per_call` tiles
per call, the last call padded); each (token, chunk) or (token, key tile) partial is written to its own
slot; a token's slots are scaled to its max over them and added by a fixed pairwise tree. One-row tiles
(`_one_row_group`) run their products per call, at one shape, and every other pass over a group of calls'
real rows at once (elementwise, a max, the sum over keys by a fixed pairwise tree): a row's bits are its
own call's. A share call (`plan.share_*`: one-row tiles of one whole chunk) is the one-row call with its K
and V a view repeating the chunk, read once: a row's products have the same operand values and shapes as in
its own one-row tile.

Own calls, per request, the default's prompt route at the request's own shapes (`hpu.sdpa_final`: FusedSDPA on a
Gaudi, torch SDPA elsewhere; `fused.sdpa_lse` with statistics: FusedSDPA's, cuDNN, the CPU's flash): the same
call with the same inputs alone or in any batch, so the same bits; nothing of another request (nor the bucket's
padding) is in it.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from vllm_gaudi_unified.merge import Final, Partial, merge_all, normalize, rescale_weights, rescaled
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.causal import self_partial, tree_sum
from vllm_gaudi_unified.paths.kv_quant import read_blocks
from vllm_gaudi_unified.paths.prompts import causal_selects, final_rows, merge_split
from vllm_gaudi_unified.paths.tiles import (attend, attend_gathered, compute_dtype, product_dtype, score_product,
                                            slot_mask)
from vllm_gaudi_unified.plan.invariant import tiles_per_call

#: One-row tiles taken together (`_one_row_tiles`, whole calls): their scores are held at once.
GROUP_TILES = 1024


def invariant_output(q, k, v, key_cache, value_cache, batch, scale: float, soft_cap: float | None,
                     sink: Partial | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """The step's rows `[rows, Hq, Dv]` in q's dtype: the own calls' rows final where `own_final`, every
    other row merged (self, cached, causal, then `sink`: the sinks' partial) and normalised."""
    from vllm_gaudi_unified.paths import mla_invariant

    mla = mla_invariant.route(batch, q, key_cache, value_cache, soft_cap, sink, k_scale, v_scale)
    own = own_final(batch, q, v.shape[-1], soft_cap, sink)
    out = None
    if not (own and batch.plan.calls_only) and not (mla is not None and mla_invariant.decodes_only(batch)):
        part = invariant_partial(q, k, v, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale, own,
                                 decodes=mla is None, final=sink is None)
        out = part.out if isinstance(part, Final) else normalize(
            merge_all([part] + ([] if sink is None else [sink])), q.dtype)
    out = own_rows(q, k, v, key_cache, value_cache, batch, scale, k_scale, v_scale, out) if own else out
    return out if mla is None else mla(q, k, key_cache, v.shape[-1], batch, scale, out)


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
    tiles (their rows are `mla_invariant.route`'s); `final` (nothing merged after): the fast route
    may give its rows normalized (`Final`, `invariant_fast.fast_partial`)."""
    from vllm_gaudi_unified.paths import invariant_fast

    if invariant_fast.applies(batch, q, key_cache, value_cache, soft_cap):
        return invariant_fast.fast_partial(q, k, v, key_cache, value_cache, batch, scale, k_scale, v_scale, own,
                                           final=final and decodes)
    own_pair = self_partial(q, k, v, scale, soft_cap, fixed_order=True)
    cached = _cached_partial(q, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale, own, decodes,
                             own_pair)
    parts = (own_pair if cached is None else cached, _causal_partial(q, k, v, batch, scale, soft_cap, own))
    return merge_all([p for p in parts if p is not None])


class _Slots:
    """A `[width, tokens]` array of partials (slot-major: a slot's tokens contiguous, so the fold's halves are
    too) plus one dump slot, where every padding row of a call goes (its bits unread); each real (token,
    slot) is written once, never added to, so no order of writes matters. `first`: a partial per token in
    slot 0 (the self pair), the written ones from slot 1 on (`width` counts slot 0). Made at the first write
    (or fold): a one-row group's buffers are freed by then, so the two are not held together."""

    def __init__(self, q: torch.Tensor, width: int, value_dim: int, first: Partial | None = None):
        self.tokens, self.width, self.offset, self.first = q.shape[0], width, int(first is not None), first
        self.like, self.dims, self.arrays = q, (q.shape[1], value_dim), None  # (MLA: values narrower than keys)

    def made(self) -> tuple:  # (acc, max, sum) `[tokens x width + 1, Hq, ...]`, in the compute dtype
        if self.arrays is None:
            size, (hq, d), like = self.tokens * self.width + 1, self.dims, dict(
                dtype=compute_dtype(self.like.dtype), device=self.like.device)
            self.arrays = (torch.zeros((size, hq, d), **like), torch.full((size, hq), float("-inf"), **like),
                           torch.zeros((size, hq), **like))
            for x, y in zip(self.arrays, self.first or ()):
                x[:self.tokens] = y
        return self.arrays

    def write(self, part: Partial, rows: torch.Tensor, cols: torch.Tensor, valid: torch.Tensor) -> None:
        dest = torch.where(valid, (cols + self.offset if self.offset else cols) * self.tokens + rows,
                           self.tokens * self.width).reshape(-1)
        for x, y in zip(self.made(), part):
            x.index_copy_(0, dest, y)

    def fold(self) -> Partial:
        """Each token's `width` slots merged in one fixed order: each scaled once to the token's max over its
        slots (`merge.rescale_weights`, `merge.rescaled`), then added by a fixed pairwise tree over the slots
        (`causal.tree_sum`; an empty slot adds an exact 0, so a wider step changes nothing). `merge.fold_pairwise`'s
        value in a third of its passes: those rescale at every level of the tree."""
        n, w = self.tokens, self.width
        acc, m, total = (x[:n * w].view(w, n, *x.shape[1:]) for x in self.made())
        top = m.amax(0)
        seen, weight = rescale_weights(m, top)
        acc, total = (tree_sum(rescaled(x, seen, weight), dim=0) for x in (acc, total))
        return Partial(acc, top, total)


def _chunks(total: int, size: int):
    """(start, stop) of each call; the last may be short and is padded by the caller."""
    return ((c, min(c + size, total)) for c in range(0, total, size))


def _pad_to(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    return x if x.shape[0] == n else torch.cat([x, torch.full((n - x.shape[0],) + x.shape[1:], fill, dtype=x.dtype,
                                                              device=x.device)])


def _cached_partial(q, key_cache, value_cache, batch, scale, soft_cap, k_scale=None, v_scale=None,
                    own: bool = False, decodes: bool = True, own_pair: Partial | None = None) -> Partial | None:
    """One-row tiles (unless not `decodes`: `_one_row_tiles`), then verify units' tiles and tiles of
    `invariant_rows` rows, each chunk written to slot [token, chunk]; `own_pair` (the self pair): in slot 0,
    chunk c in slot c + 1 (a token with no chunk gets its values back: scaled by 1, zeros added); `own`: not
    the own-calls requests' tiles (the last ones, whole calls)."""
    pre = slice(0, batch.plan.pre_own_from if own else None)
    kinds = [(batch.unit_rows, batch.unit_blocks, batch.unit_lo, batch.unit_hi, batch.unit_col),
             (batch.pre_rows[pre], batch.pre_blocks[pre], batch.pre_lo[pre], batch.pre_hi[pre], batch.pre_col[pre])]
    one_row = decodes and (batch.dec_rows.shape[0] > 0 or batch.share_rows.numel() > 0)
    if all(kind[0].shape[0] == 0 for kind in kinds) and not one_row:
        return None
    n, opts, bs = q.shape[0], batch.plan.options, key_cache.shape[1]
    tiles = tiles_per_call(opts)
    slots = _Slots(q, batch.plan.cached_width, value_cache.shape[-1], own_pair)
    if one_row:
        _one_row_tiles(q, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale, slots, tiles)
    for units, (all_rows, all_blocks, all_lo, all_hi, all_cols) in zip((True, False), kinds):
        stacked = all_rows.shape[1] == 1 or (units and _units_stacked(q, all_rows.shape[1], batch))
        for start, stop in _chunks(all_rows.shape[0], tiles):
            rows = _pad_to(all_rows[start:stop], tiles, n)  # [tiles, rows]
            blocks = _pad_to(all_blocks[start:stop], tiles, 0)
            mask = slot_mask(_pad_to(all_lo[start:stop], tiles, 0), _pad_to(all_hi[start:stop], tiles, 0),
                             bs).flatten(2)  # [tiles, rows, chunk keys]
            read_k = partial(_gather, key_cache, blocks, k_scale, q.dtype)
            qr = q[rows.clamp(max=n - 1)]
            if stacked:  # V gathered once K is freed, its keys no row sees zeroed (a tile's real rows see the same)
                read_v = partial(_gather, value_cache, blocks, v_scale, q.dtype, ~mask.any(1)[:, :, None, None])
                part = attend_gathered(qr, read_k, read_v, mask, scale, soft_cap)
            else:
                part = attend(qr, read_k(), _gather(value_cache, blocks, v_scale, q.dtype), mask, scale, soft_cap)
            cols = _pad_to(all_cols[start:stop], tiles, 0)[:, None].expand_as(rows)
            slots.write(part, rows, cols, rows < n)
    return slots.fold()


class _Calls(NamedTuple):
    """One-row calls of one kind: `rows`, `cols` `[calls, tiles]`; `blocks` one chunk per tile (`[calls x
    tiles, chunk blocks]`) or, `shared`, one per call (`[calls, chunk blocks]`: read once, a view repeats
    it); `mask` `[calls x tiles, chunk keys]` the keys each tile's row sees (None: every key); `real` per
    call, its tiles up to its last real row (the plan's: the rest padding, never kept; 0: none, not run)."""
    rows: torch.Tensor
    cols: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor | None
    shared: bool
    real: tuple


def _real(real: int, first: int, calls: int, size: int) -> tuple:
    """Per call of `size` tiles from tile `first` of a range whose first `real` tiles are real: its real tiles."""
    return tuple(min(size, max(0, real - first - i * size)) for i in range(calls))


def _one_row_tiles(q, key_cache, value_cache, batch, scale, soft_cap, k_scale, v_scale, slots, per_call) -> None:
    """The one-row tiles (one-token requests), written to `slots` in groups of up to `GROUP_TILES` rows
    (`_one_row_group`): the first `dec_whole` dec tiles (they see every key of their chunk; `per_call` a
    call), the other dec tiles (tail calls of a quarter: a request's last chunk, or one cut by a window),
    the share calls (a call's one chunk read once)."""
    n, bs, whole, count = q.shape[0], key_cache.shape[1], batch.plan.dec_whole, batch.dec_rows.shape[0]
    kinds = []
    for first, stop, size, tail in ((0, whole, per_call, False), (whole, count, max(1, per_call // 4), True)):
        step = max(1, GROUP_TILES // size) * size
        for a in range(first, stop, step):
            b = min(a + step, stop)
            m = -(-(b - a) // size) * size
            mask = None if not tail else slot_mask(_pad_to(batch.dec_lo[a:b, 0], m, 0),
                                                     _pad_to(batch.dec_hi[a:b, 0], m, 0), bs).flatten(1)
            kinds.append(_Calls(_pad_to(batch.dec_rows[a:b, 0], m, n).view(-1, size),
                                _pad_to(batch.dec_col[a:b], m, 0).view(-1, size), _pad_to(batch.dec_blocks[a:b], m, 0),
                                mask, False, _real(batch.plan.dec_real[tail], a - first, m // size, size)))
    shares, step = batch.share_rows.shape[0], max(1, GROUP_TILES // per_call)
    for c in range(0, shares, step):
        calls = slice(c, min(c + step, shares))
        kinds.append(_Calls(batch.share_rows[calls], batch.share_col[calls], batch.share_blocks[calls], None, True,
                            batch.plan.share_real[calls]))
    group, rows = [], 0
    for calls in kinds:  # in order, as many kinds a group as fit
        if group and rows + calls.rows.numel() > GROUP_TILES:
            _one_row_group(q, key_cache, value_cache, group, scale, soft_cap, k_scale, v_scale, slots)
            group, rows = [], 0
        group, rows = group + [calls], rows + calls.rows.numel()
    if group:
        _one_row_group(q, key_cache, value_cache, group, scale, soft_cap, k_scale, v_scale, slots)


def _one_row_group(q, key_cache, value_cache, group: list[_Calls], scale, soft_cap, k_scale, v_scale,
                   slots) -> None:
    """The calls of `group`, written to `slots`. Each call runs its two products at its kind's one shape
    `[tiles, Hq, D] @ [tiles, D, keys x Hkv]` (every head pair, its own heads' diagonal kept: `tiles.attend`'s
    one-row form), all its tiles, padding ones included; the group keeps each call's rows up to its last
    real one (`_Calls.real`: a share call's empty rows are not held). Every other pass (scale, mask, max,
    exp, the sum over keys by a fixed pairwise tree, casts, the writes) runs over the group's rows at once,
    elementwise or a max. So a row's bits are its own call's products on its own values, in any call or
    group, whatever rows it holds. V's keys no row sees are zeroed; a padding row goes to the dump slot."""
    n, hq, d = q.shape
    op, dt = product_dtype(q.dtype), compute_dtype(q.dtype)
    calls, at = [], 0  # (kind, call, tiles, rows kept, first kept row in the group)
    for kind in group:
        for c, r in enumerate(kind.real):
            if r:
                calls.append((kind, c, kind.rows.shape[1], r, at))
                at += r
    if not calls:
        return
    cat = lambda xs: torch.cat(xs) if len(xs) > 1 else xs[0]  # noqa: E731
    qg = q[cat([kind.rows[c] for kind, c, *_ in calls]).clamp(max=n - 1)].to(op)  # every call's tiles
    chunks = {}

    def read(kind, cache, sc, c, tiles):  # call c's K or V `[tiles, keys, Hkv, D]`
        if kind.shared:
            key = (id(kind), cache is key_cache)
            chunks[key] = _gather(cache, kind.blocks, sc, q.dtype) if key not in chunks else chunks[key]
            return chunks[key][c:c + 1].expand(tiles, -1, -1, -1)
        mask = kind.mask
        unseen = None if mask is None or cache is key_cache else ~mask[c * tiles:(c + 1) * tiles, :, None, None]
        return _gather(cache, kind.blocks[c * tiles:(c + 1) * tiles], sc, q.dtype, unseen)

    scores, first = None, 0
    for kind, c, tiles, r, at in calls:
        k = read(kind, key_cache, k_scale, c, tiles)
        nk, hkv = k.shape[1], k.shape[2]
        g = hq // hkv
        every = score_product(qg[first:first + tiles], k.to(op).reshape(tiles, nk * hkv, d).transpose(1, 2))
        first += tiles
        if scores is None:
            scores = every.new_empty((calls[-1][3] + calls[-1][4], hkv, g, nk))
        scores[at:at + r].copy_(torch.diagonal(every[:r].view(r, hkv, g, nk, hkv), dim1=1, dim2=4)
                                .permute(0, 3, 1, 2))
        del k, every
    del qg
    chunks.clear()
    if soft_cap is not None:  # (then scaled here, and by 1 below)
        scores = soft_cap * torch.tanh(scores.to(dt) * scale / soft_cap)
    scale_t = scores.new_full((1,), 1.0 if soft_cap is not None else scale, dtype=dt)  # (a product with it: in dt)
    for kind in group:  # each kind's calls are consecutive in the group
        mine = [(c, t, r, at) for k, c, t, r, at in calls if k is kind]
        if kind.mask is not None and mine:
            mask = cat([kind.mask[c * t:c * t + r] for c, t, r, _ in mine])
            scores[mine[0][3]:mine[0][3] + mask.shape[0]].masked_fill_(~mask[:, None, None, :], float("-inf"))
    m = scores.amax(-1).to(dt) * scale_t  # (the max in the product's dtype: exact; a rounding is monotone)
    s = torch.addcmul(-torch.where(m > float("-inf"), m, 0.0)[..., None], scores, scale_t).exp_()  # one pass
    del scores
    p = s.to(op)
    total = tree_sum(s, overwrite=p is not s)  # (p is s where the products take dt)
    del s
    p_every, accs = None, []  # every head pair's probabilities, one buffer a kind: a call writes its diagonal
    for kind, c, tiles, r, at in calls:  # (a padding tile's entry may keep an earlier call's: never kept)
        if p_every is None or p_every.shape[0] != tiles:
            p_every = None  # (freed before the next is made)
            p_every = torch.zeros((tiles, hq, nk * hkv), dtype=op, device=q.device)
        torch.diagonal(p_every[:r].view(r, hkv, g, nk, hkv), dim1=1, dim2=4).copy_(p[at:at + r].permute(0, 2, 3, 1))
        v = read(kind, value_cache, v_scale, c, tiles)
        accs.append(torch.matmul(p_every, v.to(op).reshape(tiles, nk * hkv, -1))[:r])  # [r, Hq, Dv]
        del v  # (a gathered V freed before the next call's)
    del p, p_every
    chunks.clear()
    rows = cat([kind.rows[c, :r] for kind, c, _, r, _ in calls])
    cols = cat([kind.cols[c, :r] for kind, c, _, r, _ in calls])
    part = Partial(cat(accs).to(dt), m.view(-1, hq), total.view(-1, hq))
    slots.write(part, rows[:, None], cols[:, None], rows[:, None] < n)


def _gather(cache, blocks, sc, dtype, unseen=None) -> torch.Tensor:
    """A call's K or V `[tiles, chunk keys, Hkv, D]` (fp8: dequantized after the gather), `unseen` keys zeroed
    (through a 64-bit view of each key's row where its bytes allow: a fourth of the elements, the same bits)."""
    x = read_blocks(cache, blocks, sc, dtype).flatten(1, 2)
    if unseen is not None:
        wide = x.device.type != "hpu" and x.is_contiguous() and x.shape[-1] * x.element_size() % 8 == 0
        (x.view(torch.int64) if wide else x).masked_fill_(unseen, 0)
    return x


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
    slots = _Slots(q, batch.plan.causal_width, v.shape[-1])
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
