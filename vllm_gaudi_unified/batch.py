"""The unified batch: one step's plan as device tensors, passed explicitly from plan to run."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.plan import InvariantPlan, PathWork, PlanOptions, StepPlan, pad_plan, plan_step
from vllm_gaudi_unified.plan.split import split_plan

logger = get_logger(__name__)


@dataclass(frozen=True, eq=False)
class UnifiedBatch:
    """A planned step on one device. Index tensors are int64; a row index equal to
    `bucket.query_len` means "no row" (padding). Sizes come from `bucket`."""

    plan: StepPlan  #: the host-side plan (numpy arrays, sizes, work accounting)
    #: further calls of a step split under a plan's gather cap (`plan/split.py`): their shared and unique
    #: pairs merge into this batch's result; empty for every step within the cap
    pieces: tuple = field(default=(), kw_only=True)
    token_seg_start: torch.Tensor  #: [query_len] first flattened token of each token's request
    causal_q_start: torch.Tensor  #: [num_causal_tiles] first query row of each causal tile
    causal_k_start: torch.Tensor  #: [num_causal_tiles] first key of each causal tile
    shared_rows: torch.Tensor  #: [shared tiles, shared_rows] query token per tile row
    shared_blocks: torch.Tensor  #: [shared tiles, blocks_per_tile] cache block per tile column
    shared_lo: torch.Tensor  #: [shared tiles, shared_rows, blocks_per_tile] first visible slot
    shared_hi: torch.Tensor  #: [shared tiles, shared_rows, blocks_per_tile] end of visible slots
    unique_rows: torch.Tensor  #: [num_unique_blocks] the token of each unique block slot
    unique_blocks: torch.Tensor | None  #: [num_unique_blocks] block ids, or None: slice [0, num_unique_blocks)
    unique_lo: torch.Tensor  #: [num_unique_blocks]
    unique_hi: torch.Tensor  #: [num_unique_blocks]
    logits_indices: torch.Tensor  #: [num_logits] last new token of each request (padding: 0)

    @classmethod
    def from_plan(cls, plan: StepPlan, device: torch.device | str | None = None) -> "UnifiedBatch":
        """The plan's arrays as int64 tensors; an `InvariantPlan` gives an `InvariantBatch`."""
        if cls is UnifiedBatch and isinstance(plan, InvariantPlan):
            cls = InvariantBatch

        def tensor(a: np.ndarray | None):
            if a is None:
                return None
            t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
            return t if device is None else t.to(device, non_blocking=True)

        values = {f.name: tensor(getattr(plan, f.name)) for f in fields(cls) if f.name not in ("plan", "pieces")}
        return cls(plan=plan, **values)

    def to(self, device: torch.device | str) -> "UnifiedBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("plan", "pieces")}
        moved = {k: None if v is None else v.to(device, non_blocking=True) for k, v in moved.items()}
        return replace(self, pieces=tuple(p.to(device) for p in self.pieces), **moved)

    @property
    def device(self) -> torch.device:
        return self.token_seg_start.device

    # Host-side facts, no device sync.
    bucket = property(lambda self: self.plan.bucket, doc="padded shape (one graph per bucket)")
    shape = property(lambda self: self.plan.shape, doc="the step's own, unpadded shape")
    phase = property(lambda self: self.plan.bucket.phase)
    num_tokens = property(lambda self: self.plan.num_tokens)
    num_requests = property(lambda self: self.plan.num_requests)
    block_size = property(lambda self: self.plan.block_size)
    sliding_window = property(lambda self: self.plan.sliding_window)
    causal_tile = property(lambda self: self.plan.options.causal_tile)
    unique_layout = property(lambda self: self.plan.unique_layout, doc="'slice' or 'gather'")
    max_block_id = property(lambda self: self.plan.max_block_id)
    work_needed = property(lambda self: self.plan.work_needed)
    work_planned = property(lambda self: self.plan.work_planned)


@dataclass(frozen=True, eq=False)
class InvariantBatch(UnifiedBatch):
    """A batch-invariant step (`plan.invariant.InvariantPlan`) on one device: its units and causal columns."""

    unit_rows: torch.Tensor  #: [units, invariant_rows] query token per unit row
    unit_block: torch.Tensor  #: [units] cache block of each unit
    unit_col: torch.Tensor  #: [units, invariant_rows] logical block index in the row's request
    unit_lo: torch.Tensor  #: [units, invariant_rows] first visible slot
    unit_hi: torch.Tensor  #: [units, invariant_rows] end of visible slots
    causal_col: torch.Tensor  #: [num_causal_tiles] key tile index within its request


def build_unified_batch(query_lens, context_lens, block_table, block_size: int, *,
                        sliding_window: int | None = None, num_blocks: int | None = None,
                        options: PlanOptions | None = None, bucket=None,
                        device: torch.device | str | None = None) -> UnifiedBatch:
    """Plan one scheduler step and put it on `device`.

    query_lens [R] (>= 1), context_lens [R] (>= 0), block_table [R, M]: the
    scheduler's view of the step (see `plan/default.py` for the semantics).
    `bucket`: a `Bucket` to pad to, or a bucket plan (anything with
    `.find(shape) -> Bucket | None`; None runs the step unpadded, and the plan's
    miss policy decides whether a miss raises).
    `num_blocks`: the KV cache size; when given, block ids are checked here.
    """
    if not (bucket is None or isinstance(bucket, Bucket)
            or (callable(getattr(bucket, "find", None)) and not isinstance(bucket, (str, bytes)))):
        raise ValueError(f"bucket must be a Bucket, a bucket plan (with .find) or None, got {bucket!r}")
    plan = plan_step(query_lens, context_lens, block_table, block_size, sliding_window=sliding_window,
                     num_blocks=num_blocks, options=options)
    cap = getattr(bucket, "gather_cap", None)
    pieces = split_plan(plan, cap) if cap is not None and cap.exceeded(plan.shape) else [plan]
    if bucket is not None:
        pieces = [_pad_to(p, bucket) for p in pieces]
    plan = pieces[0]
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("step %s bucket %s unique=%s work needed=%s planned=%s", plan.shape, plan.bucket,
                     plan.unique_layout, plan.work_needed, plan.work_planned)
    rest = tuple(UnifiedBatch.from_plan(p, device) for p in pieces[1:])
    return replace(UnifiedBatch.from_plan(plan, device), pieces=rest) if rest else UnifiedBatch.from_plan(plan, device)


def _pad_to(plan: StepPlan, bucket) -> StepPlan:
    target = bucket if isinstance(bucket, Bucket) else bucket.find(plan.shape)
    return plan if target is None else pad_plan(plan, target)


__all__ = ["InvariantBatch", "UnifiedBatch", "build_unified_batch", "PathWork"]
