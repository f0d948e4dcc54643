"""How good a plan is on a trace, honestly: every step counted, in two measures, with the worst.

For each step the planner's calls (one, or the pieces of a step beyond the
gather cap: `split.piece_sizes`) are padded to the bucket `find` returns. A call
no bucket covers follows the plan's miss policy and is counted, never dropped:

- `largest`: padded to the largest bucket when that covers it;
- `unbucketed`: runs at its own shape (no padding, but a graph compiled while
  serving);
- `error` (or `largest` when even the largest is too small): the server would
  raise; the step is counted at its own shape and reported as *failed*.

Padding is padded work / unpadded work over all steps, in two measures:

- **time**: the plan's cost model (`cost.py`, estimated device µs);
- **score work**: (query token, key) pairs, as the planner's
  `StepPlan.work_planned` counts them (`CostModel.pair_weights`). A shared slot
  holds `shared_rows x block_size` pairs, 16 times a unique slot's at the
  defaults, where the time model prices them about equally.

Besides the totals: the per-step padding ratio's worst and 99th percentile,
the step that is worst, and the split of the extra work per dimension.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from vllm_gaudi_unified.bucket import bucket_from_sizes
from vllm_gaudi_unified.bucket_plans.cost import DIMS, SHORT
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.tools.shapes import StepShapes
from vllm_gaudi_unified.plan.split import GatherCap, piece_sizes


@dataclass
class PaddedSteps:
    """Per step: its own and its padded work in both measures; per call: bucket index (-1: miss)."""

    own_time: np.ndarray
    padded_time: np.ndarray
    own_pairs: np.ndarray
    padded_pairs: np.ndarray
    padded_sizes: np.ndarray  #: [calls, 5] what each call runs at
    call_sizes: np.ndarray  #: [calls, 5] each call's own shape
    call_step: np.ndarray  #: [calls] the step of each call
    call_bucket: np.ndarray  #: [calls] bucket index, -1 when no bucket covers the call
    failed: np.ndarray  #: [steps] bool: a call the miss policy cannot serve


def pad_steps(plan: BucketPlan, sizes: np.ndarray, cap: GatherCap | None = None) -> PaddedSteps:
    """Every step's calls padded as the server would pad them (see the module docstring)."""
    sizes = np.asarray(sizes, np.int64)
    cap = plan.gather_cap if cap is None else cap
    calls, owner = piece_sizes(sizes, cap, plan.settings.blocks_per_tile)
    idx = plan.find_all(calls)
    miss = idx < 0
    padded = np.where(miss[:, None], calls, plan.sizes[np.maximum(idx, 0)])
    failed_call = np.zeros(len(calls), bool)
    if miss.any():
        if plan.miss_policy == "largest":
            big = plan.sizes[int(np.argmax(plan.costs))]
            fits = (calls <= big[None, :]).all(1)
            padded = np.where((miss & fits)[:, None], big[None, :], padded)
            failed_call = miss & ~fits
        elif plan.miss_policy == "error":
            failed_call = miss
    padded = run_sizes(plan.settings, padded)
    wt, wp = plan.cost_model.weights, plan.cost_model.pair_weights
    n = len(sizes)
    return PaddedSteps(
        own_time=np.bincount(owner, calls @ wt, n), padded_time=np.bincount(owner, padded @ wt, n),
        own_pairs=np.bincount(owner, calls @ wp, n), padded_pairs=np.bincount(owner, padded @ wp, n),
        padded_sizes=padded, call_sizes=calls, call_step=owner, call_bucket=idx,
        failed=np.bincount(owner, failed_call, n) > 0)


