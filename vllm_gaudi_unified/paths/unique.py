"""Unique path: cache blocks needed by exactly one query token (the usual decode).

Computed per block, not per token: block slot `b` holds one block and the one
token that sees it, the scores of all blocks come from one batched product, and
the per-block partials are merged back into their tokens. The blocks are either
the contiguous cache slice `[0, num_unique_blocks)` read in place (no gather:
good when most of the slice is live) or the live blocks gathered by id (good
when block ids are scattered over a large cache); the planner picks per step.
With the Triton kernel (CUDA), a small group's shared tiles join the kernel's slots too
(`kernel_takes_shared`): the step's cached keys in one launch.
"""
from __future__ import annotations

import importlib.util
import math

import torch

from vllm_gaudi_unified.merge import Final, Partial, Scattered, scatter_merge
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.paths.kv_quant import is_fp8, read_blocks
from vllm_gaudi_unified.paths.tiles import attend, compute_dtype, slot_mask
from vllm_gaudi_unified.paths.units import request_pairs, units_partial

#: Keys per loop step of the kernel, and the keys a split aims at (a token's blocks are cut into
#: power-of-two splits of about this many keys, so long contexts still fill the GPU).
#: Measured on an H100 (a sweep of these constants timed with `python -m benchmarks.speed --variants`, `uk_*` keys).
KERNEL_KEYS = 128
KERNEL_SPLIT_KEYS = 8192
KERNEL_MAX_SPLITS = 32
KERNEL_WARPS = 4
KERNEL_STAGES = 2
#: A launch of fewer (token, KV head, split) programs than this (a few tokens with long contexts: parallel
#: sampling) cuts each token's keys into more splits, none under `KERNEL_MIN_SPLIT_KEYS` keys
#: (`KERNEL_MIN_SHARED_SPLIT_KEYS` with a small group's shared cells, whose blocks every row reads, from L2 after
#: the first), while that cuts the key tiles a split walks. H200, one process: parallel sampling at heads
#: 8/1/128 (16 programs) 22.5 us a step with 8 splits of three tiles, 20.3 with 32 of one; without shared
#: cells, 8 decodes x 1k (64 programs) 26.8 with 4 splits of two tiles, 28.3 with 8 of one.
KERNEL_MIN_PROGRAMS = 512
KERNEL_MIN_SPLIT_KEYS = 256
KERNEL_MIN_SHARED_SPLIT_KEYS = 64
#: Shared tiles of at most this many rows (a small group: parallel sampling's n <= 16 samples) go through
#: the kernel too, each row reading the tile's blocks itself (`kernel_takes_shared`): the re-reads mostly
#: hit L2, and the step is one kernel instead of a gather, flash and a scatter merge (docs/benchmarks.md).
KERNEL_SHARED_MAX_ROWS = 16
#: Slots up to which the kernel's token order is computed by rank (`token_order`), not sorted.
RANK_SORT_MAX_SLOTS = 1024
#: (tokens + 1) x slots up to which the token order on CUDA is one scan kernel (`scan_token_order`): its rows
#: read from L2 grow with that product (4M: about 64 MB, a few us), where a radix sort grows with the slots.
SCAN_ORDER_MAX_WORK = 1 << 22


