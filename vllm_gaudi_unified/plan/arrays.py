"""Array helpers shared by the planners (default and batch-invariant): input checks, ranges, tiling, padding.

All vectorised numpy: a step's planning never loops over tokens in Python.
"""
from __future__ import annotations

from dataclasses import MISSING, fields

import numpy as np

from vllm_gaudi_unified.bucket import Bucket

#: Most new tokens one step may schedule: far above any scheduler's token budget, far below what
#: would make the planner's O(tokens) arrays a MemoryError instead of an error message.
MAX_STEP_TOKENS = 1 << 24
#: Largest position (context_len + query_len): positions stay far from int64 overflow.
MAX_POSITION = 1 << 40
#: Largest block size: slots per block stay int32 (vLLM's largest are a few hundred).
MAX_BLOCK_SIZE = 1 << 20
#: Largest sliding window or cache size given as a number.
MAX_SCALAR = 1 << 62
_INT64_MAX = np.iinfo(np.int64).max


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (`True` is not a size)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _as_array(name: str, values, what: str) -> np.ndarray:
    if type(values) is np.ndarray:  # (what np.asarray returns as is: no attribute lookups on the usual step)
        return values
    device = getattr(values, "device", None)  # a torch tensor: the host reads it, so only a CPU one
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"{name} is a tensor on {device}: the planner runs on the host (a list, a numpy array "
                         "or a CPU tensor)")
    try:
        return np.asarray(values)
    except (ValueError, TypeError):  # ragged rows, mixed types
        raise ValueError(f"{name} must be {what}, got a ragged or mixed sequence") from None


def _check_integers(name: str, arr: np.ndarray) -> None:
    """Integer dtype, and no uint64 value that int64 would silently turn negative."""
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > _INT64_MAX:
        i = np.unravel_index(int(np.argmax(arr > _INT64_MAX)), arr.shape)
        raise ValueError(f"{name}[{', '.join(map(str, i))}] = {int(arr[i])} is beyond int64")


def int_vector(name: str, values) -> np.ndarray:
    arr = _as_array(name, values, "a 1-D sequence of integers")
    if arr.ndim != 1:
        got = f"shape {arr.shape}" if arr.ndim else f"{type(values).__name__} {values!r:.40}"
        raise ValueError(f"{name} must be 1-D, got {got}")
    _check_integers(name, arr)
    return arr.astype(np.int64, copy=False)


def first_bad(name: str, mask: np.ndarray, values: np.ndarray, need: str) -> None:
    if mask.any():
        i = int(np.argmax(mask))
        raise ValueError(f"{name}[{i}] = {int(values[i])} must be {need}")


def _check_scalar(name: str, value, optional: bool, limit: int) -> None:
    if optional and value is None:
        return
    if not is_int(value) or value < 1:
        shown = value.item() if isinstance(value, np.generic) else value  # True, not np.True_
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= 1, got {shown!r}")
    if value > limit:
        raise ValueError(f"{name} = {value} is beyond the largest accepted, {limit}")


def check_scalars(block_size, sliding_window=None, num_blocks=None, *, num_blocks_given: bool = False) -> None:
    """`plan_step`'s rules for its scalar arguments, the one check of them: also for settings read before
    any step (bucket plan files, `ServerSettings`, which always have `num_blocks_given`), so a file cannot
    hold a value `plan_step` refuses."""
    _check_scalar("block_size", block_size, False, MAX_BLOCK_SIZE)
    _check_scalar("sliding_window", sliding_window, True, MAX_SCALAR)
    _check_scalar("num_blocks", num_blocks, not num_blocks_given, MAX_SCALAR)


