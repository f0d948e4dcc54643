"""MLA's unique path as one Triton kernel: a latent key tile read once, its first dims reused as the values.

Why (docs/benchmarks.md, MLA): in latent space every query head attends to
one latent head whose keys are `L + R` dims (512 + 64 at DeepSeek's shapes)
and whose values are the first `L` of them. The generic unique kernel takes
one head dim and all of a KV head's query heads in one program (128 x 1024
padded: far past a program's registers); the matmul tiles write one fp32
partial per block and head (`[blocks, 128, 512]`, twice the cache they read).
Here one program takes one (head group, split, token): it loads a tile of the
token's latents once as `[KEYS, L]` and `[KEYS, R]`, scores `q_nope . c +
q_pe . k_pe`, and multiplies the probabilities by the same `[KEYS, L]` tile
(V is never loaded again), with an online softmax over the token's slots
(sorted by token beforehand). The head groups of one (token, split) are
launched next to each other (grid axis 0), so the tile is read from HBM once
and from L2 by the others. Each (token, split) writes one `Partial` row; the
splits (a power of two) are merged by `merge.fold_pairwise`.

`SPLIT_V` cuts the latent in two halves (FlashMLA splits V between its two
warpgroups the same way): the tile is loaded as two `[KEYS, L/2]` parts and
the rope part, the scores are the sum of the three products, and two
`[heads, L/2]` accumulators take the values. `DESC` loads those parts
through tensor descriptors (Hopper's bulk tensor copies) built per tile over
the tile's slot, its visible rows only: a row outside them is out of the
descriptor's bounds and reads as zero from the copy engine, never from memory.

Only the slots a row may see are loaded (`lo <= slot < hi`): a NaN in an
unreadable slot is never read. Imported only where Triton is.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _part(ptr, offs, ok, rows_ok):
    """`ptr[:, offs]` for the rows in `rows_ok` and the columns in `ok`, zero elsewhere (nothing else read)."""
    return tl.load(ptr + offs[None, :], mask=rows_ok[:, None] & ok[None, :], other=0.0)


@triton.jit
def _own(q_row, k_row, offs, ok, h_ok, acc_dtype):
    """A token's own key over `offs` (`[D]`, acc dtype) and its score part per head (`[BLOCK_H]`)."""
    kn = tl.load(k_row + offs, mask=ok, other=0.0).to(acc_dtype)
    qn = _part(q_row, offs, ok, h_ok).to(acc_dtype)
    return kn, tl.sum(qn * kn[None, :], 1)


