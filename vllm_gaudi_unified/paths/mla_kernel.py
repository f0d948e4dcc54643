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
splits (a power of two) are merged by `split_combine` (one pass over them).

The cache's row stride is a compile-time constant (one value per model), so a
tile's addresses are constant offsets from one base (0.67 -> 0.62 ms at
128 x 4096 keys on an H100, 255 -> 246 registers). Variants measured slower
and removed: the latent in two halves,
tensor-descriptor loads, Triton's loop pipelining and warp specialisation, the
products transposed, the sums kept per key, wholly visible slots first and
unmasked.

Only the slots a row may see are loaded (`lo <= slot < hi`): a NaN in an
unreadable slot is never read. Imported only where Triton is.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(start, k_end, first, q_row, c_ptr, order_ptr, ids_ptr, lo_ptr, hi_ptr, sc_b, sc_s, scale, h_ok, m_i, l_i, acc,
          q_nope, q_pe, DV: tl.constexpr, DV_PAD: tl.constexpr, DR: tl.constexpr, DR_PAD: tl.constexpr,
          BS: tl.constexpr, KEYS: tl.constexpr, SLICE: tl.constexpr, V_LOAD: tl.constexpr, ONE_SLOT: tl.constexpr,
          Q_LOOP: tl.constexpr):
    """Keys `[start, start + KEYS)` of the token (only those below `k_end`) folded into (m, l, acc)."""
    acc_dtype = acc.dtype
    offs_v = tl.arange(0, DV_PAD)
    offs_r = tl.arange(0, DR_PAD)
    v_ok = offs_v < DV
    r_ok = offs_r < DR
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
    if Q_LOOP:  # the query read again each step (from L1/L2): it streams through shared memory
        q_nope = tl.load(q_row + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :], other=0.0)
        q_pe = tl.load(q_row + DV + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    base = blk.to(tl.int64) * sc_b + j * sc_s
    row = c_ptr + base[:, None]
    k_pe = tl.load(row + DV + offs_r[None, :], mask=vis[:, None] & r_ok[None, :], other=0.0)
    if V_LOAD == 0:  # one load: the tile is the keys (transposed in registers) and the values
        c = tl.load(row + offs_v[None, :], mask=vis[:, None] & v_ok[None, :], other=0.0)  # [KEYS, DV]
        s = tl.dot(q_nope, tl.trans(c)).to(acc_dtype)
        s += tl.dot(q_pe, tl.trans(k_pe)).to(acc_dtype)
    else:  # keys loaded transposed, values loaded again (from L1/L2): each load in its dot's layout
        c_t = tl.load(c_ptr + base[None, :] + offs_v[:, None], mask=vis[None, :] & v_ok[:, None], other=0.0)
        s = tl.dot(q_nope, c_t).to(acc_dtype)
        s += tl.dot(q_pe, tl.trans(k_pe)).to(acc_dtype)
    # cast after scaling: under torch.compile a float argument is fp64 (the loop carries acc's dtype)
    s = tl.where(vis[None, :], (s * scale).to(acc_dtype), float("-inf"))  # [BLOCK_H, KEYS]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_LOAD != 0:
        c = tl.load(row + offs_v[None, :], mask=vis[:, None] & v_ok[None, :], other=0.0)  # [KEYS, DV]
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c).to(acc_dtype)
    return m_new, l_i, acc


