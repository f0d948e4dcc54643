"""The decode step's blocks held by several requests (a common prefix): found, split off, tiled.

`default._plan_decodes` plans a decode step (one new token per request, no
window) from its (request, block) pairs, request-major. When some block id is
held by more than one pair, the pairs split into shared ones (`shared.py`'s
tiles) and unique ones (one row per block), giving exactly the general path's
arrays.

Why a module of its own: on the 2-core host a decode step of 256 requests is
~60 us of numpy calls, and a small shared prefix (8 of them sharing 8 blocks)
used to double it. Nearly all of that was call overhead on tiny arrays and
passes over all ~9 000 pairs, so here: shared pairs are found in two passes
over the pairs (`repeated`), the unique arrays take one boolean gather each
and no per-pair `hi` array (all blocks are full but a request's last), and the
usual case, one group of requests sharing full blocks, is laid out in ~15
calls on arrays of the shared pairs (`one_full_group`). Measured in
`benchmarks/planning.py` (docs/benchmarks.md).
"""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.plan.arrays import counting, same_id_sum
from vllm_gaudi_unified.plan.buffers import FreshArrays
from vllm_gaudi_unified.plan.rules import unique_reads_slice
from vllm_gaudi_unified.plan.shared import plan_shared

_I64 = np.int64


def repeated(phys: np.ndarray, span: int, out: FreshArrays):
    """Which pairs hold a block id some other pair holds too (a bool mask), or None when no id repeats.
    Each pair writes its index at its id in a scratch array never cleared (every slot read was just
    written): a pair that reads back another's index shares its id, and the pair whose index stayed
    there (whichever write numpy kept) is the id's last holder to mark. Two passes over the pairs and
    one over the repeats, no array as long as the cache; ids too sparse for scratch memory are counted
    over compacted ids (`same_id_sum`)."""
    P = phys.size
    if span > max(8 * P, 1 << 16):
        many = same_id_sum(phys, span - 1) > 1
        return many if many.any() else None
    if P < 1 << 31:
        mark, idx = out.scratch("block_mark", span, np.int32), counting(P)
    else:
        mark, idx = out.scratch("block_mark", span, _I64), np.arange(P)
    mark[phys] = idx
    again = mark.take(phys) != idx
    if not again.any():
        return None
    again[mark.take(phys[again])] = True
    return again


def split_shared(shared, phys, max_id, req, ends, nb_ctx, ctx, last, last_hi, width, q, bs, opts, out):
    """The shared tiles and the gathered unique arrays of a decode step whose pairs `shared` marks;
    returns ((rows, blocks, lo, hi, visible), shared pairs needed, unique arrays, unique pairs needed),
    or None where the unique path reads the cache slice (the caller's general split then runs).
    `max_id`: the largest id of `phys`; `last`, `last_hi`: each request's last pair and its visible slots
    (requests with context only)."""
    R = ctx.size
    u_mask = ~shared
    u_ids = phys[u_mask]
    n_u = u_ids.size
    s_idx = np.flatnonzero(shared)
    s_phys = phys.take(s_idx)
    if n_u == 0 or unique_reads_slice(n_u, max_id if s_phys.max() < max_id else int(u_ids.max()), opts):
        return None
    s_req = req.take(s_idx)
    s_blk = s_idx - (ends - nb_ctx).take(s_req)
    in_shared = shared.take(last)  # requests whose last block is shared (else every shared block is full)
    ends_shared = in_shared.any()
    if ends_shared:
        full_hi = ctx - (nb_ctx - 1) * bs  # per request: the slots of its last block
        s_hi = np.where(s_idx == (ends - 1).take(s_req), full_hi.take(s_req), bs)
        s_needed = int(s_hi.sum())
    else:
        s_hi, s_needed = None, s_idx.size * bs
    tiles = one_full_group(s_phys, s_req, s_blk, s_hi, R, bs, opts, out)
    if tiles is None:
        if s_hi is None:
            s_hi = np.full(s_idx.size, bs, _I64)
        tiles = plan_shared(None, s_phys, s_req, s_blk, s_hi, width, q, np.arange(R), ctx, bs, None, R, opts, out)
    # Unique pairs: every block full but a request's last; a pair's place among them is its index less the
    # shared pairs before it.
    rows = out.keep("unique_rows", req[u_mask])
    hi = out.full("unique_hi", n_u, bs)
    at = last - np.searchsorted(s_idx, last)
    if ends_shared:
        keep = ~in_shared
        at, last_hi = at[keep], last_hi[keep]
    hi[at] = last_hi
    unique = rows, out.keep("unique_blocks", u_ids), out.zeros("unique_lo", n_u), hi
    return tiles[0], tiles[1], unique, int(ctx.sum()) - s_needed  # a request's pairs sum to its context


def one_full_group(s_phys, s_req, s_blk, s_hi, T, bs, opts, out):
    """`shared.plan_shared`'s tiles for decodes when the shared pairs are one group of requests holding the
    same blocks at the same positions, all full (a common prefix: the usual sharing), else None.

    Pairs are request-major, so then they are `u` requests x `C` columns whose rows are equal, and the
    general path's arrays are: rows chunked `shared_rows` at a time (padding rows `T`), columns in the
    first request's block order chunked `blocks_per_tile` (padding id 0), `hi = bs` on every real cell,
    `lo = 0`, tiles row chunk major, each tile one prefix of full blocks."""
    S = s_req.size
    if s_hi is not None and int(s_hi.min()) != bs:  # (None: every shared block is full)
        return None
    u = int(np.count_nonzero(s_req[1:] != s_req[:-1])) + 1
    C = S // u
    if u * C != S:
        return None
    by_req = s_req.reshape(u, C)
    blk, ids = s_blk.reshape(u, C), s_phys.reshape(u, C)
    if not ((by_req[:, 0] == by_req[:, -1]).all() and (blk == blk[0]).all() and (ids == ids[0]).all()):
        return None
    qt, kb = opts.tile_rows(u), opts.blocks_per_tile(bs)
    n_rc, n_cc = -(-u // qt), -(-C // kb)
    tiles = n_rc * n_cc
    rows = out.full("shared_rows", (tiles, qt), T)
    blocks = out.zeros("shared_blocks", (tiles, kb))
    blocks.reshape(n_rc, n_cc * kb)[:, :C] = ids[0]
    hi = out.zeros("shared_hi", (tiles, qt, kb))
    if n_rc == 1:  # (the usual group: at most `shared_rows_max` requests)
        rows[:, :u] = by_req[:, 0]
        hi[:, :u] = bs
        if C % kb:  # padding columns of the last column chunk
            hi[-1, :, C % kb:] = 0
    else:
        rc = np.full(n_rc * qt, T, _I64)
        rc[:u] = by_req[:, 0]
        rows.reshape(n_rc, n_cc, qt)[...] = rc.reshape(n_rc, 1, qt)
        cells = np.zeros((n_rc * qt, n_cc * kb), _I64)
        cells[:u, :C] = bs
        hi.reshape(n_rc, n_cc, qt, kb)[...] = cells.reshape(n_rc, qt, n_cc, kb).transpose(0, 2, 1, 3)
    return (rows, blocks, out.zeros("shared_lo", hi.shape), hi, True), S * bs

