"""`StepPlan`: what the host hands the device for one step, as numpy arrays."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.plan.options import PathWork, PlanOptions
from vllm_gaudi_unified.plan.prompts import grid_pairs


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything the device needs for one step, as numpy arrays (row index `query_len` = no row).

    Shapes use the padded sizes of `bucket`; before padding, `bucket == shape`.
    The batch-invariant planner returns its own subclass, `InvariantPlan`.
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
    shared_rows: np.ndarray  #: [tiles, options.shared_rows] query token of each tile row
    shared_blocks: np.ndarray  #: [tiles, blocks_per_tile] physical block of each tile column
    shared_lo: np.ndarray  #: [tiles, options.shared_rows, blocks_per_tile] first visible slot
    shared_hi: np.ndarray  #: [tiles, options.shared_rows, blocks_per_tile] end of visible slots (0 = block unseen)
    #: [num_unique_blocks] the query token of each block slot (with `unique_units` > 1: the first of its request's)
    unique_rows: np.ndarray
    unique_blocks: np.ndarray | None  #: [num_unique_blocks] gathered block ids; None = slice [0, num_unique_blocks)
    unique_lo: np.ndarray  #: [num_unique_blocks]
    unique_hi: np.ndarray  #: [num_unique_blocks]
    logits_indices: np.ndarray  #: [num_logits] last new token of each request
    max_block_id: int  #: largest cache block id read (-1: none); checked against the cache
    work_needed: PathWork  #: pairs the step needs
    #: every shared tile's real rows see one and the same prefix of its slots (no window, whole blocks
    #: but the last): the shared path may run as one fused-kernel segment per tile (paths/shared.py)
    shared_prefix_visible: bool
    #: an encoder-only step (`plan/bidirectional.py`): every new token sees every new token of its request
    bidirectional: bool = field(default=False, kw_only=True)
    #: the prompt route (`plan/prompts.py`), `bucket.prompts` sized; None in an `InvariantPlan`
    prompt_rows: np.ndarray | None = field(default=None, kw_only=True)  #: [num_prompts, prompt_len] token of each row (query_len = no row)
    prompt_blocks: np.ndarray | None = field(default=None, kw_only=True)  #: [num_prompts, prompt_blocks] context blocks in order (0 past them)
    prompt_ctx: np.ndarray | None = field(default=None, kw_only=True)  #: [num_prompts] context length (keys before the new ones)
    prompt_len: np.ndarray | None = field(default=None, kw_only=True)  #: [num_prompts] new tokens (0: a padding prompt)
    #: every new token is on the prompt route: the step is that one fused call and nothing else
    prompts_only: bool = field(default=False, kw_only=True)
    #: the prompts' rows are the step's first rows as a `[num_prompts, prompt_len]` grid (`plan/prompts.py:
    #: prompt_grid`): the device reads the queries and writes the output as views, with no gather
    prompt_grid: bool = field(default=False, kw_only=True)
    #: the prompts fill less than `plan/prompts.py: RAGGED_FILL` of their padded grid (ragged lengths or
    #: contexts): where flash varlen exists (CUDA) the final form computes the real rows alone
    prompt_ragged: bool = field(default=False, kw_only=True)
    #: every request off the prompt route has at most `options.unique_tokens` new tokens (> 1; a verify step):
    #: a token's causal pairs are the few new keys of its request up to itself, which a route that reads a
    #: request's unit once may take instead of the causal tiles (MLA's latent routes: `paths/mla_drafts.py`)
    drafts_in_units: bool = field(default=False, kw_only=True)

    @property
    def unique_layout(self) -> str:
        """'slice' (contiguous cache slice, no gather) or 'gather' (live blocks only)."""
        return "slice" if self.unique_blocks is None else "gather"

    @property
    def work_planned(self) -> PathWork:
        """Pairs the device computes for the arrays as they are (padding included)."""
        b, opts, bs = self.bucket, self.options, self.block_size
        prompt_ctx = b.num_prompts * b.prompt_len * b.prompt_blocks * bs
        prompt_new = int(grid_pairs(b.num_prompts, b.prompt_len, b.prompt_blocks, bs)) - prompt_ctx
        return PathWork(
            causal=b.num_causal_tiles * opts.causal_tile**2 + b.query_len + prompt_new,
            shared=b.num_shared_blocks * opts.shared_rows * bs + prompt_ctx,
            unique=b.num_unique_blocks * bs * self.unique_units,
        )

    @property
    def prompt_full(self) -> bool:
        """The prompts' grid is every row of an unpadded step (`prompt_grid`, each prompt `prompt_len` tokens):
        no padding row to zero, so the device may return the fused call's rows as they are."""
        rows = self.prompt_rows
        return self.prompt_grid and self.bucket == self.shape and rows is not None and rows.size == self.num_tokens

    @property
    def unique_units(self) -> int:
        """Token rows of each unique slot in this plan's graph (`PlanOptions.unique_units`): the slot's row is
        its request's first token, and the next `unique_units - 1` tokens of the same request share it."""
        return self.options.unique_units(self.bucket, self.sliding_window)
