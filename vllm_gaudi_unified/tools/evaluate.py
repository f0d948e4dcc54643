"""How good a plan is on a trace: graphs, coverage, padding waste, and where the waste comes from.

- graphs: buckets in the plan (one compiled graph each);
- covered: share of the trace's steps some bucket covers (the rest are misses);
- padding waste: padded work / real work over the covered steps, work from the
  plan's cost model (`bucket_plans/cost.py`): the sum over steps of the cost of the bucket
  `find` returns, divided by the sum of the cost of each step's own shape;
- per dimension: the same ratio for each size's term of the cost (the model
  is linear, so the terms add up to the total), and its share of the extra work;
- algorithm factor: score pairs the planner computes for the step's own shape
  divided by the pairs the step needs (tiling overhead, before any padding).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from vllm_gaudi_unified.bucket import bucket_from_sizes
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.bucket_plans.cost import DIMS, SHORT
from vllm_gaudi_unified.tools.shapes import StepShapes


@dataclass
class Evaluation:
    trace: str
    steps: int
    graphs: int
    graphs_used: int
    covered: float
    misses: int
    padding_waste: float
    algorithm_factor: float
    per_dim: dict  #: dim -> {"padded": µs, "real": µs, "waste": ratio, "share_of_extra": fraction}
    miss_examples: list

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"trace: {self.trace}",
                 f"steps: {self.steps}   graphs: {self.graphs} ({self.graphs_used} used)   "
                 f"covered: {100 * self.covered:.2f} %   misses: {self.misses}",
                 f"padding waste (padded / real work): {self.padding_waste:.3f}",
                 f"algorithm factor (planned / needed score pairs, unpadded): {self.algorithm_factor:.3f}",
                 "", f"{'dimension':<10} {'real µs':>14} {'padded µs':>14} {'waste':>8} {'share of extra':>15}"]
        for d in DIMS:
            r = self.per_dim[d]
            lines.append(f"{SHORT[d]:<10} {r['real']:>14.1f} {r['padded']:>14.1f} {r['waste']:>8.3f} "
                         f"{100 * r['share_of_extra']:>14.1f}%")
        for m in self.miss_examples:
            lines.append(f"miss: {m}")
        return "\n".join(lines)


def evaluate(plan: BucketPlan, shapes: StepShapes, name: str = "") -> Evaluation:
    sizes = np.asarray(shapes.sizes, np.int64)
    if len(sizes) == 0:
        raise ValueError("cannot evaluate on an empty trace")
    if shapes.block_size != plan.settings.block_size:
        raise ValueError(f"trace block_size {shapes.block_size} differs from the plan's {plan.settings.block_size}")
    idx = plan.find_all(sizes)
    hit = idx >= 0
    w = plan.cost_model.weights
    real = sizes[hit] * w
    padded = plan.sizes[idx[hit]] * w
    extra_total = float(padded.sum() - real.sum())
    per_dim = {}
    for d, dim in enumerate(DIMS):
        r, p = float(real[:, d].sum()), float(padded[:, d].sum())
        per_dim[dim] = {"real": r, "padded": p, "waste": p / r if r > 0 else (1.0 if p == 0 else float("inf")),
                        "share_of_extra": (p - r) / extra_total if extra_total > 0 else 0.0}
    opts, bs = plan.settings.options, plan.settings.block_size
    planned_pairs = (sizes[:, 4] * opts.causal_tile ** 2 + sizes[:, 0] + sizes[:, 1] * opts.shared_rows * bs
                     + sizes[:, 2] * bs).sum()
    needed_pairs = shapes.needed.sum()
    misses = [plan.explain_miss(bucket_from_sizes(sizes[i])) for i in np.flatnonzero(~hit)[:3]]
    return Evaluation(
        trace=name or ", ".join(shapes.sources), steps=len(sizes), graphs=len(plan), graphs_used=len(np.unique(idx[hit])),
        covered=float(hit.mean()), misses=int((~hit).sum()),
        padding_waste=float(padded.sum() / real.sum()) if real.sum() > 0 else 1.0,
        algorithm_factor=float(planned_pairs / needed_pairs) if needed_pairs else 1.0,
        per_dim=per_dim, miss_examples=misses)


