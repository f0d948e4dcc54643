"""Plan one step on the host: which (query token, key) pairs each path computes.

Pure numpy, no torch, no vLLM: it runs every step, before any device work, and
the bucketing tools replay it over whole traces.

Lengths of one request `r` (positions in the sequence)::

    |---------- context_len ----------|---- query_len ----|
    |  keys read from the KV cache    | new tokens: q/k/v |
    0                            context_len        context_len + query_len

Token `j` of `r` sits at position `p = context_len + j` and attends positions
`max(0, p - sliding_window + 1) .. p` of `r`. The pairs are split, each pair
computed exactly once:

* **self**: every token against its own key (elementwise, always on);
* **causal**: a token against earlier new tokens of its request, in square
  tiles on the flattened token axis; only tiles some pair needs are listed, so
  tiles that pair two requests are never computed;
* **shared**: cache blocks needed by more than one query token (a chunk over its
  own context, a prefix common to several requests). Blocks are grouped by the
  set of requests that use them and each group is cut into tiles of
  `shared_rows` query tokens x `blocks_per_tile` blocks, so a prefix common to
  64 decodes is read once for all 64 and no token meets a block it cannot see;
* **unique**: cache blocks needed by exactly one query token (the usual decode),
  one row per block, computed per block rather than per token; either the
  contiguous cache slice `[0, max id + 1)` (no gather) or only the live blocks
  (gathered), whichever the layout option picks for this step.

Visibility inside a cache block is one interval of slots `[lo, hi)` per
(token, block): `hi` cuts the context (a partial last block, or a block this
token's request does not use), `lo` applies the sliding window. No dense bias
is built on the host: the device makes masks from these small integer arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of

#: Layouts of the unique path: read `[0, max id + 1)` of the cache in place, or gather live blocks.
UNIQUE_LAYOUTS = ("auto", "slice", "gather")


@dataclass(frozen=True)
class PlanOptions:
    """Tile sizes and choices of the planner; one graph per bucket *and* options."""

    causal_tile: int = 64  #: query rows = key columns of a causal tile
    shared_rows: int = 8  #: query rows of a shared tile (small: decode groups sharing a prefix are often 2-16 requests)
    shared_tile_keys: int = 512  #: keys of a shared tile, rounded down to whole blocks (at least one)
    unique_layout: str = "auto"  #: 'slice', 'gather', or 'auto' (slice when dense enough)
    slice_min_density: float = 0.5  #: 'auto' reads the slice when live blocks / (max id + 1) >= this
    batch_invariant: bool = False  #: same bits for a request whatever its batch (docs/batch_invariance.md)
    invariant_rows: int = 8  #: batch_invariant: query tokens per cached-block unit (the block is read once per unit)
    invariant_chunk: int = 512  #: batch_invariant: cached-block units per product (one shape for every call)
    invariant_causal_chunk: int = 16  #: batch_invariant: causal tiles per product

    def __post_init__(self):
        for name in ("causal_tile", "shared_rows", "shared_tile_keys", "invariant_rows", "invariant_chunk",
                     "invariant_causal_chunk"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PlanOptions.{name} must be an int >= 1, got {value!r}")
        if self.unique_layout not in UNIQUE_LAYOUTS:
            raise ValueError(f"PlanOptions.unique_layout must be one of {UNIQUE_LAYOUTS}, got {self.unique_layout!r}")
        if not 0.0 <= self.slice_min_density <= 1.0:
            raise ValueError(f"PlanOptions.slice_min_density must be in [0, 1], got {self.slice_min_density!r}")

    def blocks_per_tile(self, block_size: int) -> int:
        """Cache blocks in one shared tile."""
        return max(1, self.shared_tile_keys // block_size)


DEFAULT_OPTIONS = PlanOptions()


@dataclass(frozen=True)
class PathWork:
    """Score work of a step in (query token, key) pairs, per path; `causal` includes the self pairs."""

    causal: int = 0
    shared: int = 0
    unique: int = 0

    @property
    def total(self) -> int:
        return self.causal + self.shared + self.unique

    def __add__(self, other: "PathWork") -> "PathWork":
        return PathWork(self.causal + other.causal, self.shared + other.shared, self.unique + other.unique)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything the device needs for one step, as numpy arrays (row index `query_len` = no row).

    Shapes use the padded sizes of `bucket`; before padding, `bucket == shape`.
    """

    block_size: int
    sliding_window: int | None
    options: PlanOptions
    num_requests: int
    num_tokens: int  #: real new tokens; rows past it are padding
    shape: Bucket  #: the step's own (unpadded) shape
    bucket: Bucket  #: the shape the arrays have (padded)
    token_seg_start: np.ndarray  #: [query_len] flattened index of the token's first request token (own index for padding)
    causal_q_start: np.ndarray  #: [num_causal_tiles] first query row of each tile (query_len for padding tiles)
    causal_k_start: np.ndarray  #: [num_causal_tiles] first key (flattened new-token index) of each tile
    shared_rows: np.ndarray  #: [tiles, shared_rows] query token of each tile row
    shared_blocks: np.ndarray  #: [tiles, blocks_per_tile] physical block of each tile column
    shared_lo: np.ndarray  #: [tiles, shared_rows, blocks_per_tile] first visible slot
    shared_hi: np.ndarray  #: [tiles, shared_rows, blocks_per_tile] end of visible slots (0 = block unseen)
    unique_rows: np.ndarray  #: [num_unique_blocks] the one query token of each block slot
    unique_blocks: np.ndarray | None  #: [num_unique_blocks] gathered block ids; None = slice [0, num_unique_blocks)
    unique_lo: np.ndarray  #: [num_unique_blocks]
    unique_hi: np.ndarray  #: [num_unique_blocks]
    logits_indices: np.ndarray  #: [num_logits] last new token of each request
    max_block_id: int  #: largest cache block id read (-1: none); checked against the cache
    work_needed: PathWork  #: pairs the step needs
    work_dense: PathWork | None  #: pairs the dense design would compute (only with plan_step(dense_work=True))
    # Batch-invariant plans only (options.batch_invariant; see invariant.py), else None / 0. There the
    # causal tiles are counted from each request's first token and the cached blocks come as units.
    inv_unit_rows: np.ndarray | None = None  #: [units, invariant_rows] query token per unit row (query_len: none)
    inv_unit_block: np.ndarray | None = None  #: [units] the one cache block of each unit
    inv_unit_col: np.ndarray | None = None  #: [units, invariant_rows] logical index of the block in the row's request
    inv_unit_lo: np.ndarray | None = None  #: [units, invariant_rows] first visible slot
    inv_unit_hi: np.ndarray | None = None  #: [units, invariant_rows] end of visible slots
    inv_causal_col: np.ndarray | None = None  #: [num_causal_tiles] key tile index within its request
    inv_cached_width: int = 0  #: slots per token for cached partials (a power of two)
    inv_causal_width: int = 0  #: slots per token for causal partials (a power of two)

    @property
    def unique_layout(self) -> str:
        """'slice' (contiguous cache slice, no gather) or 'gather' (live blocks only)."""
        return "slice" if self.unique_blocks is None else "gather"

    @property
    def work_planned(self) -> PathWork:
        """Pairs the device computes for the arrays as they are (padding included)."""
        b, opts = self.bucket, self.options
        if opts.batch_invariant:
            return PathWork(causal=b.num_causal_tiles * opts.causal_tile**2 + b.query_len,
                            shared=b.num_shared_blocks * opts.invariant_rows * self.block_size)
        return PathWork(
            causal=b.num_causal_tiles * opts.causal_tile**2 + b.query_len,
            shared=b.num_shared_blocks * opts.shared_rows * self.block_size,
            unique=b.num_unique_blocks * self.block_size,
        )


