"""The server settings a bucket plan is made for, and the largest shape they allow.

A plan is only valid with the settings and planner options it was made for:
the block size and the tile sizes decide every size of a step's shape.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from vllm_gaudi_unified.plan import DEFAULT_OPTIONS, PlanOptions
from vllm_gaudi_unified.plan.arrays import check_scalars, is_int

#: The planner's `DEFAULT_OPTIONS` with the unique path's layout fixed to 'gather', which bucket plans
#: use unless told otherwise: with 'auto' the same bucket would need two graphs (slice and gather).
#: And on the tiled route: a plan's buckets count the five sizes of the tiled paths, so they cover every
#: step; the prompt route runs in the plan's prompt graphs (`prompt_graphs.py`, `BucketPlan.step_options`).
#: And with the shared tiles' rows fixed (`PlanOptions.tile_rows` would give a bucket one graph per row count):
#: `ServerSettings` fixes them at `shared_rows` whatever options it is given.
BUCKET_OPTIONS = replace(DEFAULT_OPTIONS, unique_layout="gather", prompt_route="tiles").with_tile_rows(
    DEFAULT_OPTIONS.shared_rows)


def options_to_dict(options: PlanOptions) -> dict:
    return asdict(options)


def options_from_dict(d: dict | None) -> PlanOptions:
    if not d:
        return BUCKET_OPTIONS
    known = {f.name for f in fields(PlanOptions)}
    # a plan saved before the prompt route existed was counted for the tiled route, before `shared_rows_max`
    # with fixed tile rows
    d = {"prompt_route": "tiles", "shared_rows_max": d.get("shared_rows", DEFAULT_OPTIONS.shared_rows), **d}
    return PlanOptions(**{k: v for k, v in d.items() if k in known})


def check_settings(block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                   num_blocks: int) -> None:
    """Clear errors for settings no server could run with: block_size and num_blocks by `plan_step`'s own
    rules (`check_scalars`), the scheduler's limits positive integers."""
    check_scalars(block_size, None, num_blocks, num_blocks_given=True)
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) is below max_num_seqs "
                         f"({max_num_seqs}): a step could not give every running request a token")
    if num_blocks < 2:
        raise ValueError(f"num_blocks ({num_blocks}) must leave at least one block besides the null block")