def unique_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch, scale: float,
                   soft_cap: float | None, k_scale=None, v_scale=None,
                   new: tuple | None = None) -> Partial | Scattered | None:
    """None when the batch has no unique block; one-token units: the slots' rows unmerged (`merge.merge_rows`).
    An fp8 cache is dequantized after the gather (or slice). `new` (the step's keys and values;
    `units_take_new_pairs`): the requests' self and causal pairs too (`units.request_pairs`), merged in."""
    slots = batch.unique_rows.shape[0]
    if slots == 0:
        return None
    n = q.shape[0]
    # The slice [0, slots) when unique_blocks is None: read in place (views), unless an fp8 cache is converted.
    ids = slots if batch.unique_blocks is None else batch.unique_blocks
    k = read_blocks(key_cache, ids, k_scale, q.dtype)
    v = read_blocks(value_cache, ids, v_scale, q.dtype)
    block_size = key_cache.shape[1]
    mask = slot_mask(batch.unique_lo, batch.unique_hi, block_size)[:, None, :]  # [slots, 1, block_size]
    rows = batch.unique_rows
    if batch.plan.unique_units > 1:  # a (request, block) unit: the request's new tokens x all heads
        pairs = None if new is None else request_pairs(q, *new, batch, scale, soft_cap)
        return units_partial(q, k, v, *unit_tokens(batch, n), mask, _partial_slots(batch, n, block_size), scale,
                             soft_cap, pairs)
    # As many slots as a bucket's partial ones (one block per request: parallel sampling's last blocks): V
    # masked once for every slot, one product, no second one on the listed slots nor their ranking
    masked = None if slots <= _partial_count(batch) else _partial_slots(batch, n, block_size)
    part = attend(q[rows.clamp(max=n - 1)][:, None], k, v, mask, scale, soft_cap, masked_tiles=masked)
    return Scattered(part, rows)


def unit_tokens(batch, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of each unique slot's unit `[slots, unique_units]` (its row, its request's first new token,
    and the next ones) and which of them are real: below `n` and of the same request (`token_seg_start`).
    A request's drafts see the same cached keys (no window on this path), so one mask serves its rows."""
    rows = batch.unique_rows
    tokens = rows[:, None] + torch.arange(batch.plan.unique_units, device=rows.device, dtype=rows.dtype)
    seg = batch.token_seg_start[tokens.clamp(max=n - 1)]
    return tokens, (tokens < n) & (seg == rows[:, None])


def per_token(batch, n: int):
    """`batch` with each unique unit cut into one slot per real token (the routes that read a block per
    token: flash per block, MLA's, the kernel with shared cells): the same pairs, the unit's keys read by
    each of its tokens. The batch itself where units are single tokens."""
    s = batch.plan.unique_units
    if s == 1:
        return batch
    from dataclasses import replace

    tokens, real = unit_tokens(batch, n)
    slots = batch.unique_rows.shape[0]
    ids = (torch.arange(slots, device=tokens.device, dtype=tokens.dtype) if batch.unique_blocks is None
           else batch.unique_blocks)
    plan = replace(batch.plan, options=replace(batch.plan.options, unique_tokens=1),
                   bucket=replace(batch.plan.bucket, num_unique_blocks=slots * s,
                                  num_logits=batch.plan.bucket.num_logits * s))
    return replace(batch, plan=plan, unique_rows=torch.where(real, tokens, n).reshape(-1),
                   unique_blocks=ids.repeat_interleave(s), unique_lo=batch.unique_lo.repeat_interleave(s),
                   unique_hi=batch.unique_hi.repeat_interleave(s))


def fused_unique_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch,
                         scale: float, k_scale=None, v_scale=None) -> Partial | None:
    """`unique_partial` through flash, one segment per block (`fused.flash_blocks`), K and V read by one
    kernel (an fp8 cache dequantized after the slice or gather, `read_blocks`). Flash sees every slot
    of a block; the few slots a row sees only part of (`_partial_slots`) are computed again on the
    masked tiles and replace flash's rows before the merge."""
    slots = batch.unique_rows.shape[0]
    if slots == 0:
        return None
    n = q.shape[0]
    ids = slots if batch.unique_blocks is None else batch.unique_blocks
    k, v = read_blocks(key_cache, ids, k_scale, q.dtype), read_blocks(value_cache, ids, v_scale, q.dtype)
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
    count = min(slots, _partial_count(batch))
    partial = (batch.unique_rows < n) & ((batch.unique_lo > 0) | (batch.unique_hi < block_size))
    # Compacted by rank (a cumulative sum and one scatter): the k-th partial slot goes to entry k; the
    # others to a dropped entry `count`; entries left over keep slot 0. Cheaper than a top-k on the device
    # (one radix pass per byte over every slot: 26 us of a 256-decode step at block size 16, H100).
    rank = torch.cumsum(partial.to(torch.int32), 0) - 1
    dest = torch.where(partial & (rank < count), rank, count).to(torch.int64)
    sel = torch.zeros(count + 1, dtype=torch.int64, device=partial.device)
    return sel.index_copy_(0, dest, torch.arange(slots, device=partial.device))[:count]


