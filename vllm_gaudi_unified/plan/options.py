"""The planner's options (one graph per bucket *and* options) and its work accounting."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from vllm_gaudi_unified.plan.arrays import is_int

#: Largest accepted tile sizes: far above any useful value, low enough that a tile's device mask
#: (`causal_tile`**2, `invariant_rows` x block) and the planner's arrays stay allocatable.
TILE_LIMITS = {"causal_tile": 4096, "shared_rows": 1 << 20, "shared_rows_max": 1 << 20, "shared_tile_keys": 1 << 24,
               "invariant_rows": 4096, "invariant_chunk": 1 << 20, "invariant_causal_chunk": 1 << 20,
               "unique_tokens": 64}


#: A shared tile's gather of its blocks, in rows of scores over them (`PlanOptions.tile_rows`): reading a
#: block's keys and values costs about what 4 query rows' products against it do (the 8-row tiles of a
#: 64-request prefix took 0.139 ms against 0.115 in 16-row tiles, Gaudi route, H100: 8 chunks of 8 + g rows
#: against 4 of 16 + g, so g = 4.2).
GATHER_ROWS = 4


#: Routes of a request with two or more new tokens: one padded fused call over its context and new keys
#: ('dense', `plan/prompts.py`), or the causal + shared + unique tiles ('tiles').
PROMPT_ROUTES = ("dense", "tiles")

#: Layouts of the unique path: read `[0, max id + 1)` of the cache in place, or gather live blocks.
UNIQUE_LAYOUTS = ("auto", "slice", "gather")


@dataclass(frozen=True)
class PlanOptions:
    """Tile sizes and choices of the planner; one graph per bucket *and* options."""

    causal_tile: int = 64  #: query rows = key columns of a causal tile
    #: query rows of a shared tile, the fewest: a step's tiles take the rows that cost least over its groups (a
    #: prefix common to 64 decodes: one 64-row tile per key chunk, its blocks gathered once), a power of two
    #: within [shared_rows, shared_rows_max] (`tile_rows`); the plan records the rows it chose (`with_tile_rows`).
    #: 16, the rows bucket plans fix: decode groups sharing a prefix are often 2-16 requests (parallel
    #: sampling n <= 16, a system prompt's users), and such a group in one row tile reads its prefix once
    #: (0.139 ms in 8-row tiles against 0.115 in 16, Gaudi route, H100, `python -m benchmarks.speed`).
    #: The array `StepPlan.shared_rows` holds the query token of each such row.
    shared_rows: int = 16
    #: the most rows of a shared tile; at or below `shared_rows`: every step's tiles have `shared_rows` rows
    shared_rows_max: int = 256
    shared_tile_keys: int = 512  #: keys of a shared tile, rounded down to whole blocks (at least one)
    unique_layout: str = "auto"  #: 'slice', 'gather', or 'auto' (slice when dense enough)
    slice_min_density: float = 0.5  #: 'auto' reads the slice when live blocks / (max id + 1) >= this
    #: new tokens a request may have and still take the unique path (a speculative verify step: 1 + k drafts;
    #: MTP; a small chunk): its context blocks, when no other request reads them, are read once for all its
    #: tokens, in (request, block) units of `unique_tokens` x heads-per-KV-head rows (a request's rows padded
    #: to it, never to the step's longest request). A graph's static shape: a server sets it from its
    #: speculative config (`ServerSettings.options`); 1 = one token per unit, the plain decode.
    unique_tokens: int = 1
    #: 'dense': prompts and chunks over their own context as one padded fused call (`plan/prompts.py`);
    #: 'tiles': every pair through the causal / shared / unique tiles
    prompt_route: str = "dense"
    fused_kernels: bool = True  #: run paths through the device's fused attention kernel where one applies (paths/fused.py)
    batch_invariant: bool = False  #: same bits for a request whatever its batch (docs/batch_invariance.md)
    invariant_rows: int = 8  #: batch_invariant, torch route: rows of a prompt's context tile (a decode's has one)
    invariant_chunk: int = 64  #: batch_invariant, torch route: context tiles per product (one shape per call)
    invariant_causal_chunk: int = 64  #: batch_invariant, torch route: causal tiles per product

    def __post_init__(self):
        for name, limit in TILE_LIMITS.items():
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value <= limit:
                raise ValueError(f"PlanOptions.{name} must be an int in [1, {limit}], got {value!r}")
        if not (isinstance(self.unique_layout, str) and self.unique_layout in UNIQUE_LAYOUTS):
            raise ValueError(f"PlanOptions.unique_layout must be one of {UNIQUE_LAYOUTS}, got {self.unique_layout!r}")
        if not (isinstance(self.prompt_route, str) and self.prompt_route in PROMPT_ROUTES):
            raise ValueError(f"PlanOptions.prompt_route must be one of {PROMPT_ROUTES}, got {self.prompt_route!r}")
        d = self.slice_min_density
        if not (isinstance(d, (int, float, np.integer, np.floating)) and not isinstance(d, (bool, np.bool_))
                and 0.0 <= d <= 1.0):
            raise ValueError(f"PlanOptions.slice_min_density must be a float in [0, 1], got {d!r}")
        if not isinstance(self.batch_invariant, (bool, np.bool_)):
            raise ValueError(f"PlanOptions.batch_invariant must be a bool, got {self.batch_invariant!r}")

    def tile_rows(self, group_rows, group_cols=None) -> int:
        """Rows of a step's shared tiles, from its groups of shared blocks: `group_rows` query tokens
        read each group's `group_cols` blocks (one group: an int). The same rule on every device.

        A group is cut into row chunks of the tile's rows, and each chunk gathers the group's blocks
        once: rows past a group's tokens are computed for nothing, while more chunks gather the blocks
        again. The rows are the power of two in [shared_rows, shared_rows_max] that costs least, a
        chunk's gather counted as `GATHER_ROWS` rows of scores: a prefix common to 64 decodes is one
        64-row chunk, and a step whose groups are 4, 5, 8, 13, 22 and 49 requests takes 16-row tiles
        (1.58x its rows, where 64-row tiles for all computed 3.8x)."""
        if self.shared_rows_max <= self.shared_rows:
            return self.shared_rows
        one = group_cols is None and isinstance(group_rows, (int, np.integer))  # (a step's one group: ints)
        rows = int(group_rows) if one else np.asarray(group_rows, np.int64).reshape(-1)
        most = rows if one else int(rows.max()) if rows.size else 0
        if most <= self.shared_rows:
            return self.shared_rows
        top = min(self.shared_rows_max, 1 << (most - 1).bit_length())
        steps = (-(-top // self.shared_rows) - 1).bit_length() + 1  # doublings from shared_rows up to top
        cand = [min(self.shared_rows << i, top) for i in range(steps)]
        if one:
            cost = [-(-rows // c) * (c + GATHER_ROWS) for c in cand]
        else:
            c = np.array(cand, np.int64)
            chunks = -(-rows // c[:, None])  # row chunks of each group, per candidate
            gathers = chunks.sum(1) if group_cols is None else chunks @ np.asarray(group_cols, np.int64).reshape(-1)
            cost = (gathers * (c + GATHER_ROWS)).tolist()
        return cand[cost.index(min(cost))]

    def with_tile_rows(self, rows: int) -> "PlanOptions":
        """These options with the shared tiles fixed at `rows` rows: what a plan records, so its bucket
        and graph key say which tile it was made with (one graph per bucket and options)."""
        if self.shared_rows == rows and self.shared_rows_max <= rows:
            return self
        return _replaced(self, shared_rows=int(rows), shared_rows_max=int(rows))

    def unique_units(self, bucket, sliding_window: int | None) -> int:
        """Token rows of one unique (request, block) unit in `bucket`'s graph: `unique_tokens` where a request
        off the prompt route can have several new tokens (the bucket has causal tiles) and no sliding window
        cuts the context per token; else 1 (a decode bucket keeps its one-row units)."""
        many = self.unique_tokens > 1 and bucket.num_causal_tiles > 0 and sliding_window is None
        return self.unique_tokens if many else 1

    def blocks_per_tile(self, block_size: int) -> int:
        """Cache blocks in one shared tile."""
        return max(1, self.shared_tile_keys // block_size)


def on_route(options: PlanOptions, route: str) -> PlanOptions:
    """`options` with `prompt_route` set to `route` ('dense' or 'tiles')."""
    return options if options.prompt_route == route else _replaced(options, prompt_route=route)


@lru_cache(maxsize=128)
def _replaced(options: PlanOptions, **changes) -> PlanOptions:
    """`replace(options, **changes)`, made once per (options, changes): every plan records its options with the
    tile rows fixed and a step with prompts asks for its tiled ones, where a dataclass `replace` (its checks
    run again) would be a tenth of a decode step's planning."""
    return replace(options, **changes)


#: The one default: what `plan_step` / `build_unified_batch` use when given no options. Bucket plans
#: derive theirs from it (`bucket_plans.settings.BUCKET_OPTIONS`: the unique layout fixed).
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
