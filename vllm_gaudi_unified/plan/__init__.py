"""Host planning of one step: numpy only, no torch, no vLLM.

- `options`: `PlanOptions`, the one `DEFAULT_OPTIONS`, `PathWork`;
- `step_plan`: `StepPlan`, the arrays the device needs;
- `arrays`: input checks and vectorised range/tiling/padding helpers both planners use;
- `default`: the default planner (causal / shared / unique tiles);
- `invariant`: the batch-invariant planner and its `InvariantPlan`;
- `rules`: the default planner's rules (also replayed by the bucketing tools), `shared`: its shared tiles;
- `buffers`: where a plan's arrays live (new per call, or `PlanBuffers` kept from step to step);
- `bidirectional`: the planner of encoder-only steps (no cache, whole-request causal tiles);
- `smallest`: the smallest step of each phase (warmup's step per bucket; the buckets a plan keeps).

`plan_step` (and `plan_checked`, for arrays already checked) and `pad_plan` below pick the planner from
`options.batch_invariant`.
"""
from __future__ import annotations

from dataclasses import replace

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.plan.arrays import check_scalars, checked_rows, validate
from vllm_gaudi_unified.plan.bidirectional import plan_bidirectional
from vllm_gaudi_unified.plan.buffers import PlanBuffers
from vllm_gaudi_unified.plan.default import pad_default, plan_default
from vllm_gaudi_unified.plan.invariant import InvariantPlan, pad_invariant, plan_invariant
from vllm_gaudi_unified.plan.prompts import bucket_grid
from vllm_gaudi_unified.plan.options import DEFAULT_OPTIONS, UNIQUE_LAYOUTS, PathWork, PlanOptions
from vllm_gaudi_unified.plan.step_plan import StepPlan


def plan_step(query_lens, context_lens, block_table, block_size: int, *, sliding_window: int | None = None,
              num_blocks: int | None = None, options: PlanOptions | None = None,
              buffers: PlanBuffers | None = None, causal: bool = True) -> StepPlan:
    """Plan one scheduler step; arrays are unpadded (`bucket == shape`). See `plan/default.py` for the
    semantics; `options.batch_invariant` selects `plan/invariant.py` (returns an `InvariantPlan`).

    `buffers`: host memory kept from step to step (`plan/buffers.py`; default mode, else ignored): the
    plan's arrays are views of it, valid until the next plan or padding into the same buffers.

    `causal=False`: an encoder-only step (`plan/bidirectional.py`): every token sees its whole request,
    no cache (context_lens all 0), no window."""
    opts = _options(options)
    checked = validate(query_lens, context_lens, block_table, block_size, sliding_window, num_blocks)
    return _planned(checked, int(block_size), sliding_window, num_blocks, opts, buffers, causal)


def plan_checked(checked: tuple, block_size: int, *, rows=None, sliding_window: int | None = None,
                 num_blocks: int | None = None, options: PlanOptions | None = None,
                 buffers: PlanBuffers | None = None, causal: bool = True) -> StepPlan:
    """`plan_step` of a step whose arrays `arrays.validate` already checked (`checked`, its result at the same
    `block_size`): the planner `plan_step` picks, with no second check of the arrays. `rows`: only those
    requests (a bool mask or indices), planned as `plan_step` plans their own arrays (`arrays.checked_rows`)."""
    opts = _options(options)
    check_scalars(block_size, sliding_window, num_blocks)
    if rows is not None:
        checked = checked_rows(checked, rows, block_size)
    return _planned(checked, int(block_size), sliding_window, num_blocks, opts, buffers, causal)


def _options(options) -> PlanOptions:
    if options is not None and not isinstance(options, PlanOptions):
        raise ValueError(f"options must be a PlanOptions or None, got {options!r}")
    return options or DEFAULT_OPTIONS


def _planned(checked, block_size: int, sliding_window, num_blocks, opts: PlanOptions, buffers, causal) -> StepPlan:
    """The one choice of planner (`plan_step`, `plan_checked`)."""
    if not causal:
        return plan_bidirectional(checked[0], checked[1], block_size, sliding_window, opts)
    if opts.batch_invariant:
        return plan_invariant(*checked, block_size, sliding_window, num_blocks, opts)
    return plan_default(*checked, block_size, sliding_window, num_blocks, opts, buffers)


def pad_plan(plan: StepPlan, bucket: Bucket, buffers: PlanBuffers | None = None) -> StepPlan:
    """The same step padded to `bucket`; padding adds only fully masked work. `buffers`: pad into
    them (default mode; a plan made into them is padded in place)."""
    if bucket == plan.bucket:  # as if padded: the grid by the bucket's rule (`plan/prompts.py: bucket_grid`)
        grid = bucket_grid(plan.prompts_only, bucket.prompts, bucket.query_len)
        return plan if grid == plan.prompt_grid else replace(plan, prompt_grid=grid)
    if isinstance(plan, InvariantPlan):
        return pad_invariant(plan, bucket)
    return pad_default(plan, bucket, buffers)


__all__ = ["DEFAULT_OPTIONS", "InvariantPlan", "PathWork", "PlanBuffers", "PlanOptions", "StepPlan", "UNIQUE_LAYOUTS",
           "pad_plan", "plan_checked", "plan_step"]