def _mla_body(q_ptr, k_ptr, c_ptr, order_ptr, starts_ptr, ids_ptr, lo_ptr, hi_ptr, acc_ptr, m_ptr, l_ptr, scale, splits,
              sq_t, sq_h, sk_t, sc_b, sc_s: tl.constexpr,
              HQ: tl.constexpr, BLOCK_H: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, DR: tl.constexpr,
              DR_PAD: tl.constexpr, BS: tl.constexpr, KEYS: tl.constexpr, SLICE: tl.constexpr, V_LOAD: tl.constexpr,
              ONE_SLOT: tl.constexpr, Q_LOOP: tl.constexpr, SELF: tl.constexpr, FINAL: tl.constexpr, tok_ptr,
              TOKENS: tl.constexpr, SPLIT_KEYS: tl.constexpr, seg_ptr, UNITS: tl.constexpr, UNIT_ROWS: tl.constexpr):
    """One (head group, split, token). q `[n, HQ, DV + DR]` (last stride 1), cache `[blocks, BS, DV + DR]`
    (strides `sc_b`, `sc_s`, last 1; `sc_s` a compile-time constant), `order`: slot ids sorted by token,
    `starts[t]:starts[t+1]` token t's part of it, `ids`: block id per slot (unless `SLICE`: slot = block
    id), `lo`/`hi` its visible slots. Out: acc `[n, splits, HQ, DV]`, m/l `[n, splits, HQ]` (fp32 or
    fp64: acc's dtype); the token's keys are cut into `splits` parts of whole `KEYS` tiles. `V_LOAD` 0:
    the latent tile is loaded once and serves both products; 1: loaded as keys transposed and again as
    values (the second read hits the cache; each load lands in its product's layout). `ONE_SLOT` (needs
    `BS % KEYS == 0`): a tile's slot, block and bounds are loaded once as scalars, not per key. `Q_LOOP`:
    the query tile is loaded in each loop step rather than held from the start (registers against
    reloads). `SELF`: the new tokens' keys `k` `[n, DV + DR]` (row stride `sk_t`, last 1): split 0 of
    token t starts from its own pair. `FINAL` (one split): acc `[n, HQ, DV]` in its own dtype gets the rows
    normalized (acc / l; 0 where no key was seen), m and l are not written. `TOKENS` (the batch-invariant
    mode): program i takes token `tok[i]`, its Partial rows are row i of acc/m/l, its `FINAL` rows token
    `tok[i]`'s. `SPLIT_KEYS` (a multiple of KEYS; the batch-invariant mode): split `sp` is the keys
    `[sp * SPLIT_KEYS, (sp + 1) * SPLIT_KEYS)` of the token's slots, whatever `splits` is; 0: the keys cut
    into `splits` even parts. `UNITS` > 1 (with `SELF`: a verify step's drafts): split 0 of token t also takes
    the new keys `t - UNITS + 1 .. t - 1` of its request (those from `seg[t]`, its request's first new token
    on): its causal pairs, no pass over its rows after the kernel. `UNIT_ROWS`: token t reads the slots of row
    `seg[t]` (the slots as planned in units: a request's on its first new token's row)."""
    hg = tl.program_id(0)
    sp = tl.program_id(1)
    i = tl.program_id(2).to(tl.int64)  # output offsets may pass 2**31
    t = i
    if TOKENS:
        t = tl.load(tok_ptr + i).to(tl.int64)
    r = t
    if UNIT_ROWS:
        r = tl.load(seg_ptr + t).to(tl.int64)
    first = tl.load(starts_ptr + r)
    n_keys = (tl.load(starts_ptr + r + 1) - first) * BS
    if SPLIT_KEYS > 0:
        per_split = SPLIT_KEYS
    else:
        per_split = tl.cdiv(n_keys, splits * KEYS) * KEYS
    k_begin = sp * per_split
    k_end = tl.minimum(n_keys, k_begin + per_split)

    acc_dtype = m_ptr.dtype.element_ty  # (the compute dtype; with FINAL acc_ptr's is the output's)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < HQ
    offs_v = tl.arange(0, DV_PAD)
    offs_r = tl.arange(0, DR_PAD)
    v_ok = offs_v < DV
    r_ok = offs_r < DR
    q_row = q_ptr + t * sq_t + heads[:, None] * sq_h
    q_nope = h_ok  # (placeholders: Q_LOOP loads the query in each step)
    q_pe = h_ok
    if not Q_LOOP:
        q_nope = tl.load(q_row + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :], other=0.0)
        q_pe = tl.load(q_row + DV + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), acc_dtype)
    l_i = tl.zeros([BLOCK_H], acc_dtype)
    acc = tl.zeros([BLOCK_H, DV_PAD], acc_dtype)
    if SELF:  # split 0 starts from the token's own key (weight 1 at its score): no separate self pair
        k_row = k_ptr + t * sk_t
        kn = tl.load(k_row + offs_v, mask=v_ok, other=0.0).to(acc_dtype)
        kr = tl.load(k_row + DV + offs_r, mask=r_ok, other=0.0).to(acc_dtype)
        qn = tl.load(q_row + offs_v[None, :], mask=h_ok[:, None] & v_ok[None, :], other=0.0).to(acc_dtype)
        qr = tl.load(q_row + DV + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(acc_dtype)
        s_self = ((tl.sum(qn * kn[None, :], 1) + tl.sum(qr * kr[None, :], 1)) * scale).to(acc_dtype)
        here = sp == 0
        m_i = tl.where(here, s_self, m_i)
        l_i = tl.where(here, 1.0, l_i).to(acc_dtype)
        acc = tl.where(here, acc + kn[None, :], acc)
        if UNITS > 1:
            seg = tl.load(seg_ptr + t)
            for j in tl.static_range(1, UNITS):  # the request's earlier new keys, online as the cached ones
                ok = here & (t - j >= seg)
                k_row = k_ptr + tl.maximum(t - j, 0) * sk_t
                kn = tl.load(k_row + offs_v, mask=offs_v < tl.where(ok, DV, 0), other=0.0).to(acc_dtype)
                kr = tl.load(k_row + DV + offs_r, mask=offs_r < tl.where(ok, DR, 0), other=0.0).to(acc_dtype)
                s_j = ((tl.sum(qn * kn[None, :], 1) + tl.sum(qr * kr[None, :], 1)) * scale).to(acc_dtype)
                m_new = tl.where(ok, tl.maximum(m_i, s_j), m_i)
                alpha = tl.where(ok, tl.exp(m_i - m_new), 1.0).to(acc_dtype)
                p_j = tl.where(ok, tl.exp(s_j - m_new), 0.0).to(acc_dtype)
                l_i = l_i * alpha + p_j
                acc = acc * alpha[:, None] + p_j[:, None] * kn[None, :]
                m_i = m_new
    for start in range(k_begin, k_end, KEYS):
        m_i, l_i, acc = _tile(start, k_end, first, q_row, c_ptr, order_ptr, ids_ptr, lo_ptr, hi_ptr, sc_b, sc_s,
                              scale, h_ok, m_i, l_i, acc, q_nope, q_pe, DV, DV_PAD, DR, DR_PAD, BS, KEYS, SLICE,
                              V_LOAD, ONE_SLOT, Q_LOOP)
    out = (i * splits + sp) * HQ + heads
    if FINAL:
        out = (t * splits + sp) * HQ + heads
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(acc_ptr + out[:, None] * DV + offs_v[None, :], acc.to(acc_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & v_ok[None, :])
    else:
        tl.store(acc_ptr + out[:, None] * DV + offs_v[None, :], acc, mask=h_ok[:, None] & v_ok[None, :])
        tl.store(m_ptr + out, m_i, mask=h_ok)
        tl.store(l_ptr + out, l_i, mask=h_ok)


def _combine_body(acc_ptr, m_ptr, l_ptr, out_ptr, om_ptr, ol_ptr, S: tl.constexpr, S_PAD: tl.constexpr, HQ,
                  DV: tl.constexpr, DV_PAD: tl.constexpr, FINAL: tl.constexpr):
    """One (token, head): its `S` split rows (acc `[n, S, HQ, DV]`, m/l `[n, S, HQ]`, natural-log units) merged
    as `merge.merge` does (a split that saw no key, max -inf, adds exactly nothing whatever its acc holds; a NaN
    max is seen, its row keeps it), into out `[n, HQ, DV]`: normalized in out's dtype with `FINAL`, else the
    merged acc with its max and sum (om/ol `[n, HQ]`). Why: `merge.fold_pairwise` over 16 splits of 4 decodes x
    32k keys took 0.15 ms of elementwise passes beside the kernel's 0.09 (H100)."""
    row = tl.program_id(0).to(tl.int64)
    t = row // HQ
    h = row % HQ
    sp = tl.arange(0, S_PAD)
    sp_ok = sp < S
    at = (t * S + sp) * HQ + h  # [S_PAD] the splits' rows
    m = tl.load(m_ptr + at, mask=sp_ok, other=float("-inf"))
    seen = m != float("-inf")
    top = tl.max(m, 0)
    w = tl.where(seen, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0.0)
    total = tl.sum(w * tl.load(l_ptr + at, mask=sp_ok & seen, other=0.0), 0)
    d = tl.arange(0, DV_PAD)
    a = tl.load(acc_ptr + at[:, None] * DV + d[None, :], mask=(sp_ok & seen)[:, None] & (d < DV)[None, :], other=0.0)
    acc = tl.sum(w[:, None] * a, 0)
    if FINAL:
        acc = acc / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * DV + d, acc.to(out_ptr.dtype.element_ty), mask=d < DV)
    else:
        tl.store(out_ptr + row * DV + d, acc, mask=d < DV)
        tl.store(om_ptr + row, top)
        tl.store(ol_ptr + row, total)


def _ordered_combine_body(acc_ptr, m_ptr, l_ptr, tok_ptr, out_ptr, om_ptr, ol_ptr, splits, HQ, DV: tl.constexpr,
                          DV_PAD: tl.constexpr, starts_ptr, BS: tl.constexpr, ONE_KEYS: tl.constexpr,
                          TOKENS: tl.constexpr, FINAL: tl.constexpr, EXACT_DIV: tl.constexpr):
    """One (row i, head) of a kernel's Partial rows in splits (acc `[m, splits, HQ, DV]`, m/l `[m, splits, HQ]`,
    natural-log units), its splits merged one after the other in index order: with `FINAL` normalized into
    token t's row of out `[n, HQ, DV]` (out's dtype), else the merged acc into that row of out and its max and
    sum into om/ol `[n, HQ]` (a Partial). t is i, or `tok[i]` with `TOKENS` (`_mla_body`'s `TOKENS` rows).
    Why not `_combine_body` (the batch-invariant mode): its sums over the splits are `tl.sum` reductions whose
    order follows their compile-time width `S_PAD`, the batch's split count; here `splits` is a run-time number
    (not specialized) and a split that saw no key (max -inf: a token's splits past its own keys) leaves the
    sums as they are, so a token's rows are the same for any count. With one real split the weight is
    exp(0) = 1: the rows are that split's (normalized: the kernels' `FINAL` rows) bit for bit; `EXACT_DIV`
    (fp32) divides as IEEE's (`div_rn`), as `merge.normalize` and the unique kernel's `EXACT_DIV`.
    `ONE_KEYS`: a token of at most that many keys (its slots `starts[t]:starts[t + 1]` of `BS` keys) is left
    alone (the seesaw kernel wrote its rows)."""
    row = tl.program_id(0).to(tl.int64)
    i = row // HQ
    h = row % HQ
    t = i
    if TOKENS:
        t = tl.load(tok_ptr + i).to(tl.int64)
    many = t >= 0
    if ONE_KEYS > 0:
        many = (tl.load(starts_ptr + t + 1) - tl.load(starts_ptr + t)) * BS > ONE_KEYS
    d = tl.arange(0, DV_PAD)
    top = tl.load(m_ptr + i * splits * HQ + h)
    for sp in range(1, splits):  # (max is exact in any order)
        top = tl.maximum(top, tl.load(m_ptr + (i * splits + sp) * HQ + h))
    safe = tl.where(top == float("-inf"), 0.0, top)
    at = i * splits * HQ + h
    m = tl.load(m_ptr + at)
    seen = (m != float("-inf")) & many
    w = tl.where(seen, tl.exp(m - safe), 0.0)
    total = w * tl.load(l_ptr + at, mask=seen, other=0.0)
    acc = w * tl.load(acc_ptr + at * DV + d, mask=d < tl.where(seen, DV, 0), other=0.0)
    for sp in range(1, splits):
        at = (i * splits + sp) * HQ + h
        m = tl.load(m_ptr + at)
        seen = (m != float("-inf")) & many
        w = tl.where(seen, tl.exp(m - safe), 0.0)
        total = tl.where(seen, total + w * tl.load(l_ptr + at, mask=seen, other=0.0), total)
        acc = tl.where(seen, acc + w * tl.load(acc_ptr + at * DV + d, mask=d < tl.where(seen, DV, 0), other=0.0), acc)
    dest = (t * HQ + h) * DV + d
    if FINAL:
        denom = tl.where(total > 0, total, 1.0)
        out = acc / denom  # (fp64: its `/` is IEEE's already; div_rn takes fp32 only)
        if EXACT_DIV:
            if acc.dtype == tl.float32:
                out = tl.math.div_rn(acc, denom)
        tl.store(out_ptr + dest, out.to(out_ptr.dtype.element_ty), mask=d < tl.where(many, DV, 0))
    else:
        tl.store(out_ptr + dest, acc, mask=d < DV)
        tl.store(om_ptr + t * HQ + h, top)
        tl.store(ol_ptr + t * HQ + h, total)


#: Compiled for the GPU; with TRITON_INTERPRET=1 set before Triton is imported, the interpreter (tests).
mla_kernel = triton.jit(_mla_body)
split_combine = triton.jit(_combine_body)
ordered_combine = triton.jit(_ordered_combine_body, do_not_specialize=["splits"])