# ----------------------------------------------------------------------------- validation


def _int_vector(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _first_bad(name: str, mask: np.ndarray, values: np.ndarray, need: str) -> None:
    if mask.any():
        i = int(np.argmax(mask))
        raise ValueError(f"{name}[{i}] = {int(values[i])} must be {need}")


def _validate(query_lens, context_lens, block_table, block_size, sliding_window, num_blocks):
    q = _int_vector("query_lens", query_lens)
    ctx = _int_vector("context_lens", context_lens)
    if q.size == 0:
        raise ValueError("query_lens is empty: a step needs at least one request")
    if ctx.size != q.size:
        raise ValueError(f"context_lens has {ctx.size} entries but query_lens has {q.size}")
    if q.min() < 1:  # one reduction on the common path; the mask only when something is wrong
        _first_bad("query_lens", q < 1, q, ">= 1")
    if ctx.min() < 0:
        _first_bad("context_lens", ctx < 0, ctx, ">= 0")
    bt = np.asarray(block_table)
    if bt.ndim != 2 or bt.shape[0] != q.size:
        raise ValueError(f"block_table must have shape [{q.size}, max_blocks], got {tuple(bt.shape)}")
    if bt.size and bt.dtype.kind not in "iu":
        raise ValueError(f"block_table must hold integers, got dtype {bt.dtype}")
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if sliding_window is not None and (not isinstance(sliding_window, (int, np.integer)) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if num_blocks is not None and (not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1):
        raise ValueError(f"num_blocks must be None or an int >= 1, got {num_blocks!r}")
    nb_ctx = (ctx + block_size - 1) // block_size
    if nb_ctx.max() > bt.shape[1]:
        r = int(np.argmax(nb_ctx > bt.shape[1]))
        raise ValueError(
            f"block_table has {bt.shape[1]} columns but request {r} needs {int(nb_ctx[r])} blocks "
            f"for context_lens[{r}] = {int(ctx[r])} (block_size {block_size})")
    return q, ctx, np.ascontiguousarray(bt, dtype=np.int64), nb_ctx


# ----------------------------------------------------------------------------- helpers


def _ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate `arange(starts[i], starts[i] + counts[i])`; also return the owner i of each item."""
    owner = np.repeat(np.arange(counts.size), counts)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(owner.size), owner


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit hash per request index (groups blocks by user set)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _tile(group_sizes: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut groups of `group_sizes` items into chunks of `tile`.

    Returns, per chunk, its group, its first item (global index into the
    group-sorted item list) and its item count."""
    chunks = -(-group_sizes // tile)
    local, group = _ranges(np.zeros_like(chunks), chunks)
    group_offsets = np.cumsum(group_sizes) - group_sizes
    first = group_offsets[group] + local * tile
    return group, first, np.minimum(tile, group_sizes[group] - local * tile)


def _chunk_index(first: np.ndarray, count: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, width] item indices of chunks (clipped) and which of them are real."""
    idx = first[:, None] + np.arange(width)
    valid = np.arange(width) < count[:, None]
    return np.where(valid, idx, 0), valid


# ----------------------------------------------------------------------------- the planner


def plan_step(query_lens, context_lens, block_table, block_size: int, *, sliding_window: int | None = None,
              num_blocks: int | None = None, options: PlanOptions | None = None,
              dense_work: bool = False) -> StepPlan:
    """Plan one scheduler step (see the module docstring); arrays are unpadded: `bucket == shape`.

    `dense_work`: also count what the dense design would compute (for trace statistics; costs time)."""
    opts = options or DEFAULT_OPTIONS
    if opts.batch_invariant:
        from vllm_gaudi_unified.invariant import plan_step_invariant

        return plan_step_invariant(query_lens, context_lens, block_table, block_size, sliding_window=sliding_window,
                                   num_blocks=num_blocks, options=opts)
    q, ctx, bt, nb_ctx = _validate(query_lens, context_lens, block_table, block_size, sliding_window, num_blocks)
    bs, W = int(block_size), sliding_window
    R, T = q.size, int(q.sum())
    starts = np.cumsum(q) - q
    if T == R:  # every request has one new token (decodes): no ranges to build
        tok_j, tok_req = np.zeros(R, np.int64), np.arange(R)
    else:
        tok_j, tok_req = _ranges(np.zeros_like(q), q)
    seg_start = starts[tok_req]
    tok_pos = ctx[tok_req] + tok_j

    # (request, cached block) pairs some token of the request can see, as flat indices into the table.
    first_blk = np.zeros_like(ctx) if W is None else np.maximum(ctx - W + 1, 0) // bs
    counts = np.maximum(nb_ctx - first_blk, 0)
    width = bt.shape[1]
    flat, pair_req = _ranges(np.arange(R) * width + first_blk, counts)
    pair_blk = flat - pair_req * width
    phys = bt.ravel()[flat]
    max_block_id = int(phys.max()) if phys.size else -1
    if phys.size and (phys.min() < 0 or (num_blocks is not None and max_block_id >= num_blocks)):
        _first_bad_block(phys, pair_req, pair_blk, num_blocks)
    pair_hi = np.full(flat.size, bs, np.int64)  # every block is full but a request's last one
    last = (np.cumsum(counts) - 1)[counts > 0]
    pair_hi[last] = ctx[counts > 0] - pair_blk[last] * bs
    if W is None:  # every token of the request sees every block
        uses = np.bincount(phys, minlength=max_block_id + 1)
        is_shared = (uses[phys] > 1) if uses.size and uses.max() > 1 else np.zeros(phys.size, bool)
        if T > R:
            is_shared |= np.repeat(q > 1, counts)
    else:  # token j sees the block's last key k while j <= k - context_len + W - 1
        users = np.clip(pair_blk * bs + pair_hi - 1 - ctx[pair_req] + W, 0, q[pair_req])
        is_shared = np.bincount(phys, weights=users, minlength=max_block_id + 1)[phys] > 1

    unique = _plan_unique(~is_shared, phys, pair_req, pair_blk, pair_hi, starts, ctx, bs, W, T, opts, counts)
    shared = _plan_shared(is_shared, phys, pair_req, pair_blk, q, starts, ctx, bt, nb_ctx, first_blk,
                          tok_req, tok_pos, bs, W, T, opts)
    causal_q, causal_k, causal_needed = _plan_causal(seg_start, tok_j, T, W, opts.causal_tile)

    kb = opts.blocks_per_tile(bs)
    shape = Bucket(
        phase=phase_of(causal_q.size, shared[0].shape[0], unique[0].size),
        query_len=T, num_shared_blocks=shared[0].shape[0] * kb, num_unique_blocks=unique[0].size,
        num_logits=R, num_causal_tiles=causal_q.size)
    needed = PathWork(causal=causal_needed, shared=int((shared[3] - shared[2]).sum()),
                      unique=int((unique[3] - unique[2]).sum()))
    dense = _dense_work(phys, is_shared, T, bs) if dense_work else None
    return StepPlan(
        block_size=bs, sliding_window=W, options=opts, num_requests=R, num_tokens=T, shape=shape, bucket=shape,
        token_seg_start=seg_start, causal_q_start=causal_q, causal_k_start=causal_k,
        shared_rows=shared[0], shared_blocks=shared[1], shared_lo=shared[2], shared_hi=shared[3],
        unique_rows=unique[0], unique_blocks=unique[1], unique_lo=unique[2], unique_hi=unique[3],
        logits_indices=(starts + q - 1), max_block_id=max_block_id,
        work_needed=needed, work_dense=dense)


def _dense_work(phys, is_shared, T, bs) -> PathWork:
    """The design before tiling: 512-row causal slices over the flattened batch, every token
    against every shared block, the unique slice [0, max id]."""
    n_shared_blocks = np.unique(phys[is_shared]).size
    unique_ids = phys[~is_shared]
    return PathWork(causal=sum(512 * min(T, (a + 1) * 512) for a in range(-(-T // 512))),
                    shared=T * n_shared_blocks * bs,
                    unique=(int(unique_ids.max()) + 1) * bs if unique_ids.size else 0)


def _first_bad_block(phys, pair_req, pair_blk, num_blocks):
    bad = phys < 0 if num_blocks is None else (phys < 0) | (phys >= num_blocks)
    if bad.any():
        i = int(np.argmax(bad))
        limit = "" if num_blocks is None else f" and < num_blocks {num_blocks}"
        raise ValueError(f"block_table[{int(pair_req[i])}, {int(pair_blk[i])}] = {int(phys[i])} is needed "
                         f"for the context but must be >= 0{limit}")


def _plan_unique(mask, phys, pair_req, pair_blk, pair_hi, starts, ctx, bs, W, T, opts, counts):
    """One row per block used by exactly one token: the first token of its request (the only
    one that sees it: with a window, later tokens see less far back)."""
    if mask.all():  # the usual decode step: every pair is unique, rows by repeating (no gather)
        rows = np.repeat(starts, counts)
    else:
        phys, pair_req, pair_blk, pair_hi = phys[mask], pair_req[mask], pair_blk[mask], pair_hi[mask]
        rows = starts[pair_req]
    ids, req, blk, hi = phys, pair_req, pair_blk, pair_hi
    lo = np.zeros_like(hi) if W is None else np.clip(ctx[req] - W + 1 - blk * bs, 0, hi)
    if ids.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, (empty if opts.unique_layout == "gather" else None), empty, empty
    span = int(ids.max()) + 1
    layout = opts.unique_layout
    if layout == "auto":
        layout = "slice" if ids.size >= opts.slice_min_density * span else "gather"
    if layout == "gather":
        return rows, ids, lo, hi
    slot_rows = np.full(span, T, np.int64)
    slot_hi = np.zeros(span, np.int64)
    slot_rows[ids], slot_hi[ids] = rows, hi
    slot_lo = np.zeros(span, np.int64)
    if W is not None:  # without a window every lo is 0
        slot_lo[ids] = lo
    return slot_rows, None, slot_lo, slot_hi


def _plan_shared(mask, phys, pair_req, pair_blk, q, starts, ctx, bt, nb_ctx, first_blk, tok_req, tok_pos,
                 bs, W, T, opts):
    """Tiles of (query tokens x blocks) over groups of blocks with the same set of user requests.

    Every row of a group uses every column of the group (the grouping is exact),
    so a cell's visible slots follow from the row's context length and position
    and the column's first position alone: no per-cell lookup of the block table."""
    qt, kb = opts.shared_rows, opts.blocks_per_tile(bs)
    if not mask.any():
        z = np.zeros((0, qt, kb), np.int64)
        return np.zeros((0, qt), np.int64), np.zeros((0, kb), np.int64), z, z
    s_phys, s_req, s_blk = phys[mask], pair_req[mask], pair_blk[mask]
    # Columns are (block id, position in the request); pairs sorted by column, requests in order within one.
    col_key = s_phys * bt.shape[1] + s_blk
    order = np.argsort(col_key, kind="stable")
    col_key_sorted, req_sorted = col_key[order], s_req[order]
    col_start = np.flatnonzero(np.r_[True, col_key_sorted[1:] != col_key_sorted[:-1]])
    col_users = np.diff(np.r_[col_start, order.size])
    col_group = _exact_groups(req_sorted, col_start, col_users, q.size)
    col_phys, col_blk = s_phys[order][col_start], s_blk[order][col_start]
    G = int(col_group.max()) + 1
    # A group's requests are those of its first column (all its columns have the same users).
    first_col = np.full(G, -1, np.int64)
    first_col[col_group[::-1]] = np.arange(col_group.size)[::-1]
    req_idx, gr_group = _ranges(col_start[first_col], col_users[first_col])
    gr_req = req_sorted[req_idx]
    # Group-sorted row list (tokens of the group's requests) and column list.
    rows_flat, _ = _ranges(starts[gr_req], q[gr_req])
    rows_per_group = np.bincount(gr_group, weights=q[gr_req], minlength=G).astype(np.int64)
    col_order = np.argsort(col_group, kind="stable")
    cols_per_group = np.bincount(col_group, minlength=G)
    # Tiles: every (row chunk, column chunk) of each group.
    r_grp, r_first, r_cnt = _tile(rows_per_group, qt)
    c_grp, c_first, c_cnt = _tile(cols_per_group, kb)
    r_chunks, c_chunks = -(-rows_per_group // qt), -(-cols_per_group // kb)
    pair_local, tile_group = _ranges(np.zeros(G, np.int64), r_chunks * c_chunks)
    r_off, c_off = np.cumsum(r_chunks) - r_chunks, np.cumsum(c_chunks) - c_chunks
    ri = r_off[tile_group] + pair_local // c_chunks[tile_group]
    ci = c_off[tile_group] + pair_local % c_chunks[tile_group]
    row_idx, row_ok = _chunk_index(r_first[ri], r_cnt[ri], qt)
    col_idx, col_ok = _chunk_index(c_first[ci], c_cnt[ci], kb)
    rows = np.where(row_ok, rows_flat[row_idx], T)
    cphys = np.where(col_ok, col_phys[col_order][col_idx], 0)
    # Visible slots of a cell: [lo, hi) with hi = the row's context past the block start (0 for padding).
    row_ctx = np.where(row_ok, ctx[tok_req[np.minimum(rows, T - 1)]], 0)  # [tiles, rows]
    col_pos = np.where(col_ok, col_blk[col_order][col_idx] * bs, 0)  # [tiles, blocks]
    hi = np.clip(row_ctx[:, :, None] - col_pos[:, None, :], 0, bs) * col_ok[:, None, :]
    if W is None:
        lo = np.zeros_like(hi)
    else:
        row_lo = tok_pos[np.minimum(rows, T - 1)] - W + 1  # first visible position of the row
        lo = np.clip(row_lo[:, :, None] - col_pos[:, None, :], 0, hi)
    return rows, cphys, lo, hi


def _exact_groups(req_sorted, col_start, col_users, num_requests):
    """Group id per column, columns with equal user sets together.

    A 64-bit hash of the user set proposes the groups; membership in a
    [groups, requests] table then checks every column exactly, and a failed
    check (a hash collision) falls back to one group per column, so a tile
    never pairs a token with a block its request does not hold."""
    col_hash = np.bitwise_xor.reduceat(_mix64(req_sorted), col_start)
    _, col_group = np.unique(col_hash, return_inverse=True)
    col_group = col_group.ravel()
    G = int(col_group.max()) + 1
    pair_group = np.repeat(col_group, col_users)
    member = np.zeros((G, num_requests), bool)
    member[pair_group, req_sorted] = True
    exact = (member.sum(1)[col_group] == col_users).all()
    return col_group if exact else np.arange(col_start.size)


def _plan_causal(seg_start, tok_j, T, W, tile):
    """Tiles (query slice, key slice) on the flattened token axis that hold some strict-causal pair."""
    if tok_j.size == 0 or tok_j.max() == 0:  # single-token requests: only self pairs
        empty = np.zeros(0, np.int64)
        return empty, empty, T
    t = np.arange(T)
    klo = seg_start if W is None else np.maximum(seg_start, t - W + 1)
    needs = klo <= t - 1  # at least one earlier new token of the same request is visible
    needed = int(np.minimum(tok_j + 1, W if W is not None else T + 1).sum())
    if not needs.any():
        empty = np.zeros(0, np.int64)
        return empty, empty, needed
    n = -(-T // tile)
    big = np.iinfo(np.int64).max
    lo = np.full(n * tile, big, np.int64)
    hi = np.full(n * tile, -1, np.int64)
    lo[:T] = np.where(needs, klo, big)
    hi[:T] = np.where(needs, t - 1, -1)
    lo, hi = lo.reshape(n, tile).min(1), hi.reshape(n, tile).max(1)
    active = np.flatnonzero(hi >= 0)
    first_k, last_k = lo[active] // tile, hi[active] // tile
    k_tiles, owner = _ranges(first_k, last_k - first_k + 1)
    return (active[owner] * tile), (k_tiles * tile), needed


# ----------------------------------------------------------------------------- padding


def pad_plan(plan: StepPlan, bucket: Bucket) -> StepPlan:
    """The same step padded to `bucket`; padding adds only fully masked work."""
    if bucket == plan.bucket:
        return plan
    if plan.options.batch_invariant:
        from vllm_gaudi_unified.invariant import pad_plan_invariant

        return pad_plan_invariant(plan, bucket)
    _check_covers(bucket, plan.shape)
    kb = plan.options.blocks_per_tile(plan.block_size)
    if bucket.num_shared_blocks % kb:
        raise ValueError(f"bucket num_shared_blocks {bucket.num_shared_blocks} is not a multiple of the "
                         f"{kb} blocks of a shared tile (block_size {plan.block_size})")
    T, Tp = plan.bucket.query_len, bucket.query_len

    def rows(a):  # move the "no row" marker from the old to the new token count
        return np.where(a == T, Tp, a)

    def grow(a, n, fill):
        extra = np.full((n - a.shape[0],) + a.shape[1:], fill, a.dtype)
        return np.concatenate([a, extra])

    ns = bucket.num_shared_blocks // kb
    nu = bucket.num_unique_blocks
    return replace(
        plan, bucket=bucket,
        token_seg_start=np.concatenate([plan.token_seg_start, np.arange(T, Tp, dtype=np.int64)]),
        causal_q_start=grow(rows(plan.causal_q_start), bucket.num_causal_tiles, Tp),
        causal_k_start=grow(plan.causal_k_start, bucket.num_causal_tiles, 0),
        shared_rows=grow(rows(plan.shared_rows), ns, Tp), shared_blocks=grow(plan.shared_blocks, ns, 0),
        shared_lo=grow(plan.shared_lo, ns, 0), shared_hi=grow(plan.shared_hi, ns, 0),
        unique_rows=grow(rows(plan.unique_rows), nu, Tp),
        unique_blocks=None if plan.unique_blocks is None else grow(plan.unique_blocks, nu, 0),
        unique_lo=grow(plan.unique_lo, nu, 0), unique_hi=grow(plan.unique_hi, nu, 0),
        logits_indices=grow(plan.logits_indices, bucket.num_logits, 0))


def _check_covers(bucket: Bucket, shape: Bucket) -> None:
    from dataclasses import fields

    for f in fields(Bucket)[1:]:
        need, have = getattr(shape, f.name), getattr(bucket, f.name)
        if have < need:
            raise ValueError(f"bucket {bucket} does not cover the step: {f.name} {need} > {have}")
