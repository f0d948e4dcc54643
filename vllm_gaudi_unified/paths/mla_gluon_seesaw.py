"""MLA's Gluon kernel with FlashMLA's "seesaw" schedule (`MLA_GLUON_SEESAW`, the default on Hopper where its shapes
allow; docs/benchmarks.md, MLA).

Why: the one-stream kernel (`mla_gluon.py`) runs each tile's softmax in series with its products (one `[64, 512]`
fp32 accumulator per SM leaves no room for two: 0.35 ms at 128 x 4096, 1.73x the HBM floor), and a ping-pong that
overlapped them (measured and removed) waited on every tile's fetch: each warpgroup could refetch its half of a
buffer only after its product on it, the last thing it did before it needed the next tile. FlashMLA's answer
(0.289 ms, 1.43x): tiles in pairs, warpgroup 0 owning the even tile and the left half of the value columns,
warpgroup 1 the odd tile and the right half, the running maximum flowing even -> odd within the pair:

    [0] S0 = q K0^T; m0 = max(m, rowmax S0); a0 = e^(m - m0); P0 = e^(S0 - m0); O_L = O_L a0 + P0 V0_L
    [1] S1 = q K1^T; O_R = O_R a0 + P0 V0_R; m1 = max(m0, rowmax S1); a1 = e^(m0 - m1); P1 = e^(S1 - m1);
        O_R = O_R a1 + P1 V1_R
    [0] O_L = O_L a1 + P1 V1_L

So one warpgroup's softmax runs under the other's products. Warpgroup 0 multiplies its own P0 from registers
(`wgmma` with A in registers) before P1; warpgroup 1 multiplies P0 (through a buffer of its own) behind its scores,
under its softmax, then its own P1 from registers. The even tile's parts are refetched early (the rope part right
after its scores, the left half after [0]'s product, the right half after [1]'s P0 product), so warpgroup 0 never
waits for its next tile; the odd tile's come at the pair's end (P1 lies over its rope part until [0]'s product),
while warpgroup 1 first waits for [0]'s softmax anyway. A tile's three parts arrive by TMA with a barrier each,
each warpgroup's scores taking them in the order they were fetched; the statistics pass through shared memory
under two mbarriers (m0 and P0 ready, P1 ready; P0's buffer is free once [1]'s product on it is done, before
it signals P1). Same contract and NaN rule as `mla_gluon.py` (invisible rows: -inf scores, value rows zeroed by
the tile's owner before its P is published); covered: 16-bit, 64-head groups, DV 128-512, DR = KEYS = 64.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

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
def _softmax(s, m_i, lo, hi, j0, qk, jj):
    """The tile's scores masked to its visible rows (log2 units): the new running max, the old terms' scale
    `e^(m_i - m_new)` and P (0 and 0 for a row that has seen nothing)."""
    j = j0 + jj
    s = gl.where(((j >= lo) & (j < hi))[None, :], s * qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, gl.exp2(m_i - m_safe), gl.exp2(s - m_safe[:, None])


@gluon.jit
def _zero_unseen(kn_s, b, lo, hi, j0, rows_ld, ld_layout: gl.constexpr, DV: gl.constexpr, KEYS: gl.constexpr):
    """Buffer b's value rows the token may not see (NaN allowed there) set to 0, in both halves."""
    if (lo > j0) | (hi < j0 + KEYS):
        keep = ((j0 + rows_ld) >= lo) & ((j0 + rows_ld) < hi)
        for c in gl.static_range(DV // 64):
            part = kn_s.index(b * 2 + c // (DV // 128)).slice((c % (DV // 128)) * 64, 64, dim=1)
            tile = part.load(ld_layout)
            part.store(gl.where(keep[:, None], tile, gl.zeros_like(tile)))


@gluon.jit
def _warpgroup(qn_s, qr_s, kn_s, kr_s, p0_s, stats, rdy, bars, kn_desc, kr_desc, n_tiles, k_begin, first, order_ptr,
               ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, out_row, qk, l0, k_row, self_on, drafts_seen, sk_t,
               out_ptr, fin_row, X: gl.constexpr, DV: gl.constexpr, BS: gl.constexpr, KEYS: gl.constexpr,
               SLICE: gl.constexpr, FINAL: gl.constexpr, UNITS: gl.constexpr, ONE: gl.constexpr):
    """Warpgroup X of the seesaw (module docstring): tiles 2j + X, value columns half X. `bars`: m0 and P0 ready,
    P1 ready; `stats`: m0, a0, rowsum P0, m1, a1, rowsum P1, the own pair's score (with `UNITS` > 1: the max of the
    new keys' scores, then the weight of key t - j, j < UNITS; `drafts_seen` of them)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DV // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
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
    if UNITS > 1:  # the own pair and the earlier drafts, weighted against their max
        acc = gl.zeros([64, H], gl.float32, o_layout)
        l_i = gl.zeros([64], gl.float32, row_s)
        for j in gl.static_range(UNITS):
            kn = gl.load(k_row - j * sk_t + cols, mask=(cols < DV) & (j < drafts_seen), other=0.0).to(gl.float32)
            w = stats.index(7 + j).load(row_s)
            l_i += w
            acc += gl.convert_layout(w, row_o)[:, None] * kn[None, :]
    jj = gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    rows_ld = gl.arange(0, KEYS, layout=gl.SliceLayout(1, ld_layout))
    for t0 in range(0, n_tiles, 2):
        ph = (t0 // 2) & 1
        t1 = t0 + 1
        has1 = t1 < n_tiles
        b0 = t0 % 2  # (== 0 and 1: from the loop counter, so that the operands' descriptors stay in the loop)
        b1 = t1 % 2
        mine = t0 + X
        b = mine % 2
        lo, hi, _ = _meta(mine, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)
        row_next = _meta(mine + 2, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS, SLICE)[2]
        row_other = _meta(t0 + 3 - X, n_tiles, k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, BS, KEYS,
                          SLICE)[2]  # (the other tile of the next pair: warpgroup X fetches part of it)
        if X == 0:
            s = gl.zeros([64, KEYS], gl.float32, s_layout)
        else:  # (kept in flight behind P0's product)
            s = warpgroup_mma_init(gl.zeros([64, KEYS], gl.float32, s_layout))
        # (indices from b == X, not X: operands' descriptors computed in the loop, not held in registers across it)
        if mine < n_tiles:  # the scores, the parts in the order they were fetched: own half, then ...
            mbarrier.wait(rdy.index(b * 3 + b), ph)
            s = warpgroup_mma(qn_s.index(b), kn_s.index(b * 3).permute((1, 0)),
                              gl.zeros([64, KEYS], gl.float32, s_layout), use_acc=False, is_async=True)
            if X == 0:  # ... the rope part (refetched right after the scores), the other half (after [1]'s product)
                mbarrier.wait(rdy.index(b * 3 + 2), ph)
                s = warpgroup_mma(qr_s, kr_s.index(b).permute((1, 0)), s, is_async=True)
                mbarrier.wait(rdy.index(b * 2 + 1), ph)
                s = warpgroup_mma(qn_s.index(1 - b), kn_s.index(b + 1).permute((1, 0)), s, is_async=True)
            else:  # ... the other half and the rope part (both refetched after [0]'s last product)
                mbarrier.wait(rdy.index(b * 2 + 1), ph)
                s = warpgroup_mma(qn_s.index(1 - b), kn_s.index(b + 1).permute((1, 0)), s, is_async=True)
                mbarrier.wait(rdy.index(b * 3 + 2), ph)
                s = warpgroup_mma(qr_s, kr_s.index(b).permute((1, 0)), s, is_async=True)
            if X == 0:
                s = warpgroup_mma_wait(0, deps=(s, ))
        j0 = (k_begin + mine * KEYS) % BS
        if X == 0:
            if t0 + 2 < n_tiles:  # the rope part's only reader was the scores
                _fetch(2, row_next, b, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
            m0, a0, p0 = _softmax(s, m_i, lo, hi, j0, qk, jj)
            sum0 = gl.sum(p0, 1)
            pa = p0.to(dtype)
            p0_s.index(b).store(pa)
            stats.index(0).store(m0)
            stats.index(1).store(a0)
            stats.index(2).store(sum0)
            _zero_unseen(kn_s, b, lo, hi, j0, rows_ld, ld_layout, DV, KEYS)
            fence_async_shared()
            mbarrier.arrive(bars.index(0))
            acc = acc * gl.convert_layout(a0, row_o)[:, None]
            pa = gl.convert_layout(pa, p_layout)
            pv = warpgroup_mma(pa, kn_s.index(b * 2), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(pv, pa))[0]
            if t0 + 2 < n_tiles:  # (the left half's last reader: this product)
                _fetch(0, row_next, b, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
            l_i = l_i * a0 + sum0
            m_i = m0
            if has1:
                mbarrier.wait(bars.index(1), ph)
                m_i = stats.index(3).load(row_s)
                a1 = stats.index(4).load(row_s)
                l_i = l_i * a1 + stats.index(5).load(row_s)
                acc = acc * gl.convert_layout(a1, row_o)[:, None]
                pv = warpgroup_mma(kr_s.index(b1), kn_s.index(b1 * 2), acc, is_async=True)  # (P1 over its rope part)
                acc = warpgroup_mma_wait(0, deps=(pv, ))
                if t1 + 2 < n_tiles:  # (the odd tile's left half and rope part: last read by this product)
                    _fetch(0, row_other, b1, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
                    _fetch(2, row_other, b1, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
        else:
            mbarrier.wait(bars.index(0), ph)
            m_i = stats.index(0).load(row_s)
            a0 = stats.index(1).load(row_s)
            l_i = l_i * a0 + stats.index(2).load(row_s)
            acc = acc * gl.convert_layout(a0, row_o)[:, None]
            pv = warpgroup_mma(p0_s.index(b0), kn_s.index(b0 * 2 + 1), acc, is_async=True)  # (P0, behind the scores)
            if has1:
                s1 = warpgroup_mma_wait(1, deps=(s, ))  # (the scores done, P0's product still running)
                m1, a1, p1 = _softmax(s1, m_i, lo, hi, j0, qk, jj)
                sum1 = gl.sum(p1, 1)
                _zero_unseen(kn_s, b, lo, hi, j0, rows_ld, ld_layout, DV, KEYS)
                pa = p1.to(dtype)
                kr_s.index(b).store(pa)  # (P1 over the tile's rope part: the scores were its only reader)
                stats.index(3).store(m1)
                stats.index(4).store(a1)
                stats.index(5).store(sum1)
                acc = warpgroup_mma_wait(0, deps=(pv, ))  # (P0's buffer free before [0] may write the next P0)
                fence_async_shared()
                mbarrier.arrive(bars.index(1))
                if t0 + 2 < n_tiles:  # (the even tile's right half: last read by P0's product)
                    _fetch(1, row_other, b0, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
                acc = acc * gl.convert_layout(a1, row_o)[:, None]
                pa = gl.convert_layout(pa, p_layout)
                pv = warpgroup_mma(pa, kn_s.index(b * 2 + 1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(pv, pa))[0]
                if t1 + 2 < n_tiles:  # (the right half's last reader: this product)
                    _fetch(1, row_next, b, kn_desc, kr_desc, kn_s, kr_s, rdy, DV)
                l_i = l_i * a1 + sum1
                m_i = m1
            else:
                acc = warpgroup_mma_wait(0, deps=(pv, ))
    rows_o = out_row + gl.arange(0, 64, layout=row_o)
    if FINAL:  # (one split: the rows normalized in acc's dtype)
        o = acc * gl.convert_layout(1.0 / gl.where(l_i > 0, l_i, 1.0), row_o)[:, None]  # (64 divisions)
        gl.store(acc_ptr + rows_o[:, None] * DV + cols[None, :], o.to(acc_ptr.dtype.element_ty))
    else:
        write = (n_tiles > 0) | self_on  # (a split past its token's keys: its merge reads max -inf and sum 0 only)
        if ONE:  # (`ONE_KEYS`: a token whose keys are one split has its rows normalized here, row `fin_row`)
            write = write & (fin_row < 0)
            if fin_row >= 0:
                rows_f = fin_row + gl.arange(0, 64, layout=row_o)
                o = acc * gl.convert_layout(1.0 / gl.where(l_i > 0, l_i, 1.0), row_o)[:, None]
                gl.store(out_ptr + rows_f[:, None] * DV + cols[None, :], o.to(out_ptr.dtype.element_ty))
        if write:
            gl.store(acc_ptr + rows_o[:, None] * DV + cols[None, :], acc)
        if X == 0:
            rows_s = out_row + gl.arange(0, 64, layout=row_s)
            gl.store(m_ptr + rows_s, m_i * (1.0 / LOG2E))
            gl.store(l_ptr + rows_s, l_i)


@gluon.jit
def mla_gluon_seesaw_kernel(q_ptr, k_ptr, kn_desc, kr_desc, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr,
                            m_ptr, l_ptr, scale, splits, sq_t, sq_h, sk_t,
                            HQ: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, BS: gl.constexpr,
                            KEYS: gl.constexpr, SLICE: gl.constexpr, SELF: gl.constexpr, REGS: gl.constexpr,
                            FINAL: gl.constexpr, seg_ptr, UNITS: gl.constexpr, UNIT_ROWS: gl.constexpr,
                            num_warps: gl.constexpr, tok_ptr=None, TOKENS: gl.constexpr = False,
                            SPLIT_KEYS: gl.constexpr = 0, out_ptr=None, ONE_KEYS: gl.constexpr = 0):
    """`mla_gluon.mla_gluon_kernel`'s arguments (`FINAL` too), the latent descriptor in `[KEYS, DV // 2]` boxes
    (`mla_gluon.cache_descriptors(..., halves=True)`); 4 warps here (warpgroup 0), one worker warpgroup more.
    `UNITS` > 1 (with `SELF`: a verify step's drafts, `mla_kernel._mla_body`'s): split 0 of token t also takes the
    new keys `t - UNITS + 1 .. t - 1` from `seg[t]` (its request's first new token) on; `UNIT_ROWS`: token t
    reads the slots of row `seg[t]`. `TOKENS`, `SPLIT_KEYS` (the batch-invariant mode, `mla_invariant.py`): as
    `mla_kernel._mla_body`'s, program i takes token `tok[i]` and writes Partial row i, its splits position-fixed;
    `ONE_KEYS` (with them): a token of at most that many keys is one split, whose rows go normalized into token
    `tok[i]`'s row of `out_ptr` `[n, HQ, DV]` (no Partial row), a function of the token's own keys."""
    gl.static_assert(num_warps == 4)
    gl.static_assert(DR == KEYS)  # (P1 is written over its tile's rope part)
    hg = gl.program_id(0)
    sp = gl.program_id(1)
    i = gl.program_id(2).to(gl.int64)
    t = i
    if TOKENS:
        t = gl.load(tok_ptr + i).to(gl.int64)
    r = t
    if UNIT_ROWS:
        r = gl.load(seg_ptr + t).to(gl.int64)
    first, k_begin, n_tiles = _split_tiles(starts_ptr, r, sp, splits, BS, KEYS, SPLIT_KEYS, ONE_KEYS)
    fin_row = t  # (unread without ONE_KEYS)
    if ONE_KEYS > 0:
        one = (gl.load(starts_ptr + r + 1) - first).to(gl.int32) * BS <= ONE_KEYS
        fin_row = gl.where(one & (sp == 0), t * HQ + hg * 64, -1)

    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = kn_desc.dtype
    H: gl.constexpr = DV // 2
    qn_s = gl.allocate_shared_memory(dtype, [2, 64, H], gl.NVMMASharedLayout.get_default_for([64, H], gl.bfloat16))
    qr_s = gl.allocate_shared_memory(dtype, [64, DR], gl.NVMMASharedLayout.get_default_for([64, DR], gl.bfloat16))
    kn_s = gl.allocate_shared_memory(dtype, [4, KEYS, H], kn_desc.layout)  # (buffer b, half h: index 2 b + h)
    kr_s = gl.allocate_shared_memory(dtype, [2, KEYS, DR], kr_desc.layout)
    p0_s = gl.allocate_shared_memory(dtype, [1, 64, KEYS], kr_desc.layout)  # (index 0 from the loop counter)
    stats = gl.allocate_shared_memory(gl.float32, [7 + UNITS * (UNITS > 1), 64],  # (UNITS 3: 232244 of 232448 B)
                                      gl.SwizzledSharedLayout(1, 1, 1, [0]))
    rdy = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())  # (buffer b, part c: 3 b + c)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(6):
        mbarrier.init(rdy.index(b), count=1)
    for b in gl.static_range(2):
        mbarrier.init(bars.index(b), count=1)
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
    gl.static_assert(UNITS <= 3)  # (the statistics in shared memory: 1 + 3 passes sm_90's 227 KB)
    drafts_seen = gl.where(self_on, 1, 0)
    if UNITS > 1:  # the token's own key and its request's earlier new keys, 1 + 1 or 1 + 2 of them
        drafts_seen = gl.where(self_on, gl.minimum(t - gl.load(seg_ptr + t) + 1, UNITS), 0)
    s_self = gl.zeros([64], gl.float32, gl.SliceLayout(1, ld_layout))
    s_1 = gl.zeros([64], gl.float32, gl.SliceLayout(1, ld_layout))
    s_2 = gl.zeros([64], gl.float32, gl.SliceLayout(1, ld_layout))
    for c in gl.static_range((DV + DR) // 64):  # the query staged 64 columns at a time (few registers)
        q = gl.load(q_row + c * 64 + cols[None, :])
        if c * 64 < DV:
            qn_s.index(c // (H // 64)).slice((c % (H // 64)) * 64, 64, dim=1).store(q)
        else:
            qr_s.slice(c * 64 - DV, 64, dim=1).store(q)
        qf = q.to(gl.float32)
        kc = gl.load(k_row + c * 64 + cols, mask=self_on, other=0.0).to(gl.float32)
        s_self += gl.sum(qf * kc[None, :], 1)
        if UNITS > 1:
            kc = gl.load(k_row - sk_t + c * 64 + cols, mask=1 < drafts_seen, other=0.0).to(gl.float32)
            s_1 += gl.sum(qf * kc[None, :], 1)
        if UNITS > 2:
            kc = gl.load(k_row - 2 * sk_t + c * 64 + cols, mask=2 < drafts_seen, other=0.0).to(gl.float32)
            s_2 += gl.sum(qf * kc[None, :], 1)
    m_self = gl.where(self_on, s_self * qk, float("-inf"))
    l0 = gl.where(self_on, 1.0, 0.0)
    if UNITS > 1:  # each new key's weight against their max (log2 units), for `_warpgroup`
        s_1 = gl.where(1 < drafts_seen, s_1 * qk, float("-inf"))
        s_2 = gl.where(2 < drafts_seen, s_2 * qk, float("-inf"))
        m_new = gl.maximum(m_self, s_1)
        if UNITS > 2:
            m_new = gl.maximum(m_new, s_2)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        stats.index(7).store(gl.where(self_on, gl.exp2(m_self - m_safe), 0.0))
        stats.index(8).store(gl.exp2(s_1 - m_safe))
        if UNITS > 2:
            stats.index(9).store(gl.exp2(s_2 - m_safe))
        m_self = m_new
    stats.index(6).store(m_self)
    fence_async_shared()
    gl.thread_barrier()
    o = i  # (i == t but with TOKENS: its Partial rows are row i's, its FINAL rows token t's)
    if FINAL:
        o = t
    out_row = (o * splits + sp) * HQ + hg * 64
    gl.warp_specialize([(_warpgroup, (qn_s, qr_s, kn_s, kr_s, p0_s, stats, rdy, bars, kn_desc, kr_desc, n_tiles,
                                      k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr,
                                      out_row, qk, l0, k_row, self_on, drafts_seen, sk_t, out_ptr, fin_row,
                                      gl.constexpr(0), DV, BS, KEYS, SLICE, FINAL, UNITS, ONE_KEYS > 0)),
                        (_warpgroup, (qn_s, qr_s, kn_s, kr_s, p0_s, stats, rdy, bars, kn_desc, kr_desc, n_tiles,
                                      k_begin, first, order_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr,
                                      out_row, qk, l0, k_row, self_on, drafts_seen, sk_t, out_ptr, fin_row,
                                      gl.constexpr(1), DV, BS, KEYS, SLICE, FINAL, UNITS, ONE_KEYS > 0))],
                       [4], [REGS])
