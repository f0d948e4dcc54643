"""MLA's Gluon kernel with FlashMLA's ping-pong and no producer partition (`MLA_GLUON_PP`, docs/benchmarks.md,
MLA, kernel run 14).

Why: `mla_gluon.py` runs both warpgroups on one instruction stream (the tensor cores idle through each softmax)
and splits each score tile between them (`N = 32`, the query read twice from shared memory); a warp-specialised
variant with a producer partition fixed both, but Triton 3.6 then pads to 12 warps and its consumers spilled
(kernel runs 10 and 13: 0.465-0.519 ms; removed). Here there are
8 warps, two partitions of one warpgroup each (`gl.warp_specialize`, no producer):

* warpgroup X owns the key tiles X, X + 2, ... and keeps them in its own buffer X (two buffers of 64 keys);
  it computes its tile's whole `[64, 64]` scores (`N = 64`) and softmax while the other is in its products;
* a tile arrives by TMA in three parts with an mbarrier each (the two halves of the latent, the rope part), and
  the scores start on the owner's half: warpgroup X multiplies every tile by its half X of the value columns, so
  it is the last reader of that half and fetches the next tile's half X right after its own product, without
  waiting for the other warpgroup; the rope part (where the tile's P is written) is fetched by the non-owner
  after both products (`pvdone`);
* the running maximum, rescale factors and row sums pass through shared memory with mbarriers.

Measured (run 14, H100): correct, 0.356-0.357 ms at 128 x 4096 against the default's 0.354: not faster, so off.
Same contract and NaN rule as `mla_gluon.py` (invisible rows: -inf scores, value rows zeroed by the owner before
its P is published). Covered: 16-bit, 64-head groups, DV 128-512, DR = KEYS = 64 (P over the rope part).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from vllm_gaudi_unified.paths.mla_gluon import LOG2E, _meta, _split_tiles


@gluon.jit
def _fetch(C: gl.constexpr, row, b, kn_desc, kr_desc, kn_s, kr_s, rdy, DV: gl.constexpr):
    """Part `C` of the tile at cache row `row` (0, 1: the latent's halves, 2: the rope part) into buffer `b`."""
    bar = rdy.index(b * 3 + C)
    if C == 2:
        mbarrier.expect(bar, kr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kr_desc, [row, 0], bar, kr_s.index(b))
    else:
        mbarrier.expect(bar, kn_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kn_desc, [row, C * (DV // 2)], bar, kn_s.index(b * 2 + C))


@gluon.jit
def _values(acc, l_i, t, row, kn_s, kr_s, stats, pdone, pvdone, rdy, kn_desc, kr_desc, n_tiles,
            X: gl.constexpr, OWN: gl.constexpr, DV: gl.constexpr, row_o: gl.constexpr, row_s: gl.constexpr):
    """Tile t's values product on half X of the columns after its owner published P; then this half of tile
    t + 2 (at cache row `row`) is fetched (the last reader was this product), and by the non-owner the rope
    part once both are done."""
    b = t % 2
    mbarrier.wait(pdone.index(b), (t // 2) & 1)
    alpha = stats.index(2 * b + 1).load(row_s)
    l_i = l_i * alpha + stats.index(4 + b).load(row_s)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    pv = warpgroup_mma(kr_s.index(b), kn_s.index(b * 2 + X), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(pv, ))
    nt = t + 2
    if nt < n_tiles:
        _fetch(X, row, b, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
    if OWN:
        mbarrier.arrive(pvdone.index(b))
    else:
        if nt < n_tiles:
            mbarrier.wait(pvdone.index(b), (t // 2) & 1)
            _fetch(2, row, b, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
    return acc, l_i


@gluon.jit
def _consumer(qn_s, qr_s, kn_s, kr_s, stats, rdy, pdone, pvdone, kn_desc, kr_desc, n_tiles, k_begin, first,
              order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, out_row, qk, l0, k_row, self_on,
              X: gl.constexpr, DV: gl.constexpr, BS: gl.constexpr, KEYS: gl.constexpr, SLICE: gl.constexpr,
              FINAL: gl.constexpr):
    """Warpgroup X: scores and softmax of tiles X, X + 2, ...; the values product of every tile on half X.
    An iteration's slot bounds and fetch rows are loaded at its start (one iteration ahead measured no faster:
    kernel run 15)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DV // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = qn_s.dtype
    H: gl.constexpr = DV // 2
    cols = X * H + gl.arange(0, H, layout=gl.SliceLayout(0, o_layout))
    kn = gl.load(k_row + cols, mask=(cols < DV) & self_on, other=0.0).to(gl.float32)
    acc = gl.zeros([64, H], gl.float32, o_layout) + kn[None, :]  # (the own pair: weight 1, or nothing)
    m_i = stats.index(6).load(row_s)  # (the own pair's score, or -inf)
    l_i = gl.zeros([64], gl.float32, row_s) + l0
    jj = gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    rows_ld = gl.arange(0, KEYS, layout=gl.SliceLayout(1, ld_layout))
    for t in range(X, n_tiles, 2):
        ph = (t // 2) & 1
        b = t % 2  # (== X; taken from t so that the operands' descriptors are not hoisted out of the loop:
        # in the worker partition they would sit in ordinary registers and spill, as in the removed producer variant)
        lo, hi, _ = _meta(t, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)
        # (the rows of tiles t + 1 and t + 2, fetched after the values products on tiles t - 1 and t)
        row1 = _meta(t + 1, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)[2]
        row2 = _meta(t + 2, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)[2]
        mbarrier.wait(rdy.index(b * 3 + b), ph)  # (own half first: fetched earliest)
        s = warpgroup_mma(qn_s.index(b), kn_s.index(b * 3).permute((1, 0)),
                          gl.zeros([64, KEYS], gl.float32, s_layout), use_acc=False, is_async=True)
        mbarrier.wait(rdy.index(b * 2 + 1), ph)
        s = warpgroup_mma(qn_s.index(1 - b), kn_s.index(b + 1).permute((1, 0)), s, is_async=True)
        mbarrier.wait(rdy.index(b * 3 + 2), ph)
        s = warpgroup_mma(qr_s, kr_s.index(b).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if t > 0:  # the running maximum after tile t - 1 (the other warpgroup's)
            mbarrier.wait(pdone.index(1 - X), ((t - 1) // 2) & 1)
            m_i = stats.index(2 * (1 - X)).load(row_s)
        j0 = (k_begin + t * KEYS) % BS
        j = j0 + jj
        s = gl.where(((j >= lo) & (j < hi))[None, :], s * qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
        stats.index(2 * X).store(m_new)
        stats.index(2 * X + 1).store(gl.exp2(m_i - m_safe))
        stats.index(4 + X).store(gl.sum(p, 1))
        m_i = m_new
        if (lo > j0) | (hi < j0 + KEYS):  # value rows this token may not see (NaN allowed there): zeroed
            keep = ((j0 + rows_ld) >= lo) & ((j0 + rows_ld) < hi)
            for c in gl.static_range(DV // 64):
                part = kn_s.index(b * 2 + c // (H // 64)).slice((c % (H // 64)) * 64, 64, dim=1)
                tile = part.load(ld_layout)
                part.store(gl.where(keep[:, None], tile, gl.zeros_like(tile)))
        kr_s.index(b).store(p.to(dtype))  # (P over the rope part: the scores were its only reader)
        fence_async_shared()
        mbarrier.arrive(pdone.index(X))
        if t > 0:
            acc, l_i = _values(acc, l_i, t - 1, row1, kn_s, kr_s, stats, pdone, pvdone, rdy, kn_desc, kr_desc,
                               n_tiles, X, False, DV, row_o, row_s)
        acc, l_i = _values(acc, l_i, t, row2, kn_s, kr_s, stats, pdone, pvdone, rdy, kn_desc, kr_desc, n_tiles, X,
                           True, DV, row_o, row_s)
    last = n_tiles - 1
    if (last >= 0) & (last % 2 != X):  # the other warpgroup's last tile (nothing left to fetch: row 0)
        acc, l_i = _values(acc, l_i, last, 0, kn_s, kr_s, stats, pdone, pvdone, rdy, kn_desc, kr_desc, n_tiles, X,
                           False, DV, row_o, row_s)
        m_i = stats.index(2 * (1 - X)).load(row_s)
    rows_o = out_row + gl.arange(0, 64, layout=row_o)
    cols_o = X * H + gl.arange(0, H, layout=gl.SliceLayout(0, o_layout))
    if FINAL:  # (one split: the rows normalized in acc's dtype)
        o = acc * gl.convert_layout(1.0 / gl.where(l_i > 0, l_i, 1.0), row_o)[:, None]  # (64 divisions)
        gl.store(acc_ptr + rows_o[:, None] * DV + cols_o[None, :], o.to(acc_ptr.dtype.element_ty))
    else:
        gl.store(acc_ptr + rows_o[:, None] * DV + cols_o[None, :], acc)
        if X == 0:
            rows_s = out_row + gl.arange(0, 64, layout=row_s)
            gl.store(m_ptr + rows_s, m_i * (1.0 / LOG2E))
            gl.store(l_ptr + rows_s, l_i)


@gluon.jit
def mla_gluon_pp_kernel(q_ptr, k_ptr, kn_desc, kr_desc, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr,
                        m_ptr, l_ptr, scale, splits, sq_t, sq_h, sk_t,
                        HQ: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, BS: gl.constexpr, KEYS: gl.constexpr,
                        SLICE: gl.constexpr, SELF: gl.constexpr, REGS: gl.constexpr, FINAL: gl.constexpr,
                        num_warps: gl.constexpr):
    """`mla_gluon.mla_gluon_kernel`'s arguments, the latent descriptor in `[KEYS, DV // 2]` boxes
    (`mla_gluon.cache_descriptors(..., halves=True)`); 4 warps here (warpgroup 0), one worker warpgroup more."""
    gl.static_assert(num_warps == 4)
    gl.static_assert(DR == KEYS)  # (P is written over a tile's rope part)
    hg = gl.program_id(0)
    sp = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)
    first, k_begin, n_tiles = _split_tiles(starts_ptr, t, sp, splits, BS, KEYS)

    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = kn_desc.dtype
    H: gl.constexpr = DV // 2
    qn_s = gl.allocate_shared_memory(dtype, [2, 64, H], gl.NVMMASharedLayout.get_default_for([64, H], gl.bfloat16))
    qr_s = gl.allocate_shared_memory(dtype, [64, DR], gl.NVMMASharedLayout.get_default_for([64, DR], gl.bfloat16))
    kn_s = gl.allocate_shared_memory(dtype, [4, KEYS, H], kn_desc.layout)  # (buffer b, half h: index 2 b + h)
    kr_s = gl.allocate_shared_memory(dtype, [2, KEYS, DR], kr_desc.layout)
    stats = gl.allocate_shared_memory(gl.float32, [7, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    rdy = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())  # (buffer b, part c: 3 b + c)
    pdone = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pvdone = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(6):
        mbarrier.init(rdy.index(b), count=1)
    for b in gl.static_range(2):
        mbarrier.init(pdone.index(b), count=1)
        mbarrier.init(pvdone.index(b), count=1)
    fence_async_shared()
    for b in gl.static_range(2):  # the first two tiles fly while the query is staged
        if b < n_tiles:
            row = _meta(b, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)[2]
            for c in gl.static_range(3):
                _fetch(c, row, b, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)

    heads = hg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ld_layout))
    q_row = q_ptr + t * sq_t + heads[:, None] * sq_h
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, ld_layout))
    qk = scale * LOG2E
    k_row = k_ptr + t * sk_t
    self_on = SELF & (sp == 0)
    s_self = gl.zeros([64], gl.float32, gl.SliceLayout(1, ld_layout))
    for c in gl.static_range((DV + DR) // 64):  # the query staged 64 columns at a time (few registers)
        q = gl.load(q_row + c * 64 + cols[None, :])
        if c * 64 < DV:
            qn_s.index(c // (H // 64)).slice((c % (H // 64)) * 64, 64, dim=1).store(q)
        else:
            qr_s.slice(c * 64 - DV, 64, dim=1).store(q)
        kc = gl.load(k_row + c * 64 + cols, mask=self_on, other=0.0).to(gl.float32)
        s_self += gl.sum(q.to(gl.float32) * kc[None, :], 1)
    s_self = s_self * qk
    stats.index(6).store(gl.where(self_on, s_self, float("-inf")))
    l0 = gl.where(self_on, 1.0, 0.0)
    fence_async_shared()
    gl.thread_barrier()
    out_row = (t * splits + sp) * HQ + hg * 64
    gl.warp_specialize([(_consumer, (qn_s, qr_s, kn_s, kr_s, stats, rdy, pdone, pvdone, kn_desc, kr_desc, n_tiles,
                                     k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr,
                                     out_row, qk, l0, k_row, self_on, gl.constexpr(0), DV, BS, KEYS, SLICE, FINAL)),
                        (_consumer, (qn_s, qr_s, kn_s, kr_s, stats, rdy, pdone, pvdone, kn_desc, kr_desc, n_tiles,
                                     k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr,
                                     out_row, qk, l0, k_row, self_on, gl.constexpr(1), DV, BS, KEYS, SLICE, FINAL))],
                       [4], [REGS])
