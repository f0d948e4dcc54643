"""The default planner's rules, written once for one step or many at a time.

`plan/default.py` applies them to one step and builds its arrays; the fast shape
replay of the bucketing tools (`tools/shapes.py`) applies them to thousands of
steps at once and only counts. A *segment* is one step: every array carries the
segment of its entries (one step: all zero), so the same code serves both.
"""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.plan.arrays import mix64, same_id_sum
from vllm_gaudi_unified.plan.options import PlanOptions


#: Largest cache slice the unique path reads in place (blocks): beyond it 'auto' gathers, 'slice' is refused.
MAX_SLICE_BLOCKS = 1 << 22


def segment_starts(keys: np.ndarray) -> np.ndarray:
    """Indices where a run of equal consecutive `keys` starts."""
    return np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if keys.size else np.zeros(0, np.int64)


def shared_pairs(block_key: np.ndarray, q: np.ndarray, counts: np.ndarray, unit_tokens: int = 1) -> np.ndarray:
    """Which (request, cached block) pairs go to the shared path, without a sliding window: the block is
    read by more than one request, because two pairs of its step hold it (`block_key`: the pair's
    block, unique per step), or by more new tokens of its request than a unique unit holds
    (`unit_tokens`, `PlanOptions.unique_tokens`; `counts`: pairs per request)."""
    # Counted over the ids in use, never an array as long as the largest id (`same_id_sum`).
    shared = same_id_sum(block_key, int(block_key.max())) > 1 if block_key.size else np.zeros(0, bool)
    multi = q > unit_tokens
    if multi.any():
        shared |= np.repeat(multi, counts)
    return shared


def unique_reads_slice(num_ids, max_id, options: PlanOptions):
    """Per step: does the unique path read the cache slice `[0, max id]` in place (True) or gather its
    `num_ids` live blocks? 'auto' reads the slice when at least `slice_min_density` of it is live."""
    if options.unique_layout == "auto":  # a slice beyond MAX_SLICE_BLOCKS is never read in place
        return (num_ids >= options.slice_min_density * (max_id + 1)) & (max_id < MAX_SLICE_BLOCKS)
    return np.full(np.shape(num_ids), options.unique_layout == "slice")


def group_columns(col_seg: np.ndarray, req_sorted: np.ndarray, req_key: np.ndarray, col_start: np.ndarray,
                  col_users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shared columns (a cached block at one position) grouped by the set of requests that read them.

    Columns are runs of `req_sorted` (ascending request ids) starting at `col_start`; `req_key` is each
    request's id within its step (hashed: the grouping of a step never depends on its neighbours).
    A 64-bit hash of the user set proposes the groups, numbered by segment, then hash; each column is
    then compared with its group's first one. Returns the group of each column and whether the column's
    user set differs from its group's (a hash collision: the caller must not merge those columns)."""
    col_hash = np.bitwise_xor.reduceat(mix64(req_key), col_start)
    g_order = np.lexsort((col_hash, col_seg))
    seg, hashes = col_seg[g_order], col_hash[g_order]
    new = np.empty(g_order.size, bool)  # (np.r_ costs more than the comparisons)
    new[0] = True
    np.not_equal(hashes[1:], hashes[:-1], out=new[1:])
    new[1:] |= seg[1:] != seg[:-1]
    col_group = np.empty(col_start.size, np.int64)
    col_group[g_order] = np.cumsum(new) - 1
    first = np.empty(int(col_group[g_order[-1]]) + 1, np.int64)
    first[col_group[g_order[::-1]]] = g_order[::-1]
    ref = first[col_group]
    bad = col_users != col_users[ref]
    in_col = np.arange(req_sorted.size) - np.repeat(col_start, col_users)
    ref_pair = np.repeat(np.where(bad, col_start, col_start[ref]), col_users) + in_col
    differs = req_sorted[ref_pair] != req_sorted
    if differs.any():
        bad |= np.add.reduceat(differs, col_start) > 0
    return col_group, bad


def shared_tiles(group_rows: np.ndarray, group_cols: np.ndarray, options: PlanOptions, block_size: int,
                 rows: int | None = None) -> np.ndarray:
    """Tiles per group of one step: every (chunk of `tile_rows` query tokens, chunk of `blocks_per_tile`
    blocks); the rows follow the step's groups (`PlanOptions.tile_rows`, or `rows` where the caller has
    them; fixed in a bucket plan's settings, whose tools pass groups of many steps at once)."""
    col_chunks = -(-group_cols // options.blocks_per_tile(block_size))
    rows = options.tile_rows(group_rows, col_chunks) if rows is None else rows
    return -(-group_rows // rows) * col_chunks


def causal_spans(tile_key: np.ndarray, t: np.ndarray, klo: np.ndarray, needs: np.ndarray,
                 tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Query tiles (runs of tokens with equal `tile_key`) and the key tiles each needs.

    Token at position `t` of its step's flattened tokens sees keys `klo .. t - 1` of new tokens
    (`needs`: at least one). Returns, per query tile: its first token, whether it holds a
    strict-causal pair, and its first and last key tile (tiles between two requests included
    only where a token of the query tile needs them)."""
    lo = np.where(needs, klo, np.iinfo(np.int64).max)
    hi = np.where(needs, t - 1, -1)
    start = segment_starts(tile_key)
    lo, hi = np.minimum.reduceat(lo, start), np.maximum.reduceat(hi, start)
    active = hi >= 0
    return start, active, np.where(active, lo, 0) // tile, hi // tile


def causal_tile_count(q: np.ndarray, tile: int) -> int:
    """The causal tiles `plan_step` lists for a step of `q` new tokens per request without a window (on the
    tiled route: every request's new tokens; `causal_spans`), counted, not built."""
    if int(q.max()) < 2:
        return 0
    t = np.arange(int(q.sum()))
    klo = np.repeat(np.cumsum(q) - q, q)
    _, active, first, last = causal_spans(t // tile, t, klo, klo <= t - 1, tile)
    return int((last - first + 1)[active].sum())
