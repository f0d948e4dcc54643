"""MLA's Gluon kernel with FlashMLA's ping-pong: warp-specialised, the two warpgroups on alternate key tiles.

Why (docs/benchmarks.md, MLA, run 10): in `mla_gluon.py` both warpgroups run one instruction stream, so the
tensor cores wait through every softmax and barrier (41 % busy on an H100). Here (`gl.warp_specialize`):

* a producer (the kernel's own 4 warps, the registers the consumers leave) loads key tiles by TMA into two
  buffers (tile t into buffer t % 2) once both warpgroups are done with the buffer's previous tile;
* warpgroup 0 owns the even tiles, warpgroup 1 the odd ones: each computes its tile's whole `[64, 64]` scores
  (no split of the tile, `N = 64` per `wgmma`), while the other is in its softmax or values product;
* the running maximum passes from tile to tile through shared memory (tile t's softmax needs tile t - 1's
  maximum), with the tile's probabilities (bf16, written over its rope part, which only the scores read),
  its rescale factors and row sums; an mbarrier per buffer says they are there;
* each warpgroup owns half of the 512 value columns of the fp32 accumulator (128 registers per thread) and
  multiplies every tile's probabilities, its own and the other's, by its half of the tile, in tile order.

`PRODUCER_WARPS` 1 makes consumer 0 the default partition and the producer one worker warp (run 13: Triton 3.6
still pads the kernel to 12 warps, so the consumers gain no registers; 98 spill instructions, 0.519 ms against
0.466 ms with the 4-warp producer: kept off, `mla_decode.MLA_GLUON_WS_PRODUCER_WARPS`).

Same contract, rows a token may not see handled as in `mla_gluon.py` (scores -inf, the value rows zeroed
by the tile's owner before its barrier). Covered: 16-bit, 64-head groups, DV 512 (or 128/256), DR = KEYS = 64.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from vllm_gaudi_unified.paths.mla_gluon import LOG2E, _meta


@gluon.jit
def _producer(kn_desc, kr_desc, kn_s, kr_s, ready, free, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr,
              hi_ptr, BS: gl.constexpr, KEYS: gl.constexpr, SLICE: gl.constexpr):
    """Tile t into buffer t % 2 once both warpgroups released its tile t - 2."""
    for t in range(n_tiles):
        b = t % 2
        if t >= 2:
            mbarrier.wait(free.index(b), ((t - 2) // 2) & 1)
        row = _meta(t, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)[2]
        bar = ready.index(b)
        mbarrier.expect(bar, kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kn_desc, [row, 0], bar, kn_s.index(b))
        tma.async_copy_global_to_shared(kr_desc, [row, 0], bar, kr_s.index(b))


@gluon.jit
def _values(acc, l_i, t, kn_s, kr_s, stats, pdone, free, X: gl.constexpr, DV: gl.constexpr,
            row_o: gl.constexpr, row_s: gl.constexpr):
    """Tile t's values product on this warpgroup's half of the columns, after its owner's barrier."""
    b = t % 2
    mbarrier.wait(pdone.index(b), (t // 2) & 1)
    alpha = stats.index(2 * b + 1).load(row_s)
    l_i = l_i * alpha + stats.index(4 + b).load(row_s)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    pv = warpgroup_mma(kr_s.index(b), kn_s.index(b).slice(X * (DV // 2), DV // 2, dim=1), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(pv, ))
    mbarrier.arrive(free.index(b))
    return acc, l_i


@gluon.jit
def _consumer(qn_s, qr_s, kn_s, kr_s, stats, ready, free, pdone, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr,
              hi_ptr, acc_ptr, m_ptr, l_ptr, out_row, qk, l0, k_row, self_on,
              X: gl.constexpr, DV: gl.constexpr, BS: gl.constexpr, KEYS: gl.constexpr, SLICE: gl.constexpr):
    """Warpgroup X: the scores and softmax of tiles X, X + 2, ...; the values product of every tile on its half."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DV // 2, 16])
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = qn_s.dtype
    cols = X * (DV // 2) + gl.arange(0, DV // 2, layout=gl.SliceLayout(0, o_layout))
    kn = gl.load(k_row + cols, mask=(cols < DV) & self_on, other=0.0).to(gl.float32)
    acc = gl.zeros([64, DV // 2], gl.float32, o_layout) + kn[None, :]  # (the own pair: weight 1, or nothing)
    m_i = stats.index(6).load(row_s)  # (the own pair's score, or -inf)
    l_i = gl.zeros([64], gl.float32, row_s) + l0
    jj = gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    rows_ld = gl.arange(0, KEYS, layout=gl.SliceLayout(1, ld_layout))
    for t in range(X, n_tiles, 2):
        b = t % 2
        kn_t = kn_s.index(b)
        lo, hi, _ = _meta(t, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)
        mbarrier.wait(ready.index(b), (t // 2) & 1)
        s = warpgroup_mma(qn_s, kn_t.permute((1, 0)), gl.zeros([64, KEYS], gl.float32, s_layout), use_acc=False,
                          is_async=True)
        s = warpgroup_mma(qr_s, kr_s.index(b).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if t > 0:  # the running maximum after tile t - 1 (the other warpgroup's)
            mbarrier.wait(pdone.index(1 - b), ((t - 1) // 2) & 1)
            m_i = stats.index(2 * (1 - b)).load(row_s)
        j0 = (k_begin + t * KEYS) % BS
        j = j0 + jj
        s = gl.where(((j >= lo) & (j < hi))[None, :], s * qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
        stats.index(2 * b).store(m_new)
        stats.index(2 * b + 1).store(gl.exp2(m_i - m_safe))
        stats.index(4 + b).store(gl.sum(p, 1))
        m_i = m_new
        if (lo > j0) | (hi < j0 + KEYS):  # value rows this token may not see (NaN allowed there): zeroed
            keep = ((j0 + rows_ld) >= lo) & ((j0 + rows_ld) < hi)
            for c in gl.static_range(DV // 64):
                part = kn_t.slice(c * 64, 64, dim=1)
                tile = part.load(ld_layout)
                part.store(gl.where(keep[:, None], tile, gl.zeros_like(tile)))
        kr_s.index(b).store(p.to(dtype))  # (P over the rope part: the scores were its only reader)
        fence_async_shared()
        mbarrier.arrive(pdone.index(b))
        if t > 0:
            acc, l_i = _values(acc, l_i, t - 1, kn_s, kr_s, stats, pdone, free, X, DV, row_o, row_s)
        acc, l_i = _values(acc, l_i, t, kn_s, kr_s, stats, pdone, free, X, DV, row_o, row_s)
    last = n_tiles - 1
    if (last >= 0) & (last % 2 != X):  # the other warpgroup's last tile
        acc, l_i = _values(acc, l_i, last, kn_s, kr_s, stats, pdone, free, X, DV, row_o, row_s)
        m_i = stats.index(2 * (last % 2)).load(row_s)
    rows_o = out_row + gl.arange(0, 64, layout=row_o)
    cols_o = X * (DV // 2) + gl.arange(0, DV // 2, layout=gl.SliceLayout(0, o_layout))  # (not kept live: registers)
    gl.store(acc_ptr + rows_o[:, None] * DV + cols_o[None, :], acc)
    if X == 0:
        rows_s = out_row + gl.arange(0, 64, layout=row_s)
        gl.store(m_ptr + rows_s, m_i * (1.0 / LOG2E))
        gl.store(l_ptr + rows_s, l_i)


@gluon.jit
def mla_gluon_ws_kernel(q_ptr, k_ptr, kn_desc, kr_desc, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr,
                        m_ptr, l_ptr, scale, splits, sq_t, sq_h, sk_t,
                        HQ: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, BS: gl.constexpr, KEYS: gl.constexpr,
                        SLICE: gl.constexpr, SELF: gl.constexpr, REGS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr,
                        num_warps: gl.constexpr):
    """`mla_gluon.mla_gluon_kernel`'s arguments; 4 warps here (the producer), two warpgroups more (the consumers)."""
    gl.static_assert(num_warps == 4)
    gl.static_assert(DR == KEYS)  # (P is written over a tile's rope part)
    hg = gl.program_id(0)
    sp = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)
    first = gl.load(starts_ptr + t)
    n_keys = (gl.load(starts_ptr + t + 1) - first).to(gl.int32) * BS
    per_split = gl.cdiv(n_keys, splits * KEYS) * KEYS
    k_begin = sp * per_split
    n_tiles = gl.maximum(gl.cdiv(gl.minimum(n_keys, k_begin + per_split) - k_begin, KEYS), 0)

    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = kn_desc.dtype
    qn_s = gl.allocate_shared_memory(dtype, [64, DV], gl.NVMMASharedLayout.get_default_for([64, DV], gl.bfloat16))
    qr_s = gl.allocate_shared_memory(dtype, [64, DR], gl.NVMMASharedLayout.get_default_for([64, DR], gl.bfloat16))
    kn_s = gl.allocate_shared_memory(dtype, [2, KEYS, DV], kn_desc.layout)
    kr_s = gl.allocate_shared_memory(dtype, [2, KEYS, DR], kr_desc.layout)
    stats = gl.allocate_shared_memory(gl.float32, [7, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pdone = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=1)
        mbarrier.init(free.index(b), count=2)
        mbarrier.init(pdone.index(b), count=1)

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
            qn_s.slice(c * 64, 64, dim=1).store(q)
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
    if PRODUCER_WARPS == 4:  # the producer is the default partition (the kernel's 4 warps, the registers left
        # over: 40), the two consumers the workers (their own warpgroups, REGS registers each)
        gl.warp_specialize([(_producer, (kn_desc, kr_desc, kn_s, kr_s, ready, free, n_tiles, k_begin, first,
                                         order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)),
                            (_consumer, (qn_s, qr_s, kn_s, kr_s, stats, ready, free, pdone, n_tiles, k_begin, first,
                                         order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, out_row, qk, l0,
                                         k_row, self_on, gl.constexpr(0), DV, BS, KEYS, SLICE)),
                            (_consumer, (qn_s, qr_s, kn_s, kr_s, stats, ready, free, pdone, n_tiles, k_begin, first,
                                         order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, out_row, qk, l0,
                                         k_row, self_on, gl.constexpr(1), DV, BS, KEYS, SLICE))], [4, 4], [REGS, REGS])
    else:  # consumer 0 is the default partition, the producer PRODUCER_WARPS worker warps (9 warps: ~224 each)
        gl.warp_specialize([(_consumer, (qn_s, qr_s, kn_s, kr_s, stats, ready, free, pdone, n_tiles, k_begin, first,
                                         order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, out_row, qk, l0,
                                         k_row, self_on, gl.constexpr(0), DV, BS, KEYS, SLICE)),
                            (_consumer, (qn_s, qr_s, kn_s, kr_s, stats, ready, free, pdone, n_tiles, k_begin, first,
                                         order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, out_row, qk, l0,
                                         k_row, self_on, gl.constexpr(1), DV, BS, KEYS, SLICE)),
                            (_producer, (kn_desc, kr_desc, kn_s, kr_s, ready, free, n_tiles, k_begin, first,
                                         order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE))],
                           [4, PRODUCER_WARPS], [REGS, PRODUCER_REGS])