@dataclass(frozen=True)
class ServerSettings:
    """The vLLM settings that bound a step's shape."""

    block_size: int = 128
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    num_blocks: int = 6000  #: KV cache blocks (vLLM's num_gpu_blocks, null block included)
    sliding_window: int | None = None
    options: PlanOptions = field(default=BUCKET_OPTIONS)
    #: Speculative decoding: draft tokens per decode (vLLM's num_speculative_tokens; 0 = none). A decode
    #: then brings up to 1 + k tokens, causal among themselves (see `exponential.py`).
    num_speculative_tokens: int = 0

    def __post_init__(self):
        check_settings(self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                       self.num_blocks)
        # block size, sliding window, num_blocks: plan_step's own rules (a plan file cannot hold what it refuses)
        check_scalars(self.block_size, self.sliding_window, self.num_blocks, num_blocks_given=True)
        # a bucket's graph holds one tile row count: the options' fewest (`BUCKET_OPTIONS`)
        if isinstance(self.options, PlanOptions):
            object.__setattr__(self, "options", self.options.with_tile_rows(self.options.shared_rows))
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {k!r}")
        # a verify step's 1 + k tokens per request read their blocks once (`PlanOptions.unique_tokens`)
        if k and isinstance(self.options, PlanOptions) and self.options.unique_tokens == 1:
            object.__setattr__(self, "options", replace(self.options, unique_tokens=1 + int(k)))

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def blocks_per_tile(self) -> int:
        return self.options.blocks_per_tile(self.block_size)

    def max_shared_blocks(self, query_len: int, num_requests: int) -> int:
        """Shared block slots of a step with these many tokens and requests: row tiles x column chunks.

        A group's row tiles are at most its requests' `ceil(query_len / shared_rows)` summed, so
        all groups hold at most `query_len // shared_rows + num_requests` row tiles (and never more
        than `query_len`). A row tile meets the column chunks of the blocks its request sees,
        `min(ceil(max_model_len / block_size), num_blocks)` in whole tiles, plus one partial chunk more
        when those blocks fall into two user sets (a prefix common with other requests and the
        request's own context read by its chunk). Deeper prefix trees (three or more user sets
        per request) can exceed this; the plan's miss policy then decides."""
        kb = self.blocks_per_tile
        row_tiles = min(query_len, query_len // self.options.shared_rows + num_requests)
        seq_blocks = min(self.blocks_per_seq, self.num_blocks)
        return int(row_tiles * (-(-seq_blocks // kb) + 1) * kb)

    def limits(self) -> np.ndarray:
        """int64[5] (DIMS order): the largest value of each size these settings allow.

        - query_len: the token budget `max_num_batched_tokens`;
        - num_shared_blocks: `max_shared_blocks` of a full token budget and `max_num_seqs`;
        - num_unique_blocks: `num_blocks` (the live blocks of a gather, or the largest
          slice);
        - num_logits: `max_num_seqs`;
        - num_causal_tiles: the lower triangle of tiles over a full token budget.

        In batch-invariant mode the shapes count other things (`plan/invariant.py`): `invariant_limits`.
        """
        if self.options.batch_invariant:
            return self.invariant_limits()
        shared = self.max_shared_blocks(self.max_num_batched_tokens, self.max_num_seqs)
        n = -(-self.max_num_batched_tokens // self.options.causal_tile)
        return np.array([self.max_num_batched_tokens, shared, self.num_blocks, self.max_num_seqs, n * (n + 1) // 2],
                        dtype=np.int64)

    def invariant_limits(self) -> np.ndarray:
        """int64[5] (DIMS order): the largest shape a batch-invariant step can have at these settings.

        - num_shared_blocks counts context tiles: a request's rows in tiles of `invariant_rows` (a decode's
          or a verify step's: one tile) times the chunks of `blocks_per_tile` blocks its context spans, so
          at most `(budget // invariant_rows + max_num_seqs)` row tiles of a full context's chunks; each
          kind of tile (decode, verify, prompt, own-call) is padded to whole products of `invariant_chunk`;
        - num_unique_blocks: 0 (no unique path);
        - num_causal_tiles: each request's own triangle of tiles, the most with one long prompt and the
          rest of the budget in two-token requests of one tile each; the requests on their own calls
          and the others padded apart to whole products of `invariant_causal_chunk`.
        """
        o, budget, seqs = self.options, self.max_num_batched_tokens, self.max_num_seqs
        kb, ic, cc, c = self.blocks_per_tile, o.invariant_chunk, o.invariant_causal_chunk, o.causal_tile
        chunks = -(-min(self.blocks_per_seq, self.num_blocks) // kb)
        kinds = 4 if o.unique_tokens > 1 else 3  # verify tiles only with speculative tokens
        tiles = min(budget, budget // o.invariant_rows + seqs) * chunks
        shared = -(-tiles // ic) * ic + (kinds - 1) * ic
        x = np.arange(1, -(-budget // c) + 1)  # the long prompt's tiles per side, from its fewest tokens
        fewest = np.maximum((x - 1) * c + 1, 2)
        rest = np.minimum(seqs - 1, (budget - fewest) // 2)
        most = int((x * (x + 1) // 2 + rest)[fewest <= budget].max(initial=0))
        causal = -(-most // cc) * cc + (cc if most > 1 else 0)
        return np.array([budget, shared, 0, seqs, causal], dtype=np.int64)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                             "num_blocks", "sliding_window")}
        d["options"] = options_to_dict(self.options)
        if self.num_speculative_tokens:  # written only when set: plan files without it read as 0
            d["num_speculative_tokens"] = self.num_speculative_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ServerSettings":
        d = dict(d)
        d["options"] = options_from_dict(d.get("options"))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


#: Named settings the shipped plans are made for.
PRESETS: dict[str, ServerSettings] = {
    # An 8B model (Llama-3.1-8B, bf16) on one Gaudi 3: the setting of the chat seed-4 trace.
    "llama8b-gaudi3": ServerSettings(block_size=128, max_num_seqs=256, max_num_batched_tokens=8192,
                                     max_model_len=8192, num_blocks=6000),
    # The setting of the seed-1 trace: small blocks, 64 sequences, 2048-token budget.
    "bs32-seqs64": ServerSettings(block_size=32, max_num_seqs=64, max_num_batched_tokens=2048,
                                  max_model_len=8192, num_blocks=8192),
}
