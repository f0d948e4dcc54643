"""MLA's unique path as a Gluon kernel for Hopper (sm_90): `mla_kernel._mla_body`'s contract, FlashMLA's data flow.

Why (measured on an H100): the Triton kernel is stuck at 3.1x the HBM floor because
Triton 3.6 lays the `[64 heads, 64 keys]` score tile over both warpgroups redundantly (1.53x the matrix work),
runs the scores, softmax and values strictly in sequence, and ignores warp specialisation on Hopper. Gluon
states the layouts, shared memory and barriers explicitly, so here:

* the query tile (`[64, 512]` + `[64, 64]`, bf16) is staged in shared memory once;
* each key tile (`KEYS` rows of one slot, latent and rope parts) arrives by TMA into a ring of `STAGES`
  buffers, signalled by an mbarrier per stage, while the previous tiles are computed;
* the scores run on `wgmma` with the two warpgroups side by side along the keys (`[4, 2]` warps: each computes
  half of the key columns, none of it twice), the row maximum crosses the warpgroups once per tile;
* the probabilities go to shared memory (bf16) and both warpgroups multiply them by the same latent tile, each
  owning half of the 512 value columns of the fp32 accumulator (128 registers per thread);
* `PIPE` 1: the next tile's scores are issued (asynchronous `wgmma`) before this tile's softmax, so the
  tensor cores work under the exponentials; 2: right after this tile's values product, so the two run back to
  back on the tensor cores; `LAZY_SUM`: the softmax sums kept per key column, reduced once at the end (one
  reduction across the warpgroups per tile fewer); `META_AHEAD`: a tile's slot bounds and the cache row of
  the tile to fetch next are loaded a step ahead (two dependent global loads off the critical path).

TMA cannot skip rows: a tile's rows a token may not see (`j < lo` or `j >= hi` of its slot, which may hold NaN)
are masked to -inf in the scores and zeroed in shared memory before the values product (only in tiles that have
such rows). Covered: bf16/fp16, 64-head groups, DV 512 (any multiple of 64 up to 512), DR a multiple of 16, the
block size a multiple of `KEYS`, rows of the cache contiguous blocks (`mla_decode.gluon_applies`). Imported only
where Triton with Gluon is.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _meta(tile, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS: gl.constexpr, KEYS: gl.constexpr,
          SLICE: gl.constexpr):
    """Tile `tile`'s slot bounds `lo`, `hi` and its first cache row (0, 0, 0 past the token's tiles: nothing
    read out of bounds)."""
    ok = tile < n_tiles
    start = k_begin + tile * KEYS
    slot = gl.load(order_ptr + first + start // BS, mask=ok, other=0)
    if SLICE:
        blk = slot
    else:
        blk = gl.load(ids_ptr + slot, mask=ok, other=0)
    lo = gl.load(lo_ptr + slot, mask=ok, other=0)
    hi = gl.load(hi_ptr + slot, mask=ok, other=0)
    return lo, hi, (blk * BS + start % BS).to(gl.int32)


@gluon.jit
def _split_tiles(starts_ptr, t, sp, splits, BS: gl.constexpr, KEYS: gl.constexpr, SPLIT_KEYS: gl.constexpr = 0,
                 ONE_KEYS: gl.constexpr = 0):
    """Token `t`'s first place in the slot order, and split `sp`'s first key and its number of `KEYS` tiles
    (the token's keys cut into `splits` parts of whole tiles, or with `SPLIT_KEYS` into parts of that many keys
    counted from its first, as `mla_kernel._mla_body` cuts them; `ONE_KEYS`: up to that many keys in one)."""
    first = gl.load(starts_ptr + t)
    n_keys = (gl.load(starts_ptr + t + 1) - first).to(gl.int32) * BS
    if ONE_KEYS > 0:
        per_split = gl.where(n_keys <= ONE_KEYS, ONE_KEYS, SPLIT_KEYS)
    elif SPLIT_KEYS > 0:
        per_split = SPLIT_KEYS
    else:
        per_split = gl.cdiv(n_keys, splits * KEYS) * KEYS
    k_begin = sp * per_split
    return first, k_begin, gl.maximum(gl.cdiv(gl.minimum(n_keys, k_begin + per_split) - k_begin, KEYS), 0)


@gluon.jit
def _issue(row, kn_desc, kr_desc, kn_s, kr_s, bars, stage):
    """TMA of the key tile at cache row `row` (`KEYS` rows of one slot) into ring buffer `stage`."""
    bar = bars.index(stage)
    mbarrier.expect(bar, kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kn_desc, [row, 0], bar, kn_s.index(stage))
    tma.async_copy_global_to_shared(kr_desc, [row, 0], bar, kr_s.index(stage))


@gluon.jit
def _scores(qn_s, qr_s, kn_t, kr_t, s_layout: gl.constexpr, KEYS: gl.constexpr):
    """Asynchronous `wgmma` of one tile's scores `[64, KEYS]` (latent part, then rope part)."""
    zero = gl.zeros([64, KEYS], gl.float32, s_layout)
    s = warpgroup_mma(qn_s, kn_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    return warpgroup_mma(qr_s, kr_t.permute((1, 0)), s, is_async=True)


@gluon.jit
def mla_gluon_kernel(q_ptr, k_ptr, kn_desc, kr_desc, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr,
                     l_ptr, scale, splits, sq_t, sq_h, sk_t,
                     HQ: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, BS: gl.constexpr, KEYS: gl.constexpr,
                     STAGES: gl.constexpr, SLICE: gl.constexpr, SELF: gl.constexpr, PIPE: gl.constexpr,
                     LAZY_SUM: gl.constexpr, META_AHEAD: gl.constexpr, FINAL: gl.constexpr,
                     num_warps: gl.constexpr):
    """One (head group of 64, split, token), 8 warps: `mla_kernel._mla_body`'s arguments (`FINAL` too), with the
    cache as two TMA descriptors over its rows `[blocks * BS, DV + DR]` (latent `[KEYS, DV]` and rope `[KEYS, DR]`
    boxes)."""
    gl.static_assert(num_warps == 8)
    hg = gl.program_id(0)
    sp = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)
    first, k_begin, n_tiles = _split_tiles(starts_ptr, t, sp, splits, BS, KEYS)

    # layouts: scores [64, KEYS] and the accumulator [64, DV] on wgmma, the warpgroups side by side (columns)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, KEYS // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, DV // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte accesses
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    qn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DV], gl.bfloat16)
    qr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DR], gl.bfloat16)
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, KEYS], gl.bfloat16)
    dtype: gl.constexpr = kn_desc.dtype

    qn_s = gl.allocate_shared_memory(dtype, [64, DV], qn_l)
    qr_s = gl.allocate_shared_memory(dtype, [64, DR], qr_l)
    kn_s = gl.allocate_shared_memory(dtype, [STAGES, KEYS, DV], kn_desc.layout)
    kr_s = gl.allocate_shared_memory(dtype, [STAGES, KEYS, DR], kr_desc.layout)
    p_s = gl.allocate_shared_memory(dtype, [64, KEYS], p_l)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGES):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()
    for b in gl.static_range(STAGES):  # the first tiles fly while the query is staged
        if b < n_tiles:
            _issue(_meta(b, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)[2],
                   kn_desc, kr_desc, kn_s, kr_s, bars, b)
    # META_AHEAD: tile i's bounds are loaded during tile i - 1, tile i + STAGES's row at the start of tile i
    lo_n, hi_n, _ = _meta(0, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)

    heads_ld = hg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ld_layout))
    q_row = q_ptr + t * sq_t + heads_ld[:, None] * sq_h
    cols_v = gl.arange(0, DV, layout=gl.SliceLayout(0, ld_layout))
    cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, ld_layout))
    qn = gl.load(q_row + cols_v[None, :])
    qr = gl.load(q_row + DV + cols_r[None, :])
    qn_s.store(qn)
    qr_s.store(qr)

    qk = scale * LOG2E  # scores in log2 units: exp2
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    acc = gl.zeros([64, DV], gl.float32, o_layout)
    if SELF:  # split 0 starts from the token's own key (weight 1 at its score)
        k_row = k_ptr + t * sk_t
        kn = gl.load(k_row + cols_v).to(gl.float32)
        kr = gl.load(k_row + DV + cols_r).to(gl.float32)
        s_self = gl.sum(qn.to(gl.float32) * kn[None, :], 1) + gl.sum(qr.to(gl.float32) * kr[None, :], 1)
        s_self = gl.convert_layout(s_self * qk, row_s)
        here = sp == 0
        m_i = gl.where(here, s_self, m_i)
        l_i = gl.where(here, 1.0, l_i)
        kn_o = gl.load(k_row + gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))).to(gl.float32)
        acc = gl.where(here, acc + kn_o[None, :], acc)
    fence_async_shared()
    gl.thread_barrier()

    jj = gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    rows_ld = gl.arange(0, KEYS, layout=gl.SliceLayout(1, ld_layout))
    s_next = warpgroup_mma_init(gl.zeros([64, KEYS], gl.float32, s_layout))  # (an accumulator in flight)
    l_keys = gl.zeros([64, KEYS], gl.float32, s_layout)  # (LAZY_SUM: the sums per key column, reduced at the end)
    if PIPE != 0:
        if n_tiles > 0:
            mbarrier.wait(bars.index(0), 0)
            s_next = _scores(qn_s, qr_s, kn_s.index(0), kr_s.index(0), s_layout, KEYS)
    for i in range(n_tiles):
        stage = i % STAGES
        start = k_begin + i * KEYS
        kn_t = kn_s.index(stage)
        if PIPE != 0:  # this tile's scores were issued last step
            s = warpgroup_mma_wait(0, deps=(s_next, ))
            if PIPE == 1:  # the next tile's, before this softmax
                if i + 1 < n_tiles:
                    nxt = (i + 1) % STAGES
                    mbarrier.wait(bars.index(nxt), ((i + 1) // STAGES) & 1)
                    s_next = _scores(qn_s, qr_s, kn_s.index(nxt), kr_s.index(nxt), s_layout, KEYS)
        else:
            mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            s = _scores(qn_s, qr_s, kn_t, kr_s.index(stage), s_layout, KEYS)
            s = warpgroup_mma_wait(0, deps=(s, ))
        if META_AHEAD:
            lo = lo_n
            hi = hi_n
            lo_n, hi_n, _ = _meta(i + 1, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS,
                                  SLICE)
            row_n = _meta(i + STAGES, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS,
                          SLICE)[2]
        else:
            lo, hi, _ = _meta(i, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)
        j0 = start % BS
        j = j0 + jj
        vis = (j >= lo) & (j < hi)
        s = gl.where(vis[None, :], s * qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        if LAZY_SUM:  # no reduction across the warpgroups for the sum in the loop
            l_i = l_i * alpha
            l_keys = l_keys * alpha[:, None] + p
        else:
            l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        if (lo > j0) | (hi < j0 + KEYS):  # rows this token may not see (NaN allowed there): zero them
            jr = j0 + rows_ld
            keep = (jr >= lo) & (jr < hi)
            for c in gl.static_range(DV // 64):  # (64 columns at a time: few registers beside the accumulator)
                part = kn_t.slice(c * 64, 64, dim=1)
                tile = part.load(ld_layout)
                part.store(gl.where(keep[:, None], tile, gl.zeros_like(tile)))
        p_s.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        pv = warpgroup_mma(p_s, kn_t, acc, is_async=True)
        if PIPE == 2:  # the next tile's scores queued behind this product: no gap on the tensor cores
            if i + 1 < n_tiles:
                nxt = (i + 1) % STAGES
                mbarrier.wait(bars.index(nxt), ((i + 1) // STAGES) & 1)
                s_next = _scores(qn_s, qr_s, kn_s.index(nxt), kr_s.index(nxt), s_layout, KEYS)
                acc = warpgroup_mma_wait(2, deps=(pv, ))  # (the product done, the two score groups may run)
            else:
                acc = warpgroup_mma_wait(0, deps=(pv, ))
        else:
            acc = warpgroup_mma_wait(0, deps=(pv, ))
        gl.thread_barrier()  # both warpgroups are done with this stage and with P
        if i + STAGES < n_tiles:
            if not META_AHEAD:
                row_n = _meta(i + STAGES, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS,
                              SLICE)[2]
            _issue(row_n, kn_desc, kr_desc, kn_s, kr_s, bars, stage)
    if LAZY_SUM:
        l_i = l_i + gl.sum(l_keys, 1)
    for b in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(b))

    heads_o = hg * 64 + gl.arange(0, 64, layout=row_o)
    out = (t * splits + sp) * HQ + heads_o
    cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    if FINAL:  # (one split: the rows normalized in acc's dtype)
        o = acc * gl.convert_layout(1.0 / gl.where(l_i > 0, l_i, 1.0), row_o)[:, None]  # (64 divisions)
        gl.store(acc_ptr + out[:, None] * DV + cols_o[None, :], o.to(acc_ptr.dtype.element_ty))
    else:
        gl.store(acc_ptr + out[:, None] * DV + cols_o[None, :], acc)
        heads_s = hg * 64 + gl.arange(0, 64, layout=row_s)
        out_s = (t * splits + sp) * HQ + heads_s
        gl.store(m_ptr + out_s, m_i * (1.0 / LOG2E))
        gl.store(l_ptr + out_s, l_i)


class _Base:
    """What a TMA descriptor reads of its tensor at launch (the address and dtype: Triton's launcher encodes the
    tensor map from them, `shape` and `strides`), without holding the tensor: a kept descriptor keeps no memory
    alive, and one built again from a tensor of the same address, dtype and geometry is the same descriptor."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


_DESCRIPTORS: dict = {}  # (device, address, shape, strides, dtype, value dims, keys, halves) -> the two descriptors
DESCRIPTORS_KEPT = 256  # (more distinct caches than this: all forgotten, then kept again; a model has ~60 layers)


def cache_descriptors(key_cache, value_dim: int, keys: int, keep: bool = True, halves: bool = False):
    """Two TMA descriptors over the cache's rows `[blocks * BS, DV + DR]` (`sc_b == BS * sc_s` is the caller's
    check): the latent part in `[keys, DV]` boxes (`halves`: `[keys, DV // 2]`, `mla_gluon_seesaw.py`), the rope
    part in `[keys, DR]` boxes. With `keep` looked up by
    everything a descriptor is made of (device, address, shape, strides, dtype, the box), so a launch does not
    build them again (33 us of the host's time a launch on an H100) and another cache or geometry never finds a stale
    one; the descriptors hold no reference to the cache (`_Base`)."""
    import torch
    from triton.experimental.gluon import language as gl_

    key = (key_cache.device, key_cache.data_ptr(), tuple(key_cache.shape), tuple(key_cache.stride()),
           key_cache.dtype, value_dim, keys, halves)
    hit = _DESCRIPTORS.get(key) if keep else None
    if hit is not None:
        return hit
    nb, bs = key_cache.shape[0], key_cache.shape[1]
    d, sc_s = key_cache.shape[-1], key_cache.stride(1)
    elem = gl_.bfloat16 if key_cache.dtype == torch.bfloat16 else gl_.float16
    rows, ptr, size = nb * bs, key_cache.data_ptr(), key_cache.element_size()
    box = value_dim // 2 if halves else value_dim
    kn_l = gl_.NVMMASharedLayout.get_default_for([keys, box], elem)
    kr_l = gl_.NVMMASharedLayout.get_default_for([keys, d - value_dim], elem)
    out = (TensorDescriptor(_Base(ptr, key_cache.dtype), [rows, value_dim], [sc_s, 1], [keys, box], kn_l),
           TensorDescriptor(_Base(ptr + value_dim * size, key_cache.dtype), [rows, d - value_dim], [sc_s, 1],
                            [keys, d - value_dim], kr_l))
    if keep:
        if len(_DESCRIPTORS) >= DESCRIPTORS_KEPT:
            _DESCRIPTORS.clear()
        _DESCRIPTORS[key] = out
    return out