def validate(query_lens, context_lens, block_table, block_size, sliding_window, num_blocks):
    """Checked int64 copies of the step's arrays (and blocks per context), or a ValueError naming the
    field and the value. A few reductions on the common path; the masks only when something is wrong."""
    q = int_vector("query_lens", query_lens)
    ctx = int_vector("context_lens", context_lens)
    if q.size == 0:
        raise ValueError("query_lens is empty: a step needs at least one request")
    if ctx.size != q.size:
        raise ValueError(f"context_lens has {ctx.size} entries but query_lens has {q.size}")
    if q.min() < 1:
        first_bad("query_lens", q < 1, q, ">= 1")
    ctx_max = int(ctx.view(np.uint64).max())  # a negative length reads as huge: one reduction checks both ends
    if ctx_max > _INT64_MAX:
        first_bad("context_lens", ctx < 0, ctx, ">= 0")
    q_max = int(q.max())
    if q_max > MAX_STEP_TOKENS or q_max * q.size > MAX_STEP_TOKENS and int(q.sum()) > MAX_STEP_TOKENS:
        raise ValueError(f"sum(query_lens) = {sum(int(x) for x in q)} new tokens in one step: the planner "
                         f"takes at most {MAX_STEP_TOKENS}")
    if ctx_max + q_max > MAX_POSITION:
        r = int(np.argmax(ctx + q > MAX_POSITION))
        raise ValueError(f"context_lens[{r}] = {int(ctx[r])} with query_lens[{r}] = {int(q[r])}: positions "
                         f"beyond {MAX_POSITION}")
    check_scalars(block_size, sliding_window, num_blocks)
    bt = _as_array("block_table", block_table, "a 2-D table of integers (rows of equal length)")
    if bt.ndim != 2 or bt.shape[0] != q.size:
        raise ValueError(f"block_table must have shape [{q.size}, max_blocks], got {tuple(bt.shape)}")
    _check_integers("block_table", bt)
    bs = int(block_size)
    nb_ctx = (ctx + (bs - 1)) // bs
    need = -(-ctx_max // bs)
    if need > bt.shape[1]:
        r = int(np.argmax(nb_ctx > bt.shape[1]))
        raise ValueError(
            f"block_table has {bt.shape[1]} columns but request {r} needs {int(nb_ctx[r])} blocks "
            f"for context_lens[{r}] = {int(ctx[r])} (block_size {block_size})")
    return q, ctx, _needed_columns(bt, ctx_max, bs), nb_ctx


def checked_rows(checked: tuple, rows, block_size: int) -> tuple:
    """`validate`'s result (`checked`, at `block_size`) for the requests `rows` of the step (a bool mask or
    indices): what `validate` returns for those requests' own arrays, without checking them again."""
    q, ctx, bt, nb_ctx = (a[rows] for a in checked)
    if not q.size:
        raise ValueError("rows select no request: a step needs at least one request")
    return q, ctx, _needed_columns(bt, int(ctx.max()), int(block_size)), nb_ctx


def _needed_columns(bt: np.ndarray, ctx_max: int, block_size: int) -> np.ndarray:
    """Only the columns some context needs (int64, contiguous): a server's table is as wide as its longest
    sequence."""
    return np.ascontiguousarray(bt[:, :-(-ctx_max // block_size)], dtype=np.int64)


#: Most causal tiles of one step (a 2**20-token prompt at causal_tile 1 would need 2**39).
MAX_CAUSAL_TILES = 1 << 24


def check_causal_tiles(count: int, tile: int) -> None:
    """Refuse a step whose causal tiles would not fit, before they are listed."""
    if count > MAX_CAUSAL_TILES:
        raise ValueError(f"the step needs {count} causal tiles of {tile} tokens: more than {MAX_CAUSAL_TILES}; "
                         "use a larger causal_tile or fewer new tokens per step")


def same_id_sum(ids: np.ndarray, largest: int, weights: np.ndarray | None = None) -> np.ndarray:
    """For each item, how many items (or their summed weights) carry the same id. Memory is bounded by
    the items, never by the largest id (an id of 2**62 must not allocate 2**62 counters): one bincount
    when the ids are dense enough (the common case, no sort), else over ids compacted by `np.unique`."""
    if largest < max(8 * ids.size, 1 << 16):
        return np.bincount(ids, weights, minlength=largest + 1)[ids]
    _, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.ravel()
    return np.bincount(inverse, weights)[inverse]


def ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate `arange(starts[i], starts[i] + counts[i])`; also return the owner i of each item."""
    owner = np.repeat(np.arange(counts.size), counts)
    offsets = np.cumsum(counts)
    offsets -= counts
    items = np.repeat(starts - offsets, counts)
    items += np.arange(owner.size)
    return items, owner


def trusted(cls, **values):
    """An instance of the frozen dataclass `cls` from values the planner built itself (valid by
    construction), without the generated `__init__` and its checks: for StepPlan's 19 fields and
    Bucket's checks that is ~10 us of a 60 us decode step. Fields left out take their defaults."""
    obj = object.__new__(cls)
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        defaults = _DEFAULTS[cls] = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
    obj.__dict__.update(defaults)
    obj.__dict__.update(values)
    return obj


_DEFAULTS: dict = {}
_EMPTY: dict = {}


def empty(shape: tuple) -> np.ndarray:
    """An int64 array of a zero-size `shape`, made once (it holds nothing, so plans may share it)."""
    a = _EMPTY.get(shape)
    if a is None:
        a = _EMPTY[shape] = np.zeros(shape, np.int64)
    return a


_TRIANGLES: dict = {}
_COUNTING: list = [np.arange(0, dtype=np.int32)]


def prefix_mask(lengths: np.ndarray, width: int) -> np.ndarray:
    """`[n, width]` bools, row i True on its first `lengths[i]` (<= width) entries: rows of a cached
    triangle, one gather (the broadcast `arange(width) < lengths[:, None]` is ~20x slower on a
    decode step's 256 x 64 table: numpy runs one short inner loop per row)."""
    if width > 1024:  # (a triangle of width**2 bytes: kept only for tables of usual widths)
        return np.arange(width) < lengths[:, None]
    tri = _TRIANGLES.get(width)
    if tri is None:
        if len(_TRIANGLES) >= 16:
            _TRIANGLES.clear()
        tri = _TRIANGLES[width] = np.tri(width + 1, width, -1, dtype=bool)
    return tri.take(lengths, axis=0)


def counting(n: int) -> np.ndarray:
    """`np.arange(n, dtype=int32)`, read only, from one cached array (n < 2**31)."""
    a = _COUNTING[0]
    if a.size < n:
        a = np.arange(max(n, 2 * a.size), dtype=np.int32)
        a.flags.writeable = False
        _COUNTING[0] = a
    return a[:n]


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit hash per request index (groups blocks by user set)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def chunk_groups(group_sizes: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut groups of `group_sizes` items into chunks of `tile`.

    Returns, per chunk, its group, its first item (global index into the
    group-sorted item list) and its item count."""
    chunks = -(-group_sizes // tile)
    local, group = ranges(np.zeros_like(chunks), chunks)
    group_offsets = np.cumsum(group_sizes) - group_sizes
    first = group_offsets[group] + local * tile
    return group, first, np.minimum(tile, group_sizes[group] - local * tile)


def chunk_index(first: np.ndarray, count: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, width] item indices of chunks (clipped) and which of them are real."""
    idx = first[:, None] + np.arange(width)
    valid = np.arange(width) < count[:, None]
    return np.where(valid, idx, 0), valid


def first_bad_block(phys, pair_req, pair_blk, num_blocks):
    bad = phys < 0 if num_blocks is None else (phys < 0) | (phys >= num_blocks)
    if bad.any():
        i = int(np.argmax(bad))
        limit = "" if num_blocks is None else f" and < num_blocks {num_blocks}"
        raise ValueError(f"block_table[{int(pair_req[i])}, {int(pair_blk[i])}] = {int(phys[i])} is needed "
                         f"for the context but must be >= 0{limit}")


#: Largest bucket a step is padded to, per size: padding allocates these, so a bucket of 2**40 tokens
#: is an error here, not a MemoryError.
BUCKET_LIMITS = {"query_len": MAX_STEP_TOKENS, "num_logits": MAX_STEP_TOKENS, "num_causal_tiles": MAX_CAUSAL_TILES,
                 "num_shared_blocks": 1 << 22, "num_unique_blocks": 1 << 22, "num_prompts": MAX_STEP_TOKENS,
                 "prompt_len": MAX_STEP_TOKENS, "prompt_blocks": 1 << 22}


def check_covers(bucket: Bucket, shape: Bucket) -> None:
    """`bucket` holds the step (every size at least the step's) and is small enough to pad to."""
    for f in fields(Bucket)[1:]:
        need, have = getattr(shape, f.name), getattr(bucket, f.name)
        if have < need:
            raise ValueError(f"bucket {bucket} does not cover the step: {f.name} {need} > {have}")
        if have > BUCKET_LIMITS[f.name]:
            raise ValueError(f"bucket {bucket}: {f.name} {have} is beyond the largest accepted, "
                             f"{BUCKET_LIMITS[f.name]}")


def step_tokens(q: np.ndarray, ctx: np.ndarray):
    """Each request's first token on the step's flattened token axis, and per new token: its index
    in its request, its request, its position in the sequence."""
    R, T = q.size, int(q.sum())
    starts = np.cumsum(q) - q
    if T == R:  # every request has one new token (decodes): no ranges to build
        tok_j, tok_req = np.zeros(R, np.int64), np.arange(R)
    else:
        tok_j, tok_req = ranges(np.zeros_like(q), q)
    return starts, tok_j, tok_req, ctx[tok_req] + tok_j


def cached_pairs(ctx: np.ndarray, nb_ctx: np.ndarray, bt: np.ndarray, block_size: int, sliding_window: int | None,
                 num_blocks: int | None):
    """The (request, cached block) pairs some token of the request may see, request by request: each
    pair's request, logical block and physical block, the pairs per request, and the largest block
    id (-1: none). A block id the context needs that is negative or past `num_blocks` raises."""
    W = sliding_window
    first_blk = np.zeros_like(ctx) if W is None else np.maximum(ctx - W + 1, 0) // block_size
    counts = np.maximum(nb_ctx - first_blk, 0)
    width = bt.shape[1]
    flat, pair_req = ranges(np.arange(ctx.size) * width + first_blk, counts)
    pair_blk = flat - pair_req * width
    phys = bt.ravel().take(flat)
    max_block_id = int(phys.max()) if phys.size else -1
    if phys.size and (phys.min() < 0 or (num_blocks is not None and max_block_id >= num_blocks)):
        first_bad_block(phys, pair_req, pair_blk, num_blocks)
    return pair_req, pair_blk, phys, counts, max_block_id


def move_no_row(rows: np.ndarray, old: int, new: int) -> np.ndarray:
    """Row indices with the "no row" marker moved from the old token count to the padded one."""
    return np.where(rows == old, new, rows).astype(rows.dtype, copy=False)


def grow(a: np.ndarray, n: int, fill) -> np.ndarray:
    """`a` padded along its first axis to `n` entries of `fill` (`a` itself when it has `n`)."""
    if n == a.shape[0]:
        return a
    extra = np.full((n - a.shape[0],) + a.shape[1:], fill, a.dtype)
    return np.concatenate([a, extra])