def _partial_count(batch) -> int:
    """The most slots of a bucket a real row sees only part of: 2 per request with a sliding window, else 1."""
    return (1 if batch.sliding_window is None else 2) * batch.bucket.num_logits


#: Looked up once, at import: a plain constant is what torch.compile traces without a warning (it
#: traces through a functools.cache wrapper and says so).
TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def triton_importable() -> bool:
    return TRITON_IMPORTABLE


#: Cache dtypes the kernel reads: fp8 (dequantized in registers) and the 16-bit floats, whose products it
#: runs in their own dtype with fp32 statistics, as flash does. Not fp32/fp64: Triton's dot would round
#: them to tf32 (the matmul tiles stay exact there; flash does not take them either).
KERNEL_CACHE_DTYPES = (torch.bfloat16, torch.float16)


def kernel_unique_applies(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """The Triton kernel (`unique_kernel.py`) where Triton is, for fp8 and 16-bit caches: one kernel reads
    each live block once and merges a token's blocks on the chip, where the other paths write a partial
    per block (and first copy an fp8 cache's gathered blocks to the query's dtype). Measured faster than
    flash per block and the matmul tiles at block sizes 16 and 128 on an H100. It indexes a
    head's channels as consecutive elements."""
    return ((is_fp8(key_cache.dtype) or key_cache.dtype in KERNEL_CACHE_DTYPES)
            and key_cache.shape[-1] == value_cache.shape[-1]  # one head dim (not MLA's latent)
            and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1 and triton_importable())


def kernel_takes_shared(batch) -> bool:
    """Does the kernel take the batch's shared tiles too (`kernel_unique_partial(shared=True)`)? When they
    have at most `KERNEL_SHARED_MAX_ROWS` rows: a static fact of the bucket and its options (the plan
    records its tile rows), so a bucket's graph is fixed."""
    return 0 < batch.shared_rows.shape[0] and batch.shared_rows.shape[1] <= KERNEL_SHARED_MAX_ROWS


def _slots_with_shared(batch, n: int):
    """(rows, block ids, lo, hi) of the unique slots followed by one slot per (shared tile row, tile block):
    a small group's shared blocks read by each of its rows. Cells with no visible slot (padding rows and
    columns of a tile) go to row `n`, which the kernel never reads."""
    t, qt = batch.shared_rows.shape
    kb = batch.shared_blocks.shape[1]
    lo, hi = batch.shared_lo.reshape(-1), batch.shared_hi.reshape(-1)
    rows = torch.where(hi > lo, batch.shared_rows[:, :, None].expand(t, qt, kb).reshape(-1), n)
    blocks = batch.shared_blocks[:, None, :].expand(t, qt, kb).reshape(-1)
    u = batch.unique_rows.shape[0]
    ids = (torch.arange(u, device=blocks.device, dtype=blocks.dtype) if batch.unique_blocks is None
           else batch.unique_blocks)
    cat = lambda a, b: torch.cat([a, b.to(a.dtype)])  # noqa: E731
    return (cat(batch.unique_rows, rows), cat(ids, blocks), cat(batch.unique_lo, lo), cat(batch.unique_hi, hi))


def kernel_unique_partial(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch,
                          scale: float, k_scale=None, v_scale=None, shared: bool = False,
                          new: tuple[torch.Tensor, torch.Tensor] | None = None,
                          final: bool = False) -> Partial | Final | None:
    """`unique_partial` through the Triton kernel: one Partial row per token (its blocks merged in the
    kernel, in splits merged by `combine_splits`). Slots are put in token order on the device (no sync);
    the split count comes from the bucket (host numbers), so a bucket's graph is fixed.
    `shared`: the shared tiles' (row, block) cells as further slots of their rows (`kernel_takes_shared`).
    `new` (the step's keys and values, `units_take_new_pairs`; with `shared`, one-token units only): each unit
    takes its request's self and causal pairs too, so the Partial is every pair of its tokens.
    `final` (the step's only path): the rows normalized in q's dtype (`Final`), by the kernel where a token has
    one split, else by the splits' merge: no fp32 Partial written and read again (4 MB at 64 x 4 x 32 heads).
    On CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1: tests)."""
    from vllm_gaudi_unified.paths import unique_kernel

    n, hq, d = q.shape
    slots = batch.unique_rows.shape[0] + (batch.shared_lo.numel() if shared else 0)
    if slots == 0 and new is None:
        return None
    in_order = shared and (n + 1) * slots <= SCAN_ORDER_MAX_WORK  # (`unique_kernel.token_slots`)
    if in_order:
        ids, lo, hi, starts = unique_kernel.token_slots(batch, n)
        order, slice_ = ids, False  # (order unused: the slots are in token order)
    else:
        if shared:
            rows, ids, lo, hi = _slots_with_shared(batch, n)
            slice_ = False
        else:
            rows, lo, hi = batch.unique_rows, batch.unique_lo, batch.unique_hi
            ids, slice_ = batch.unique_blocks, batch.unique_blocks is None
        order, starts = token_order(rows, n, batch.token_seg_start, 1 if shared else batch.plan.unique_units)
    _, bs, hkv, _ = key_cache.shape
    g = hq // hkv
    units = 1 if shared else batch.plan.unique_units  # (with shared cells: `per_token`'s batch)
    work = starts.shape[0] > n + 1  # the unit starts listed: a program per request's unit, not per token
    ids = order if slice_ else ids  # (unused for the slice)
    keys_per_token = slots * bs / max(1, batch.bucket.num_logits)  # decodes: about one request's context
    splits = _splits(keys_per_token, (n if units == 1 else batch.bucket.num_logits) * hkv,  # (programs with work)
                     KERNEL_MIN_SHARED_SPLIT_KEYS if shared else KERNEL_MIN_SPLIT_KEYS)
    dt = compute_dtype(q.dtype)
    in_kernel = final and splits == 1  # (the kernel writes the final rows; acc/m/total give its dtype only)
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device) if in_kernel else None
    acc = torch.empty((1,) if in_kernel else (n, splits, hq, d), dtype=dt, device=q.device)
    m = acc if in_kernel else torch.empty((n, splits, hq), dtype=dt, device=q.device)
    total = acc if in_kernel else torch.empty_like(m)
    ks, ks_strides, k_factor = _scale_args(k_scale)
    vs, vs_strides, v_factor = _scale_args(v_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    unique_kernel.unique_kernel[(max(1, min(n, batch.bucket.num_logits)) if work else n, hkv, splits)](
        q, key_cache, value_cache, key_cache if ks is None else ks, value_cache if vs is None else vs,  # (unused)
        order, starts, ids, lo, hi, batch.token_seg_start, n, acc, m, total, scale * k_factor, v_factor,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3], *ks_strides, *vs_strides,
        HQ=hq, G=g, ROWS=max(16, _pow2(units * g)), D=d, D_PAD=max(16, _pow2(d)), BS=bs, KEYS=KERNEL_KEYS,
        SPLITS=splits, SLICE=slice_, K_SCALES=_scale_mode(ks), V_SCALES=_scale_mode(vs),
        SPLIT_KEYS=0, UNITS=units, **_new_args(new, q, scale, v_factor, units), out_ptr=acc if out is None else out,
        FINAL=in_kernel, EXACT_DIV=False, SORTED=in_order, WORK=work, num_warps=KERNEL_WARPS, num_stages=KERNEL_STAGES)
    if in_kernel:
        return Final(out)
    if splits == 1:
        return Partial(acc[:, 0], m[:, 0], total[:, 0])
    return combine_splits(acc, m, total, q.dtype if final else None)