def run_sizes(settings, sizes: np.ndarray) -> np.ndarray:
    """The sizes the device computes for padded shapes: in batch-invariant mode units and causal tiles
    run in whole products of `invariant_chunk` / `invariant_causal_chunk` (the last one padded), a
    padding of its own that counts like a bucket's."""
    o = settings.options
    if not o.batch_invariant:
        return sizes
    out = sizes.copy()
    out[:, 1] = -(-out[:, 1] // o.invariant_chunk) * o.invariant_chunk
    out[:, 4] = -(-out[:, 4] // o.invariant_causal_chunk) * o.invariant_causal_chunk
    return out


@dataclass
class Evaluation:
    trace: str
    steps: int
    graphs: int
    graphs_used: int
    calls: int  #: planner calls (more than steps when steps are split under the gather cap)
    uncovered: int  #: steps with a call no bucket covers (counted by the miss policy)
    failed: int  #: of those, steps the miss policy cannot serve (would raise)
    miss_policy: str
    padding_time: float  #: padded / unpadded estimated time, all steps
    padding_pairs: float  #: padded / unpadded score pairs, all steps
    worst_time: float  #: the largest per-step ratio
    worst_pairs: float
    p99_time: float  #: 99th percentile of the per-step ratio
    p99_pairs: float
    worst_step: str  #: the step with the largest ratio (either measure) and what it ran at
    algorithm_factor: float  #: planned / needed score pairs, unpadded (tiling, before bucketing)
    total_factor: float  #: padded planned / needed score pairs (what the device computes per pair needed)
    per_dim: dict  #: dim -> {real, padded (µs), waste, share_of_extra, pairs_waste}
    miss_examples: list

    @property
    def padding_waste(self) -> float:
        """The time-model padding (the figure earlier versions reported, there over covered steps only)."""
        return self.padding_time

    @property
    def covered(self) -> float:
        return 1.0 - self.uncovered / self.steps

    def to_dict(self) -> dict:
        return {**asdict(self), "padding_waste": self.padding_waste, "covered": self.covered}

    def table(self) -> str:
        lines = [f"trace: {self.trace}",
                 f"steps: {self.steps}   calls: {self.calls}   graphs: {self.graphs} ({self.graphs_used} used)",
                 f"uncovered steps: {self.uncovered} (miss policy {self.miss_policy!r}; {self.failed} would fail), "
                 "counted below",
                 f"padding, time model:  {self.padding_time:.3f}   worst step {self.worst_time:.2f}   "
                 f"p99 {self.p99_time:.2f}",
                 f"padding, score pairs: {self.padding_pairs:.3f}   worst step {self.worst_pairs:.2f}   "
                 f"p99 {self.p99_pairs:.2f}",
                 f"worst step: {self.worst_step}",
                 f"algorithm factor (planned / needed score pairs, unpadded): {self.algorithm_factor:.3f}; "
                 f"with padding: {self.total_factor:.3f}",
                 "", f"{'dimension':<10} {'real µs':>14} {'padded µs':>14} {'waste':>8} {'share of extra':>15} "
                     f"{'pairs waste':>12}"]
        for d in DIMS:
            r = self.per_dim[d]
            lines.append(f"{SHORT[d]:<10} {r['real']:>14.1f} {r['padded']:>14.1f} {r['waste']:>8.3f} "
                         f"{100 * r['share_of_extra']:>14.1f}% {r['pairs_waste']:>12.3f}")
        for m in self.miss_examples:
            lines.append(f"miss: {m}")
        return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def evaluate(plan: BucketPlan, shapes: StepShapes, name: str = "") -> Evaluation:
    sizes = np.asarray(shapes.sizes, np.int64)
    if len(sizes) == 0:
        raise ValueError("cannot evaluate on an empty trace")
    if shapes.block_size != plan.settings.block_size:
        raise ValueError(f"trace block_size {shapes.block_size} differs from the plan's {plan.settings.block_size}")
    p = pad_steps(plan, sizes)
    rt = p.padded_time / p.own_time
    rp = p.padded_pairs / np.maximum(p.own_pairs, 1e-30)
    worst = int(np.argmax(np.maximum(rt, rp)))
    ran = ", ".join(str(_bucket(s)) for s in p.padded_sizes[p.call_step == worst])
    wt, wp = plan.cost_model.weights, plan.cost_model.pair_weights
    real, padded = p.call_sizes * wt, p.padded_sizes * wt
    extra = float(padded.sum() - real.sum())
    per_dim = {}
    for d, dim in enumerate(DIMS):
        r, q = float(real[:, d].sum()), float(padded[:, d].sum())
        per_dim[dim] = {"real": r, "padded": q, "waste": _ratio(q, r),
                        "share_of_extra": (q - r) / extra if extra > 0 else 0.0,
                        "pairs_waste": _ratio(float((p.padded_sizes[:, d] * wp[d]).sum()),
                                              float((p.call_sizes[:, d] * wp[d]).sum()))}
    needed = float(np.asarray(shapes.needed).sum())
    miss_calls = np.flatnonzero(p.call_bucket < 0)
    uncovered = np.zeros(len(sizes), bool)
    uncovered[p.call_step[miss_calls]] = True
    return Evaluation(
        trace=name or ", ".join(map(str, shapes.sources)), steps=len(sizes), graphs=len(plan),
        graphs_used=len(np.unique(p.call_bucket[p.call_bucket >= 0])), calls=len(p.call_sizes),
        uncovered=int(uncovered.sum()), failed=int(p.failed.sum()), miss_policy=plan.miss_policy,
        padding_time=_ratio(p.padded_time.sum(), p.own_time.sum()),
        padding_pairs=_ratio(p.padded_pairs.sum(), p.own_pairs.sum()),
        worst_time=float(rt.max()), worst_pairs=float(rp.max()),
        p99_time=float(np.percentile(rt, 99)), p99_pairs=float(np.percentile(rp, 99)),
        worst_step=f"{_bucket(sizes[worst])} ran as {ran} (time {rt[worst]:.2f}x, pairs {rp[worst]:.2f}x)",
        algorithm_factor=_ratio(float(p.own_pairs.sum()), needed),
        total_factor=_ratio(float(p.padded_pairs.sum()), needed),
        per_dim=per_dim, miss_examples=[plan.explain_miss(_bucket(p.call_sizes[i])) for i in miss_calls[:3]])


def _bucket(sizes):
    return bucket_from_sizes(sizes)
