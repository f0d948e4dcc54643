"""The default planner's shared tiles: (query tokens x cache blocks) over blocks with the same users.

A column is one (block id, position in the request) used by more than one
query token. Columns with the same set of user requests form a group
(`rules.group_columns`); every
row (a new token of one of those requests) of a group sees every column of the
group, so a group is cut into row chunks x column chunks, and each pair of
chunks is one tile. A cell's visible slots follow from its row's context and
position and its column's first position alone: no per-cell lookup of the
block table.

Cost: the [tiles, rows, blocks] cell arrays are the largest arrays a step
plans (97 000 cells for the mixed 8192-token benchmark step). numpy is slow on
them when it broadcasts over a short last axis (the 4 blocks of a tile: one
inner loop per 4 cells), so cells are written from whole-row copies, and
without a window only the tiles holding a request's partial last block are
computed cell by cell (the others are full blocks or padding).
"""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.plan.arrays import ranges
from vllm_gaudi_unified.plan.buffers import FreshArrays
from vllm_gaudi_unified.plan.rules import group_columns, shared_tiles

_I64 = np.int64
_FAR = np.iinfo(_I64).max // 4  #: first position of a padding column: past every context, so it sees nothing


def plan_shared(mask, phys, pair_req, pair_blk, pair_hi, width, q, starts, ctx, bs, W, T, opts, out: FreshArrays):
    """Tiles over the shared (request, block) pairs `mask` selects (None: every pair given); returns
    (rows, blocks, lo, hi) and the pairs they need."""
    kb = opts.blocks_per_tile(bs)
    if mask is None:
        s_phys, s_req, s_blk, s_hi = phys, pair_req, pair_blk, pair_hi
    else:
        s_phys, s_req, s_blk, s_hi = phys[mask], pair_req[mask], pair_blk[mask], pair_hi[mask]
    # Columns: pairs sorted by (block id, position), requests in order within one column.
    col_key = s_phys * width + s_blk
    order = np.argsort(col_key, kind="stable")
    ck, req_sorted = col_key[order], s_req[order]
    n = ck.size
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(ck[1:], ck[:-1], out=new[1:])
    col_start = np.flatnonzero(new)
    col_users = np.empty_like(col_start)  # (np.diff with append= costs more than the step's other calls here)
    np.subtract(col_start[1:], col_start[:-1], out=col_users[:-1])
    col_users[-1] = n - col_start[-1]
    if W is None:  # one group of one-token requests (a decode batch's common prefix, beside prompts or not)
        users = _one_group(col_users, req_sorted)
        if users is not None and (T == q.size or int(q[users].max()) == 1):
            qt = opts.tile_rows(users.size)
            return _plan_one_group(users, order[col_start], s_phys, s_blk, s_hi, starts, ctx, bs, T, qt, kb, out)
    col_group, collided = group_columns(np.zeros(col_start.size, _I64), req_sorted, req_sorted, col_start, col_users)
    if collided.any():  # one group per column: a tile never pairs a token with a block its request lacks
        col_group = np.arange(col_start.size)
    first_pair = order[col_start]
    col_phys, col_pos = s_phys[first_pair], s_blk[first_pair] * bs
    G = int(col_group.max()) + 1
    # A group's requests are those of its first column (all its columns have the same users).
    first_col = np.full(G, -1, _I64)
    first_col[col_group[::-1]] = np.arange(col_group.size)[::-1]
    users_per_group = col_users[first_col]
    req_idx, gr_group = ranges(col_start[first_col], users_per_group)
    gr_req = req_sorted[req_idx]
    # Row chunks: each group's tokens (its requests' new tokens, in order), padded to whole chunks.
    decodes = W is None and T == q.size  # one new token per request: a group's rows are its requests
    rows_per_group = users_per_group if decodes else np.bincount(gr_group, weights=q[gr_req], minlength=G).astype(_I64)
    cols_per_group = np.bincount(col_group, minlength=G)
    c_chunks = -(-cols_per_group // kb)
    qt = opts.tile_rows(rows_per_group, c_chunks)  # the step's tile rows (`shared_tiles` agrees)
    r_chunks = -(-rows_per_group // qt)
    r_off = np.cumsum(r_chunks) - r_chunks
    group_tok = np.cumsum(rows_per_group) - rows_per_group
    if decodes:  # (the general branch with one token per entry)
        dest = (r_off * qt - group_tok)[gr_group] + np.arange(gr_req.size)
    else:
        gr_q = q[gr_req]
        entry_tok = np.cumsum(gr_q) - gr_q  # first token of each (group, request) entry, group after group
        dest0 = r_off[gr_group] * qt + (entry_tok - group_tok[gr_group])  # its first slot in the chunk table
        dest, _ = ranges(dest0, gr_q)
    n_rc = int(r_chunks.sum())
    rc_tok = np.full(n_rc * qt, T, _I64)
    rc_ctx = np.zeros(n_rc * qt, _I64)  # 0 for padding rows: they see no slot
    if decodes:
        rc_tok[dest] = starts[gr_req]
        rc_ctx[dest] = ctx[gr_req]
    else:
        rc_tok[dest] = dest + np.repeat(starts[gr_req] - dest0, gr_q)
        rc_ctx[dest] = np.repeat(ctx[gr_req], gr_q)
    # Column chunks: each group's columns, padded.
    # Within a group, columns in request order: a request's partly filled last block comes last, so a
    # tile's visible keys are one prefix (what the fused kernel's per-segment key count can express).
    col_order = np.lexsort((col_pos, col_group))
    c_off = np.cumsum(c_chunks) - c_chunks
    g_sorted = col_group[col_order]
    col0 = np.cumsum(cols_per_group) - cols_per_group
    cdest = c_off[g_sorted] * kb + (np.arange(col_order.size) - col0[g_sorted])
    n_cc = int(c_chunks.sum())
    cc_phys = np.zeros(n_cc * kb, _I64)
    cc_phys[cdest] = col_phys[col_order]
    cc_pos = np.full(n_cc * kb, _FAR, _I64)
    cpos_sorted = col_pos[col_order]
    cc_pos[cdest] = cpos_sorted
    # Tiles: every (row chunk, column chunk) of each group, row chunk major.
    per_group = shared_tiles(rows_per_group, cols_per_group, opts, bs, qt)
    local, tile_group = ranges(np.zeros(G, _I64), per_group)
    cg = c_chunks[tile_group]
    ri = r_off[tile_group] + local // cg
    ci = c_off[tile_group] + local % cg
    tiles = ri.size
    rows = out.array("shared_rows", (tiles, qt))
    np.take(rc_tok.reshape(n_rc, qt), ri, axis=0, out=rows)
    cphys = out.array("shared_blocks", (tiles, kb))
    np.take(cc_phys.reshape(n_cc, kb), ci, axis=0, out=cphys)
    hi = out.array("shared_hi", (tiles, qt, kb))
    if W is None:
        gmin = np.minimum.reduceat(ctx[gr_req], np.cumsum(users_per_group) - users_per_group)
        _full_blocks_hi(hi, cc_pos, ci, rc_ctx.reshape(n_rc, qt), rows_per_group, r_chunks, c_chunks, r_off,
                        per_group, np.flatnonzero(cpos_sorted + bs > gmin[g_sorted]), g_sorted, col0, cpos_sorted,
                        bs)
        lo = out.zeros("shared_lo", (tiles, qt, kb))
        needed = int(s_hi.sum() if decodes else np.dot(q[s_req], s_hi))  # each token of a request sees each of its pairs' slots
        visible = _prefix_visible(rc_ctx.reshape(n_rc, qt), ri, cc_pos.reshape(n_cc, kb).take(ci, axis=0), bs)
    else:
        cpos = np.repeat(cc_pos.reshape(n_cc, kb).take(ci, axis=0)[:, None, :], qt, axis=1)
        row_ctx = rc_ctx.reshape(n_rc, qt).take(ri, axis=0)
        np.subtract(np.repeat(row_ctx.ravel(), kb).reshape(tiles, qt, kb), cpos, out=hi)
        np.clip(hi, 0, bs, out=hi)
        rc_lo = np.zeros(n_rc * qt, _I64)  # first visible position of each row: its own position - W + 1
        rc_lo[dest] = dest + np.repeat(ctx[gr_req] - (W - 1) - dest0, gr_q)
        row_lo = rc_lo.reshape(n_rc, qt).take(ri, axis=0)
        lo = out.array("shared_lo", (tiles, qt, kb))
        np.subtract(np.repeat(row_lo.ravel(), kb).reshape(tiles, qt, kb), cpos, out=lo)
        np.maximum(lo, 0, out=lo)
        np.minimum(lo, hi, out=lo)
        needed = int(hi.sum()) - int(lo.sum())
        visible = False
    return (rows, cphys, lo, hi, visible), needed


def _one_group(col_users, req_sorted):
    """The requests of the step's one group when every shared column has the same users (a common
    prefix of a decode batch, the usual sharing), else None."""
    u = int(col_users[0])
    if not (col_users == u).all():
        return None
    per_col = req_sorted.reshape(col_users.size, u)
    return per_col[0] if (per_col == per_col[0]).all() else None


def _plan_one_group(users, first_pair, s_phys, s_blk, s_hi, starts, ctx, bs, T, qt, kb, out):
    """`plan_shared` for one-token requests (no window) whose shared columns form one group: the same arrays in a
    third of the calls (no grouping; one row chunk list and one column chunk list; a cell's `hi` is
    `clip(row context - column position, 0, bs)`, which is what the general path's cases give: real
    cells of one group, padding rows of context 0, padding columns at `_FAR`)."""
    u, C = users.size, first_pair.size
    n_rc, n_cc = -(-u // qt), -(-C // kb)
    rc_tok = np.full(n_rc * qt, T, _I64)
    rc_tok[:u] = starts[users]
    rc_ctx = np.zeros(n_rc * qt, _I64)
    rc_ctx[:u] = ctx[users]
    col_pos = s_blk[first_pair] * bs
    col_order = np.argsort(col_pos, kind="stable")  # columns in position order (the general lexsort)
    cc_phys = np.zeros(n_cc * kb, _I64)
    cc_phys[:C] = s_phys[first_pair[col_order]]
    cc_pos = np.full(n_cc * kb, _FAR, _I64)
    cc_pos[:C] = col_pos[col_order]
    ri, ci = np.divmod(np.arange(n_rc * n_cc), n_cc)  # row chunk major
    rows = out.array("shared_rows", (ri.size, qt))
    np.take(rc_tok.reshape(n_rc, qt), ri, axis=0, out=rows)
    cphys = out.array("shared_blocks", (ri.size, kb))
    np.take(cc_phys.reshape(n_cc, kb), ci, axis=0, out=cphys)
    col_pos_tiles = cc_pos.reshape(n_cc, kb).take(ci, axis=0)
    hi = out.array("shared_hi", (ri.size, qt, kb))
    np.subtract(rc_ctx.reshape(n_rc, qt).take(ri, axis=0)[:, :, None], col_pos_tiles[:, None, :], out=hi)
    _clip(hi, bs)
    visible = _prefix_visible(rc_ctx.reshape(n_rc, qt), ri, col_pos_tiles, bs)
    return (rows, cphys, out.zeros("shared_lo", hi.shape), hi, visible), int(s_hi.sum())


def _prefix_visible(rc_ctx, ri, col_pos, bs: int) -> bool:
    """Without a window: True when every tile's real rows all see the same keys and those keys are a
    prefix of the tile's slots (full blocks, then at most one partial one, then none), so a tile is one
    segment of a fused kernel with a key count (`paths/shared.py`). A cell's `hi` grows with the row's
    context, so a tile's rows agree when its shortest and longest real contexts do: per row chunk, not
    per cell (padding rows have context 0, padding columns start at `_FAR`)."""
    rc_t = rc_ctx.T  # [rows, chunks]: reductions and differences with the long axis last (numpy's inner loops)
    longest = rc_t.max(0)[ri]
    shortest = np.minimum(np.where(rc_t > 0, rc_t, _FAR).min(0)[ri], longest)
    pos = np.ascontiguousarray(col_pos.T)  # [blocks, tiles]
    top = _clip(longest - pos, bs)
    if not (top == _clip(shortest - pos, bs)).all():
        return False
    return bool(((top[1:] == 0) | (top[:-1] == bs)).all())


def _clip(x: np.ndarray, bs: int) -> np.ndarray:
    """`np.clip(x, 0, bs)` in place, without np.clip's per-call overhead (a few us on small arrays)."""
    np.maximum(x, 0, out=x)
    return np.minimum(x, bs, out=x)


def _full_blocks_hi(hi, cc_pos, ci, rc_ctx, rows_per_group, r_chunks, c_chunks, r_off, per_group, partial,
                    g_sorted, col0, cpos_sorted, bs):
    """`hi` without a window: `bs` on real cells, 0 on padding rows and columns, and the cells of the
    `partial` columns (a user's context ends inside the block) computed from the row's context."""
    tiles, qt, kb = hi.shape
    n_cc = cc_pos.size // kb
    col_full = np.where(cc_pos < _FAR, bs, 0).reshape(n_cc, kb).take(ci, axis=0)
    np.copyto(hi, np.repeat(col_full[:, None, :], qt, axis=1))
    tile_off = np.cumsum(per_group) - per_group
    real_rows = rows_per_group % qt  # real rows of a group's last row chunk (0: the chunk is full)
    padded = np.flatnonzero(real_rows)
    if padded.size:  # every tile of such a chunk: zero its padding rows
        k, own = ranges(np.zeros(padded.size, _I64), c_chunks[padded])
        g = padded[own]
        t = tile_off[g] + (r_chunks[g] - 1) * c_chunks[g] + k
        sub = hi[t]
        sub[np.arange(qt) >= real_rows[g][:, None]] = 0
        hi[t] = sub
    if partial.size:  # every tile of such a column (one per row chunk of its group), cell by cell
        g = g_sorted[partial]
        k, own = ranges(np.zeros(partial.size, _I64), r_chunks[g])
        g, local = g[own], (partial - col0[g_sorted[partial]])[own]
        t = tile_off[g] + k * c_chunks[g] + local // kb
        cells = rc_ctx.T[:, r_off[g] + k]  # [rows, cells]: the long axis last, for numpy's inner loops
        cells -= cpos_sorted[partial][own]
        _clip(cells, bs)
        hi[t, :, local % kb] = cells.T