def combine_splits(acc: torch.Tensor, m: torch.Tensor, total: torch.Tensor, out_dtype) -> Partial | Final:
    """A token's split rows (acc `[n, splits, heads, dv]`, m/total `[n, splits, heads]`) merged in one pass
    (`mla_kernel.split_combine`, `merge.py`'s exact merge): `Final` rows in `out_dtype`, or (None) the Partial.
    `merge.fold_pairwise`'s passes (~15 kernels a level) cost more than the kernel (MQA verify: 4 splits)."""
    from vllm_gaudi_unified.paths import mla_kernel

    n, splits, hq, dv = acc.shape
    out = torch.empty((n, hq, dv), dtype=out_dtype or acc.dtype, device=acc.device)
    om, ol = torch.empty((2, n, hq), dtype=m.dtype, device=m.device)  # (the merged max and sum, without FINAL)
    mla_kernel.split_combine[(n * hq, )](acc, m, total, out, om, ol, S=splits, S_PAD=max(2, splits), HQ=hq, DV=dv,
                                         DV_PAD=max(16, _pow2(dv)), FINAL=out_dtype is not None)
    return Final(out) if out_dtype is not None else Partial(out, om, ol)


def _new_args(new, q: torch.Tensor, scale: float, v_factor: float, units: int,
              take: torch.Tensor | None = None) -> dict:
    """The kernel's arguments for a unit's own new keys (`NEW_KEYS` 0: none; the query stands in for the
    unused pointers); `take` (`[tokens]`, nonzero where a token's program takes them): only those tokens'
    (else every token's). Every one is passed: torch.compile's wrapper of a Triton kernel takes no defaults."""
    select = {"take_ptr": q if take is None else take, "NEW_SELECT": take is not None}
    if new is None:
        return {"kn_ptr": q, "vn_ptr": q, "skn_t": 0, "skn_h": 0, "svn_t": 0, "svn_h": 0, "new_scale": 1.0,
                "new_v": 1.0, "NEW_KEYS": 0, **select}
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in new)
    return {"kn_ptr": k, "vn_ptr": v, "skn_t": k.stride(0), "skn_h": k.stride(1), "svn_t": v.stride(0),
            "svn_h": v.stride(1), "new_scale": scale, "new_v": 1.0 / v_factor,
            "NEW_KEYS": max(16, _pow2(units)), **select}