@triton.jit
def _step(start, k_end, first, q_row, c_ptr, order_ptr, ids_ptr, lo_ptr, hi_ptr, sc_b, sc_s, scale, h_ok,
          m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe,
          DV: tl.constexpr, DA: tl.constexpr, DV_PAD: tl.constexpr, DR: tl.constexpr, DR_PAD: tl.constexpr,
          BS: tl.constexpr, KEYS: tl.constexpr, SLICE: tl.constexpr, V_LOAD: tl.constexpr, ONE_SLOT: tl.constexpr,
          Q_LOOP: tl.constexpr, SPLIT_V: tl.constexpr, DESC: tl.constexpr):
    """One key tile `[start, start + KEYS)` of the token's keys folded into (m, l, acc_a[, acc_b])."""
    acc_dtype = acc_a.dtype
    kk = start + tl.arange(0, KEYS)
    key_ok = kk < k_end
    j = kk % BS
    if ONE_SLOT:  # KEYS divides BS: the tile lies in one slot, read as scalars (its rows are contiguous)
        slot = tl.load(order_ptr + first + start // BS)
        if SLICE:
            blk = slot
        else:
            blk = tl.load(ids_ptr + slot)
        lo = tl.load(lo_ptr + slot)
        hi = tl.load(hi_ptr + slot)
    else:
        slot = tl.load(order_ptr + first + kk // BS, mask=key_ok, other=0)
        if SLICE:
            blk = slot
        else:
            blk = tl.load(ids_ptr + slot, mask=key_ok, other=0)
        lo = tl.load(lo_ptr + slot, mask=key_ok, other=0)
        hi = tl.load(hi_ptr + slot, mask=key_ok, other=0)
    vis = key_ok & (j >= lo) & (j < hi)
    offs_a = tl.arange(0, DA)
    offs_r = tl.arange(0, DR_PAD)
    a_ok = offs_a < DV
    r_ok = offs_r < DR
    if Q_LOOP:  # the query read again each step (from L1/L2): it streams through shared memory
        q_a = _part(q_row, offs_a, a_ok, h_ok)
        q_pe = _part(q_row + DV, offs_r, r_ok, h_ok)
        if SPLIT_V:
            q_b = _part(q_row + DA, offs_a, (DA + offs_a) < DV, h_ok)
    base = blk.to(tl.int64) * sc_b + j * sc_s
    row = c_ptr + base[:, None]
    if SPLIT_V:
        if DESC:  # ONE_SLOT: the slot's visible rows [lo, hi) as a descriptor; the others read as zeros
            top = c_ptr + blk.to(tl.int64) * sc_b + lo * sc_s
            rows = tl.maximum(hi - lo, 1).to(tl.int32)
            at = tl.where(hi > lo, start % BS - lo, BS).to(tl.int32)  # (an empty slot: the whole box out of bounds)
            dv = tl.make_tensor_descriptor(top, shape=[rows, DV], strides=[sc_s, 1], block_shape=[KEYS, DA])
            dr = tl.make_tensor_descriptor(top + DV, shape=[rows, DR], strides=[sc_s, 1], block_shape=[KEYS, DR_PAD])
            c_a = dv.load([at, 0])
            c_b = dv.load([at, DA])
            k_pe = dr.load([at, 0])
        else:
            c_a = _part(row, offs_a, a_ok, vis)  # [KEYS, DA]
            c_b = _part(row + DA, offs_a, (DA + offs_a) < DV, vis)
            k_pe = _part(row + DV, offs_r, r_ok, vis)
        s = tl.dot(q_a, tl.trans(c_a))  # the three parts' products summed in one accumulator
        s = tl.dot(q_b, tl.trans(c_b), s)
        s = tl.dot(q_pe, tl.trans(k_pe), s).to(acc_dtype)
    else:
        if V_LOAD == 0:  # one load: the tile is the keys (transposed in registers) and the values
            c_a = _part(row, offs_a, a_ok, vis)  # [KEYS, DV_PAD]
            s = tl.dot(q_a, tl.trans(c_a)).to(acc_dtype)
        else:  # keys loaded transposed, values loaded again (from L1/L2): each load in its dot's layout
            c_t = tl.load(c_ptr + base[None, :] + offs_a[:, None], mask=vis[None, :] & a_ok[:, None], other=0.0)
            s = tl.dot(q_a, c_t).to(acc_dtype)
        k_pe = _part(row + DV, offs_r, r_ok, vis)
        s += tl.dot(q_pe, tl.trans(k_pe)).to(acc_dtype)
    # cast after scaling: under torch.compile a float argument is fp64 (the loop carries acc's dtype)
    s = tl.where(vis[None, :], (s * scale).to(acc_dtype), float("-inf"))  # [BLOCK_H, KEYS]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SPLIT_V:
        acc_a = tl.dot(p.to(c_a.dtype), c_a, acc_a * alpha[:, None])
        acc_b = tl.dot(p.to(c_b.dtype), c_b, acc_b * alpha[:, None])
    else:
        if V_LOAD != 0:
            c_a = _part(row, offs_a, a_ok, vis)  # [KEYS, DV_PAD]
        acc_a = acc_a * alpha[:, None] + tl.dot(p.to(c_a.dtype), c_a).to(acc_dtype)
    return m_new, l_i, acc_a, acc_b


def _mla_body(q_ptr, k_ptr, c_ptr, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, scale, splits,
              sq_t, sq_h, sk_t, sc_b, sc_s,
              HQ: tl.constexpr, BLOCK_H: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, DA: tl.constexpr,
              DR: tl.constexpr, DR_PAD: tl.constexpr, BS: tl.constexpr, KEYS: tl.constexpr, SLICE: tl.constexpr,
              V_LOAD: tl.constexpr,
              ONE_SLOT: tl.constexpr = False, Q_LOOP: tl.constexpr = False, SELF: tl.constexpr = False,
              SPLIT_V: tl.constexpr = False, DESC: tl.constexpr = False, LOOP_STAGES: tl.constexpr = 0,
              WS: tl.constexpr = False):
    """One (head group, split, token). q `[n, HQ, DV + DR]` (last stride 1), cache `[blocks, BS, DV + DR]`
    (strides `sc_b`, `sc_s`, last 1), `order`: slot ids sorted by token, `starts[t]:starts[t+1]` token
    t's part of it, `ids`: block id per slot (unless `SLICE`: slot = block id), `lo`/`hi` its visible
    slots. Out: acc `[n, splits, HQ, DV]`, m/l `[n, splits, HQ]` (fp32 or fp64: acc's dtype); the
    token's keys are cut into `splits` parts of whole `KEYS` tiles. `V_LOAD` 0: the latent tile is loaded
    once and serves both products; 1: loaded as keys transposed and again as values (the second read
    hits the cache; each load lands in its product's layout). `ONE_SLOT` (needs `BS % KEYS == 0`): a tile's
    slot, block and bounds are loaded once as scalars, not per key. `Q_LOOP`: the query tile is loaded in
    each loop step rather than held from the start (registers against reloads). `SELF`: the new tokens'
    keys `k` `[n, DV + DR]` (row stride `sk_t`, last 1): split 0 of token t starts from its own pair.
    `SPLIT_V` (with `V_LOAD` 0): the latent in two parts of `DA` columns (`DV_PAD // 2`, at least 16; without
    it `DA` is `DV_PAD`), two accumulators; `DESC` (with `SPLIT_V` and `ONE_SLOT`; `DV`, the strides and the
    cache 16-byte aligned): the parts through tensor descriptors over the slot's visible rows.
    `LOOP_STAGES` > 0: the key loop pipelined by `tl.range(num_stages=...)` (all its loads, not only the
    dots' operands), `WS` with it: Triton's warp specialisation of that loop."""
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)  # output offsets may pass 2**31
    first = tl.load(starts_ptr + t)
    n_keys = (tl.load(starts_ptr + t + 1) - first) * BS
    per_split = tl.cdiv(n_keys, splits * KEYS) * KEYS
    k_begin = sp * per_split
    k_end = tl.minimum(n_keys, k_begin + per_split)

    acc_dtype = acc_ptr.dtype.element_ty
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < HQ
    offs_a = tl.arange(0, DA)
    offs_b = DA + tl.arange(0, DA)
    offs_r = tl.arange(0, DR_PAD)
    a_ok = offs_a < DV
    b_ok = offs_b < DV
    r_ok = offs_r < DR
    q_row = q_ptr + t * sq_t + heads[:, None] * sq_h
    q_a = h_ok  # (placeholders: Q_LOOP loads the query in the loop; q_b is unused without SPLIT_V)
    q_b = h_ok
    q_pe = h_ok
    if not Q_LOOP:
        q_a = _part(q_row, offs_a, a_ok, h_ok)
        q_pe = _part(q_row + DV, offs_r, r_ok, h_ok)
        if SPLIT_V:
            q_b = _part(q_row, offs_b, b_ok, h_ok)
    m_i = tl.full([BLOCK_H], float("-inf"), acc_dtype)
    l_i = tl.zeros([BLOCK_H], acc_dtype)
    acc_a = tl.zeros([BLOCK_H, DA], acc_dtype)
    acc_b = tl.zeros([BLOCK_H, DA if SPLIT_V else 1], acc_dtype)  # (one unused column without SPLIT_V)
    if SELF:  # split 0 starts from the token's own key (weight 1 at its score): no separate self pair
        k_row = k_ptr + t * sk_t
        kn_a, s_self = _own(q_row, k_row, offs_a, a_ok, h_ok, acc_dtype)
        kr, s_pe = _own(q_row + DV, k_row + DV, offs_r, r_ok, h_ok, acc_dtype)
        s_self += s_pe
        if SPLIT_V:
            kn_b, s_b = _own(q_row, k_row, offs_b, b_ok, h_ok, acc_dtype)
            s_self += s_b
        here = sp == 0
        m_i = tl.where(here, (s_self * scale).to(acc_dtype), m_i)
        l_i = tl.where(here, 1.0, l_i).to(acc_dtype)
        acc_a = tl.where(here, acc_a + kn_a[None, :], acc_a)
        if SPLIT_V:
            acc_b = tl.where(here, acc_b + kn_b[None, :], acc_b)
    if LOOP_STAGES > 0:
        for start in tl.range(k_begin, k_end, KEYS, num_stages=LOOP_STAGES, warp_specialize=WS):
            m_i, l_i, acc_a, acc_b = _step(start, k_end, first, q_row, c_ptr, order_ptr, ids_ptr, lo_ptr, hi_ptr,
                                           sc_b, sc_s, scale, h_ok, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe,
                                           DV, DA, DV_PAD, DR, DR_PAD, BS, KEYS, SLICE, V_LOAD, ONE_SLOT, Q_LOOP,
                                           SPLIT_V, DESC)
    else:
        for start in range(k_begin, k_end, KEYS):
            m_i, l_i, acc_a, acc_b = _step(start, k_end, first, q_row, c_ptr, order_ptr, ids_ptr, lo_ptr, hi_ptr,
                                           sc_b, sc_s, scale, h_ok, m_i, l_i, acc_a, acc_b, q_a, q_b, q_pe,
                                           DV, DA, DV_PAD, DR, DR_PAD, BS, KEYS, SLICE, V_LOAD, ONE_SLOT, Q_LOOP,
                                           SPLIT_V, DESC)
    out = (t * splits + sp) * HQ + heads
    tl.store(acc_ptr + out[:, None] * DV + offs_a[None, :], acc_a, mask=h_ok[:, None] & a_ok[None, :])
    if SPLIT_V:
        tl.store(acc_ptr + out[:, None] * DV + offs_b[None, :], acc_b, mask=h_ok[:, None] & b_ok[None, :])
    tl.store(m_ptr + out, m_i, mask=h_ok)
    tl.store(l_ptr + out, l_i, mask=h_ok)


#: Compiled for the GPU; with TRITON_INTERPRET=1 set before Triton is imported, the interpreter (tests).
mla_kernel = triton.jit(_mla_body)
