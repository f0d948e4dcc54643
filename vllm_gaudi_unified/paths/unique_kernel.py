"""The unique path as one Triton kernel: K/V read as stored, a token's blocks merged on the chip.

Why: the torch unique path writes one `Partial` per block slot (at block size
16 that is half as many bytes as the block itself, in fp32) and merges them
afterwards, and an fp8 cache has to be dequantized into a copy first. Here one
program takes one (token, KV head, split): it walks the token's slots (sorted
by token beforehand), loads K/V in the cache's own dtype (fp8 included),
dequantizes in registers (per-tensor scale folded into the score scale and
the output; per-block scales loaded beside the block, applied to the scores
and probabilities when they do not vary over channels), runs an online softmax
and writes one `Partial` row per (token, split), or, where it is the step's only
path and a token has one split, the token's final rows. The splits (a power of
two in the default) are merged by the exact merge of `merge.py`: in one pass
(`unique.combine_splits`), or one after the other in index order
(`mla_kernel.ordered_combine`, the batch-invariant mode).

Only the slots a row may see are loaded (`lo <= slot < hi`): a NaN or inf in
an unreadable slot is never read; a bad value in a readable one reaches that
token alone (its scores or its sum become NaN).

Imported only where Triton is (CUDA); `attention._run_paths` chooses when.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Scores in base 2 (`exp2`: one multiply less per score than `exp`, which scales by log2(e) itself); the
#: Partial's max back in base e.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _token(t, h, sp, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr,
                 seg_ptr, n_tokens, acc_ptr, m_ptr, l_ptr, score_scale, v_scale,
                 sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                 sks_b, sks_s, sks_h, sks_d, svs_b, svs_s, svs_h, svs_d,
                 HQ: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                 BS: tl.constexpr, KEYS: tl.constexpr, SPLITS: tl.constexpr, SLICE: tl.constexpr,
                 K_SCALES: tl.constexpr, V_SCALES: tl.constexpr, SPLIT_KEYS: tl.constexpr, UNITS: tl.constexpr,
                 kn_ptr, vn_ptr, skn_t, skn_h, svn_t, svn_h, new_scale, new_v, NEW_KEYS: tl.constexpr,
                 take_ptr, NEW_SELECT: tl.constexpr, out_ptr, FINAL: tl.constexpr, EXACT_DIV: tl.constexpr,
                 SORTED: tl.constexpr):
    """One (token, KV head, split). q `[n, HQ, D]` (last stride 1), caches `[blocks, BS, Hkv, D]` (last
    stride 1), scale tensors by strides (0 on broadcast axes; `K_SCALES`/`V_SCALES`: 0 none (a float
    folded in `score_scale`/`v_scale`), 1 one per key, 2 one per key and channel), `order`: slot
    ids sorted by token, `starts[t]:starts[t+1]` token t's part of it (`SORTED`: the slots are in that order
    already, `order` is not read), `ids`: block id per slot (unless `SLICE`: slot = block id). Out: acc
    `[n, SPLITS, HQ, D]`, m/l `[n, SPLITS, HQ]` in acc's dtype.
    `SPLIT_KEYS` (the batch-invariant mode): split `sp` is keys `[sp * SPLIT_KEYS,
    (sp + 1) * SPLIT_KEYS)` of the token's slots, boundaries fixed by position (splits past the
    token's keys write empty partials); 0: the token's keys cut into SPLITS even parts.

    `UNITS` > 1 (the unique path's units, a verify step's drafts): token t's slots serve it and the next
    `UNITS - 1` tokens of its request (`seg` `[n_tokens]`: each token's request's first token), all of
    them seeing the same keys: the `ROWS` rows are (token, query head of KV head h), each block loaded
    once for all of them. The program of a token another token's unit covers writes nothing.

    `NEW_KEYS` (a power of two, >= 16: keys per step): the new keys too (`kn`/`vn` `[n, Hkv, D]`, the step's
    keys and values), in split 0: with `UNITS` 1 (decodes) a token's own key; else row token i sees
    token j of its request for j <= i (the self and
    strict-causal pairs, causality from the tokens' order within the request; a request longer than a unit
    (a chunk off the prompt route) has its later tokens each in its own program), scaled by `new_scale`
    (the score scale without an fp8 key scale) and `new_v` (1 / the value scale `v_scale` folds in). A new
    value that is not finite is read as 0 and makes the scores of exactly the rows that see it NaN.
    `NEW_SELECT` (the batch-invariant mode): only the programs of the tokens with `take[t]` != 0 take new keys
    (the others' are on flash segments); else every program does.

    `FINAL` (one split, the step's only path): the rows normalized, in out's dtype (`out` `[n, HQ, D]`; a row
    that saw no key gives 0, as `merge.normalize`), and no Partial written (acc/m/l: their dtype only). With
    `EXACT_DIV` (the batch-invariant mode, which writes a row either way by the step's form) the division rounds
    as IEEE's (`div_rn`, not the approximate fp32 `/`), so the rows are `merge.normalize`'s of the same Partial
    bit for bit. The default needs no such match and keeps the approximate divide, cheaper where a program
    finishes many rows (a verify step's units)."""
    first = tl.load(starts_ptr + t)
    n_keys = (tl.load(starts_ptr + t + 1) - first) * BS
    offs_r = tl.arange(0, ROWS)
    offs_u = offs_r // G  # token of the row within the unit
    offs_g = offs_r % G
    if UNITS > 1:
        seg_t = tl.load(seg_ptr + t)
        covered = (seg_t != t) & (t - seg_t < UNITS)  # a row of its request's first token's unit
        tok = t + offs_u
        tok_ok = (offs_u < UNITS) & (tok < n_tokens)
        seg_u = tl.load(seg_ptr + tok, mask=tok_ok, other=-1)
        mine = (seg_u == t) & (seg_t == t)  # a later token of the request this token starts
        g_ok = (tok_ok & ((offs_r < G) | mine) & (covered == 0)) != 0
        n_keys = tl.where(covered, 0, n_keys)
        q_rows = tok[:, None] * sq_t
    else:  # a decode: one token, so the query row and the output offsets are scalars
        tok = t
        g_ok = offs_r < G
        q_rows = t * sq_t
    if SPLIT_KEYS > 0:
        per_split = SPLIT_KEYS
    else:
        per_split = tl.cdiv(n_keys, SPLITS * KEYS) * KEYS
    k_begin = sp * per_split
    k_end = tl.minimum(n_keys, k_begin + per_split)

    acc_dtype = acc_ptr.dtype.element_ty
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < D
    heads = h * G + offs_g
    q = tl.load(q_ptr + q_rows + heads[:, None] * sq_h + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    op_dtype = q.dtype
    m_i = tl.full([ROWS], float("-inf"), acc_dtype)
    l_i = tl.zeros([ROWS], acc_dtype)
    acc = tl.zeros([ROWS, D_PAD], acc_dtype)
    for start in range(k_begin, k_end, KEYS):
        kk = start + tl.arange(0, KEYS)
        key_ok = kk < k_end
        if SORTED:
            slot = first + kk // BS
        else:
            slot = tl.load(order_ptr + first + kk // BS, mask=key_ok, other=0)
        if SLICE:
            blk = slot
        else:
            blk = tl.load(ids_ptr + slot, mask=key_ok, other=0)
        j = kk % BS
        lo = tl.load(lo_ptr + slot, mask=key_ok, other=0)
        hi = tl.load(hi_ptr + slot, mask=key_ok, other=0)
        vis = key_ok & (j >= lo) & (j < hi)
        vis2 = vis[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (blk * sk_b + j * sk_s + h * sk_h)[:, None] + offs_d[None, :], mask=vis2, other=0.0)
        if k.dtype.is_fp8():
            k = k.to(tl.float32)  # exact; the conversion Hopper has (and the interpreter's fp8 -> fp64 fails)
        k = k.to(acc_dtype)
        if K_SCALES == 2:  # per channel: on K itself
            k = k * tl.load(ks_ptr + (blk * sks_b + j * sks_s + h * sks_h)[:, None] + offs_d[None, :] * sks_d,
                            mask=vis2, other=0.0).to(acc_dtype)
        # Scaled before the cast: under torch.compile a float argument is fp64, which would promote s (and
        # the loop-carried m_i) to fp64 where a plain launch passes fp32.
        s = (tl.dot(q, tl.trans(k.to(op_dtype))) * (score_scale * LOG2E)).to(acc_dtype)  # [ROWS, KEYS]
        if K_SCALES == 1:  # one per key: on its scores
            s = s * tl.load(ks_ptr + blk * sks_b + j * sks_s + h * sks_h, mask=vis, other=0.0).to(acc_dtype)[None, :]
        s = tl.where(vis[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        v = tl.load(v_ptr + (blk * sv_b + j * sv_s + h * sv_h)[:, None] + offs_d[None, :], mask=vis2, other=0.0)
        if v.dtype.is_fp8():
            v = v.to(tl.float32)
        v = v.to(acc_dtype)
        if V_SCALES == 2:
            v = v * tl.load(vs_ptr + (blk * svs_b + j * svs_s + h * svs_h)[:, None] + offs_d[None, :] * svs_d,
                            mask=vis2, other=0.0).to(acc_dtype)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_SCALES == 1:  # one per key: on its probabilities (after the sum, which they do not change)
            p = p * tl.load(vs_ptr + blk * svs_b + j * svs_s + h * svs_h, mask=vis, other=0.0).to(acc_dtype)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(op_dtype), v.to(op_dtype)).to(acc_dtype)
        m_i = m_new
    gate = sp  # the new keys go to split 0
    if NEW_SELECT:
        gate = tl.where(tl.load(take_ptr + t) != 0, sp, 1)
    if NEW_KEYS > 0 and UNITS == 1:  # a decode's own key: its self pair, in split 0
        own = (offs_r * 0 + gate) == 0  # [ROWS] (a vector: the interpreter takes no scalar mask)
        own_d = d_ok & ((offs_d * 0 + gate) == 0)
        kn = tl.load(kn_ptr + t * skn_t + h * skn_h + offs_d, mask=own_d, other=0.0).to(acc_dtype)
        vn = tl.load(vn_ptr + t * svn_t + h * svn_h + offs_d, mask=own_d, other=0.0).to(acc_dtype)
        bad = tl.sum(((vn != vn) | (tl.abs(vn) == float("inf"))).to(tl.int32), 0) > 0
        vn = tl.where(bad, 0.0, vn) * new_v
        s = (tl.sum(q.to(acc_dtype) * kn[None, :], 1) * (new_scale * LOG2E)).to(acc_dtype)  # [ROWS]
        s = tl.where(own, tl.where(bad, float("nan"), s), float("-inf"))
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vn[None, :]
        m_i = m_new
    if NEW_KEYS > 0 and UNITS > 1:  # the new keys of this program's rows: from its request's first token to its last row
        k_last = tl.max(tl.where(g_ok & (gate == 0), tok, -1), 0)  # (-1: no keys: a covered token, splits > 0)
        for kstart in range(seg_t, k_last + 1, NEW_KEYS):
            ktok = kstart + tl.arange(0, NEW_KEYS)
            k_in = ktok <= k_last
            own = k_in & (tl.load(seg_ptr + ktok, mask=k_in, other=-1) == seg_t)
            own2 = own[:, None] & d_ok[None, :]
            kn = tl.load(kn_ptr + (ktok * skn_t + h * skn_h)[:, None] + offs_d[None, :], mask=own2, other=0.0)
            vn = tl.load(vn_ptr + (ktok * svn_t + h * svn_h)[:, None] + offs_d[None, :], mask=own2, other=0.0)
            vn = vn.to(acc_dtype)
            bad = tl.sum(((vn != vn) | (tl.abs(vn) == float("inf"))).to(tl.int32), 1) > 0  # [NEW_KEYS]
            vn = tl.where(bad[:, None], 0.0, vn) * new_v
            s = (tl.dot(q, tl.trans(kn.to(op_dtype))) * (new_scale * LOG2E)).to(acc_dtype)  # [ROWS, NEW_KEYS]
            vis = own[None, :] & (ktok[None, :] <= tok[:, None])
            s = tl.where(vis & bad[None, :], float("nan"), s)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(op_dtype), vn.to(op_dtype)).to(acc_dtype)
            m_i = m_new
    row = (tok * SPLITS + sp) * HQ + heads
    if FINAL:  # (SPLITS 1: row = tok * HQ + heads); `EXACT_DIV`: IEEE division, as torch's (`merge.normalize`)
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = acc * v_scale / denom  # (fp64: its `/` is IEEE's already; div_rn takes fp32 only)
        if EXACT_DIV:
            if acc_dtype == tl.float32:  # (the product cast as the Partial's store casts it: fp64 under compile)
                out = tl.math.div_rn((acc * v_scale).to(acc_dtype), denom)
        tl.store(out_ptr + row[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], (acc * v_scale).to(acc_dtype),
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(m_ptr + row, m_i * LN2, mask=g_ok)  # (the Partial's max in e's units)
        tl.store(l_ptr + row, l_i, mask=g_ok)


def _unique_body(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr,
                 seg_ptr, n_tokens, acc_ptr, m_ptr, l_ptr, score_scale, v_scale,
                 sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                 sks_b, sks_s, sks_h, sks_d, svs_b, svs_s, svs_h, svs_d,
                 HQ: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                 BS: tl.constexpr, KEYS: tl.constexpr, SPLITS: tl.constexpr, SLICE: tl.constexpr,
                 K_SCALES: tl.constexpr, V_SCALES: tl.constexpr, SPLIT_KEYS: tl.constexpr, UNITS: tl.constexpr,
                 kn_ptr, vn_ptr, skn_t, skn_h, svn_t, svn_h, new_scale, new_v, NEW_KEYS: tl.constexpr,
                 take_ptr, NEW_SELECT: tl.constexpr, out_ptr, FINAL: tl.constexpr, EXACT_DIV: tl.constexpr,
                 SORTED: tl.constexpr, WORK: tl.constexpr):
    """The unique kernel: `_token` for one (token, KV head, split) a program, where `WORK` is off: program t
    the token t (int64: output offsets, t * SPLITS * HQ * D, may pass 2**31). `WORK` (units of several tokens;
    `unique.scan_token_order` listed the unit starts after the `n + 1` starts: `starts[n + 1 + e]`, their count
    `starts[2n + 1]`): program p takes the listed tokens p, p + P, ... (P programs). With a program per token,
    those of the tokens another token's unit covers (3 in 4 of a 1 + 3 verify step) write nothing but take an
    SM's slot each, its shared memory and a launch."""
    h = tl.program_id(1)
    sp = tl.program_id(2)
    if WORK:
        listed = starts_ptr + n_tokens + 1
        for e in range(tl.program_id(0), tl.load(listed + n_tokens), tl.num_programs(0)):
            _token(tl.load(listed + e), h, sp, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, order_ptr, starts_ptr, ids_ptr,
                   lo_ptr, hi_ptr, seg_ptr, n_tokens, acc_ptr, m_ptr, l_ptr, score_scale, v_scale, sq_t, sq_h, sk_b,
                   sk_s, sk_h, sv_b, sv_s, sv_h, sks_b, sks_s, sks_h, sks_d, svs_b, svs_s, svs_h, svs_d, HQ, G, ROWS,
                   D, D_PAD, BS, KEYS, SPLITS, SLICE, K_SCALES, V_SCALES, SPLIT_KEYS, UNITS, kn_ptr, vn_ptr, skn_t,
                   skn_h, svn_t, svn_h, new_scale, new_v, NEW_KEYS, take_ptr, NEW_SELECT, out_ptr, FINAL, EXACT_DIV,
                   SORTED)
    else:
        _token(tl.program_id(0).to(tl.int64), h, sp, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, order_ptr, starts_ptr,
               ids_ptr, lo_ptr, hi_ptr, seg_ptr, n_tokens, acc_ptr, m_ptr, l_ptr, score_scale, v_scale, sq_t, sq_h,
               sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sks_b, sks_s, sks_h, sks_d, svs_b, svs_s, svs_h, svs_d, HQ, G,
               ROWS, D, D_PAD, BS, KEYS, SPLITS, SLICE, K_SCALES, V_SCALES, SPLIT_KEYS, UNITS, kn_ptr, vn_ptr, skn_t,
               skn_h, svn_t, svn_h, new_scale, new_v, NEW_KEYS, take_ptr, NEW_SELECT, out_ptr, FINAL, EXACT_DIV, SORTED)


def _order_body(rows_ptr, order_ptr, starts_ptr, S, seg_ptr, CHUNK: tl.constexpr, UNITS: tl.constexpr):
    """`unique.token_order` in one launch: program t (0..n) counts the slots whose row is below t (its start,
    `starts[t]`) and writes its own slots' indices (row == t), in index order, from there (`order`). Every
    program scans all `S` rows (`rows` <= n): for the few hundred tokens and thousands of slots of a decode or
    verify step that is one short kernel where a sort takes several. `UNITS` > 1 (`seg` `[n]`: each token's
    request's first token): the tokens that start a unit (their request's first, or `UNITS` or more past it)
    listed after the starts, for the unique kernel's `WORK`: `starts[n + 1 + e]`, their count `starts[2n + 1]`."""
    t = tl.program_id(0)
    before = tl.zeros([CHUNK], tl.int32)
    for c in range(0, S, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        r = tl.load(rows_ptr + idx, mask=idx < S, other=t)
        before += (r < t).to(tl.int32)
    pos = tl.sum(before, 0)
    tl.store(starts_ptr + t, pos.to(tl.int64))
    for c in range(0, S, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        mine = (tl.load(rows_ptr + idx, mask=idx < S, other=t + 1) == t).to(tl.int32)
        rank = tl.cumsum(mine, 0) - 1
        tl.store(order_ptr + pos + rank, idx.to(tl.int64), mask=mine != 0)
        pos += tl.sum(mine, 0)
    if UNITS > 1:  # the unit starts listed: token t (< n) at its rank among them, their count by program n
        n = tl.num_programs(0) - 1
        listed = tl.zeros([CHUNK], tl.int32)
        for c in range(0, t, CHUNK):
            idx = c + tl.arange(0, CHUNK)
            seg = tl.load(seg_ptr + idx, mask=idx < t, other=0)
            listed += ((idx < t) & ((seg == idx) | (idx - seg >= UNITS))).to(tl.int32)
        at = tl.sum(listed, 0)
        seg_t = tl.load(seg_ptr + tl.minimum(t, n - 1))
        start = (t == n) | (seg_t == t) | (t - seg_t >= UNITS)
        two = tl.arange(0, 2)  # (a vector store, its first lane: the interpreter takes no scalar mask)
        tl.store(starts_ptr + tl.where(t == n, 2 * n + 1, n + 1 + at) + two, tl.where(t == n, at, t) + two * 0,
                 mask=(2 * two + start.to(tl.int32)) == 1)


def _slots_body(u_rows_ptr, u_ids_ptr, u_lo_ptr, u_hi_ptr, s_rows_ptr, s_blocks_ptr, s_lo_ptr, s_hi_ptr, ids_ptr,
                lo_ptr, hi_ptr, starts_ptr, U, C, n, R: tl.constexpr, KB: tl.constexpr, SLICE: tl.constexpr,
                CHUNK: tl.constexpr, ONE: tl.constexpr):
    """`unique._slots_with_shared` and `_order_body` in one launch, the slots written in token order: program t
    (0..n) counts the slots whose row is below t (`starts[t]`) and writes its own slots' block ids, `lo` and
    `hi` (row == t) in index order from there, for the unique kernel's `SORTED` form (no `order` read per key
    tile). Slot i < `U` is unique slot i (`u_*`; `SLICE`: block id i); slot `U + c` is cell c of the shared
    tiles, `[tiles, R rows, KB blocks]` (`s_rows` `[tiles * R]`, `s_blocks` `[tiles * KB]`, `s_lo`/`s_hi` per
    cell), its tile row's token where it has a visible slot, else `n` (no row: not written); past the last
    slot, row n + 1. `ONE` (all slots in one `CHUNK`): every slot loaded once, all loads at once; else a pass to
    count, a pass to write. The rows, and so every store's address, come from loads in this body, no helper's
    result: torch.compile's analysis of a user kernel (`torch._higher_order_ops.triton_kernel_wrap`) takes every
    argument of a helper whose result reaches a store's address as written, and with the batch's arrays (views of
    one device buffer) taken as written inputs the compiled launch wrote wrong slots and overwrote the arrays
    (torch 2.11, H200: the unique kernel then read out of bounds)."""
    t = tl.program_id(0)
    if ONE:
        passes = 1
    else:
        passes = 2
    chunks = tl.maximum(tl.cdiv(U + C, CHUNK), 1)
    before = tl.zeros([CHUNK], tl.int32)
    pos = tl.sum(before, 0)
    for it in range(0, passes * chunks):  # (`ONE`: one iteration, counting and writing)
        idx = (it % chunks) * CHUNK + tl.arange(0, CHUNK)
        uniq, cell, shared = idx < U, idx - U, (idx >= U) & (idx < U + C)
        s_lo = tl.load(s_lo_ptr + cell, mask=shared, other=0)
        s_hi = tl.load(s_hi_ptr + cell, mask=shared, other=0)
        s_row = tl.where(s_hi > s_lo, tl.load(s_rows_ptr + cell // KB, mask=shared, other=0), n)
        row = tl.where(uniq, tl.load(u_rows_ptr + idx, mask=uniq, other=0), tl.where(shared, s_row, n + 1))
        blk, lo, hi = _slot_values(idx, uniq, shared, cell, s_lo, s_hi, u_ids_ptr, u_lo_ptr, u_hi_ptr, s_blocks_ptr,
                                   R, KB, SLICE)
        if it < chunks:
            before += (row < t).to(tl.int32)
        if it == chunks - 1:
            pos = tl.sum(before, 0)
            tl.store(starts_ptr + t, pos.to(tl.int64))
        if (it >= (passes - 1) * chunks) & (t < n):
            mine = row == t
            at = pos + tl.cumsum(mine.to(tl.int32), 0) - 1
            tl.store(ids_ptr + at, blk, mask=mine)
            tl.store(lo_ptr + at, lo, mask=mine)
            tl.store(hi_ptr + at, hi, mask=mine)
            pos += tl.sum(mine.to(tl.int32), 0)


@triton.jit
def _slot_values(idx, uniq, shared, cell, s_lo, s_hi, u_ids_ptr, u_lo_ptr, u_hi_ptr, s_blocks_ptr, R: tl.constexpr,
                 KB: tl.constexpr, SLICE: tl.constexpr):
    """`_slots_body`'s slots `idx`: (block id, lo, hi), their loads' addresses and masks from `idx` alone (issued
    together); the results are stored as values only (see `_slots_body`)."""
    if SLICE:
        u_blk = idx
    else:
        u_blk = tl.load(u_ids_ptr + idx, mask=uniq, other=0)
    s_blk = tl.load(s_blocks_ptr + (cell // (R * KB)) * KB + cell % KB, mask=shared, other=0)
    lo = tl.where(uniq, tl.load(u_lo_ptr + idx, mask=uniq, other=0), s_lo)
    hi = tl.where(uniq, tl.load(u_hi_ptr + idx, mask=uniq, other=0), s_hi)
    return tl.where(uniq, u_blk, s_blk), lo, hi


#: Compiled for the GPU; with TRITON_INTERPRET=1 set before Triton is imported, the interpreter instead
#: (numpy on the CPU: how tests run it without a GPU, in a process of their own).
unique_kernel = triton.jit(_unique_body)
order_kernel = triton.jit(_order_body)
slots_kernel = triton.jit(_slots_body)


#: Slots `slots_kernel` loads at once: up to this many, each once (one pass); more, in chunks of this many, twice.
SLOTS_CHUNK = 1024


def token_slots(batch, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`unique._slots_with_shared`'s slots in token order (block ids, lo, hi) and each token's first place among
    them (`[n + 1]`), as `unique.token_order` orders them, in one launch (`slots_kernel`) where the concatenation and
    `token_order` take two; the unique kernel reads them as they lie (`SORTED`), no `order` load before a key tile's
    block id. Entries past `starts[n]` (cells without a row) are left unwritten: no program reads them."""
    u, (t, r, kb) = batch.unique_rows.shape[0], batch.shared_lo.shape
    cells = t * r * kb
    dev = batch.unique_rows.device
    ids, lo, hi = (torch.empty(u + cells, dtype=torch.int64, device=dev) for _ in range(3))
    starts = torch.empty(n + 1, dtype=torch.int64, device=dev)
    plain = lambda x: x.contiguous()  # noqa: E731
    u_ids = batch.unique_rows if batch.unique_blocks is None else plain(batch.unique_blocks)  # (slice: unread)
    slots_kernel[(n + 1,)](
        plain(batch.unique_rows), u_ids, plain(batch.unique_lo), plain(batch.unique_hi), plain(batch.shared_rows),
        plain(batch.shared_blocks), plain(batch.shared_lo), plain(batch.shared_hi), ids, lo, hi, starts, u, cells, n,
        R=r, KB=kb, SLICE=batch.unique_blocks is None, ONE=u + cells <= SLOTS_CHUNK,
        CHUNK=max(16, min(SLOTS_CHUNK, triton.next_power_of_2(u + cells))))
    return ids, lo, hi, starts
