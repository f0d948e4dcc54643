"""Group tiles of the batch-invariant tile route: one read of a context chunk for the decodes that share it.

A decode's context chunk is a one-row tile (`plan/invariant.py`); when several decodes of a step read the
same whole chunk (a shared prefix, parallel sampling: the same physical blocks at the same chunk index,
every slot seen), their rows go into *group tiles* of `invariant_rows` rows instead (the last one padded
with no-rows), so the chunk's keys and values are gathered once per tile, not once per decode.

Why a row's bits do not change with its tile (`paths/invariant.py` runs both): a group tile's products are
the one-row tile's with the rows stacked, `[R * Hq, D] @ [D, keys * Hkv]` and `[R * Hq, keys * Hkv] @
[keys * Hkv, Dv]`, and every other operation (the head-diagonal pick, the softmax, the slot write and the
fold) runs on the same `[tiles, Hq, ...]` shapes as a call of one-row tiles. A matrix product computes
each output row from that row of its left operand and the whole right operand alone, through the same
reduction over the inner dimension whatever the rows around it (checked bitwise on each device by
tests/test_batch_invariance.py); the products' shapes are fixed (`group_tiles_per_call` tiles of
`invariant_rows` rows per call), never set by the batch.
"""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.plan.options import PlanOptions


def group_tiles_per_call(opts: PlanOptions) -> int:
    """Group tiles per product: as many rows as a call of one-row tiles (`invariant_chunk`) where they divide."""
    return max(1, opts.invariant_chunk // opts.invariant_rows)


def split_groups(dec: dict, T: int, bs: int, opts: PlanOptions, per_call: int) -> tuple[dict, dict]:
    """`dec` (one-row tiles of `_plan_tiles`) -> (the one-row tiles left, padded to `per_call`; group tiles
    `rows` `[n, invariant_rows]`, `blocks`, `col`, padded to `group_tiles_per_call`). A tile joins a group
    when its chunk is whole (every slot of every block seen) and another decode's tile has the same blocks
    at the same chunk index; members in token order."""
    rows, R = dec["rows"][:, 0], opts.invariant_rows
    whole = (rows < T) & (dec["lo"] == 0).all((1, 2)) & (dec["hi"] == bs).all((1, 2))
    key = np.concatenate([dec["blocks"], dec["col"][:, None].astype(np.int64)], 1)
    inv = np.full(rows.shape, -1, np.int64)
    if R >= 2 and whole.any():
        _, inv_w, counts = np.unique(key[whole], axis=0, return_inverse=True, return_counts=True)
        inv_w = inv_w.reshape(-1)
        inv[whole] = np.where(counts[inv_w] >= 2, inv_w, -1)
    grouped = inv >= 0
    order = np.flatnonzero(grouped)[np.lexsort((rows[grouped], inv[grouped]))]
    g = inv[order]
    _, first, counts = np.unique(g, return_index=True, return_counts=True)
    rank = np.arange(g.size) - np.repeat(first, counts)
    tiles = -(-counts // R)
    tile = np.repeat(np.cumsum(tiles) - tiles, counts) + rank // R
    n = -(-int(tiles.sum()) // group_tiles_per_call(opts)) * group_tiles_per_call(opts)
    grp = dict(rows=np.full((n, R), T, np.int32), blocks=np.zeros((n, key.shape[1] - 1), np.int64),
               col=np.zeros(n, np.int32))
    grp["rows"][tile, rank % R] = rows[order]
    grp["blocks"][tile], grp["col"][tile] = dec["blocks"][order], dec["col"][order]
    keep = (rows < T) & ~grouped
    m = -(-int(keep.sum()) // per_call) * per_call
    fills = dict(rows=T, blocks=0, lo=0, hi=0, col=0)
    left = {}
    for name, a in dec.items():
        left[name] = np.full((m,) + a.shape[1:], fills[name], a.dtype)
        left[name][:int(keep.sum())] = a[keep]
    return left, grp