def units_take_new_pairs(batch, kernel: bool) -> bool:
    """Do the unique units take the step's self and causal pairs (`kernel`: the Triton kernel's,
    `kernel_unique_partial(new=...)`; else the matmul tiles', `unique_partial(new=...)`)? A static fact of
    the bucket and its options, so a bucket's graph is fixed:
    - one-token units (decodes): the kernel's, each token's self pair, where no request off the prompt route
      has several new tokens (no causal tiles: phase '-..'); a prompt-route token's is its self pair too;
    - units of several tokens (`PlanOptions.unique_units`: no window) with the dense prompt route: then a
      request of more new tokens than a unit takes the prompt route (`plan/prompts.py: prompt_requests`),
      whose tokens are segments of their own (`token_seg_start`: the self pair), but for the chunks the
      prompt grid leaves out (`fill_grid`). The kernel takes those too (their later tokens one program
      each); the tiles' one tile per request (`units.request_pairs`) needs a bucket without prompt rows (the grid
      keeps at least one)."""
    plan = batch.plan
    if plan.bidirectional:
        return False
    if plan.unique_units == 1:
        return kernel and batch.phase[0] == "-"
    return plan.options.prompt_route == "dense" and (kernel or batch.bucket.num_prompts == 0)


def token_order(rows: torch.Tensor, n: int, seg=None, units: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots' indices sorted by token (rows <= n), stable, and each token's first place in that order
    (`n + 1` starts: token t's slots are `order[starts[t]:starts[t + 1]]`; the unique kernel's and the MLA
    routes'). Up to `RANK_SORT_MAX_SLOTS` slots by rank: a slot's place is the count of slots before it in
    (row, index) order, one comparison-sum kernel
    (the sort torch.compile makes of a few hundred keys took 9.5-18.6 us on an H100);
    more slots: a stable sort of 16-bit keys where the rows fit (a radix sort of int64 keys takes 8
    passes, 50 us of a 0.8 ms decode step, torch.profiler on an H100). On CUDA, up to `SCAN_ORDER_MAX_WORK`,
    one scan kernel instead (`scan_token_order`; with `units` > 1 and `seg`, the unit starts listed too)."""
    s, units = rows.shape[0], units if seg is not None else 1
    if rows.is_cuda and triton_importable() and 0 < s and (n + 1) * max(s, n * (units > 1)) <= SCAN_ORDER_MAX_WORK:
        return scan_token_order(rows, n, seg, units)
    if s <= RANK_SORT_MAX_SLOTS:
        index = torch.arange(s, device=rows.device, dtype=rows.dtype)
        key = rows * s + index  # distinct: the (row, index) order
        place = (key[None, :] < key[:, None]).sum(1)
        order = torch.empty_like(index).scatter_(0, place, index)
    else:
        order = torch.argsort(rows.to(torch.int16 if n < 2**15 - 1 else torch.int32), stable=True)
    return order, torch.searchsorted(rows[order], torch.arange(n + 1, device=rows.device, dtype=rows.dtype))


def scan_token_order(rows: torch.Tensor, n: int, seg=None, units: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_order` as one Triton launch of `n + 1` programs, each scanning every slot's row
    (`unique_kernel.order_kernel`): where the rank's comparisons or the sort's passes each cost a launch or more
    (a verify step's 1601 slots: a 14 us radix sort beside the searchsorted, H200). `units` > 1: the starts
    (`[2n + 2]`) list the tokens that start a unit of `seg`'s requests after the `n + 1` starts, then their count."""
    from vllm_gaudi_unified.paths import unique_kernel

    rows = rows.contiguous()
    order = torch.empty_like(rows)
    starts = torch.empty((n + 1) * (1 + (units > 1)), dtype=rows.dtype, device=rows.device)
    unique_kernel.order_kernel[(n + 1,)](rows, order, starts, rows.shape[0], rows if units == 1 else seg, CHUNK=1024,
                                         UNITS=units)
    return order, starts


def _splits(keys_per_token: float, programs: int, min_keys: int | None = None) -> int:
    """Splits per token (a power of two): about `KERNEL_SPLIT_KEYS` keys each, and more while the launch
    has fewer than `KERNEL_MIN_PROGRAMS` programs, each split keeps `min_keys` keys (default
    `KERNEL_MIN_SPLIT_KEYS`) and walks fewer key tiles for it."""
    min_keys = KERNEL_MIN_SPLIT_KEYS if min_keys is None else min_keys
    splits = min(KERNEL_MAX_SPLITS, _pow2(math.ceil(keys_per_token / KERNEL_SPLIT_KEYS)))
    tiles = math.ceil(keys_per_token / KERNEL_KEYS)  # (a split walks ceil(tiles / splits) key tiles)
    while (splits < KERNEL_MAX_SPLITS and programs * splits < KERNEL_MIN_PROGRAMS
           and keys_per_token >= 2 * splits * min_keys
           and -(-tiles // (2 * splits)) < -(-tiles // splits)):
        splits *= 2
    return splits


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _scale_mode(scale: torch.Tensor | None) -> int:
    """The kernel's scale modes: 0 none (folded), 1 one per key (channels broadcast), 2 per key and channel."""
    return 0 if scale is None else 2 if scale.dim() == 4 and scale.shape[3] > 1 else 1


def _scale_args(scale) -> tuple[torch.Tensor | None, tuple[int, int, int, int], float]:
    """(tensor the kernel loads per key, or None; its strides over [block, slot, kv head, channel], 0 where it
    broadcasts; the float folded into the scores or the output): a tensor is loaded on the device, no sync."""
    if not isinstance(scale, torch.Tensor):
        return None, (0, 0, 0, 0), 1.0 if scale is None else float(scale)
    if scale.numel() == 1:
        return scale.reshape(1), (0, 0, 0, 0), 1.0
    return scale, tuple(0 if n == 1 else st for n, st in zip(scale.shape, scale.stride())), 1.0
