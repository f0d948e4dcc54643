"""The `trace` strategy: buckets learned from recorded steps (offline; the `exponential` baseline is
`bucket_plans/exponential.py`).

**trace**, learned from recorded steps: choose at most `max_graphs` buckets
(or the fewest reaching a padding-waste target) that minimise the expected
padded work `sum over steps of cost(find(step))`, while one bucket covers the
settings' limits and every step learned from, so no such step is ever a miss. The
method is greedy facility location followed by local search:

1. Every step's shape is rounded up onto a per-dimension geometric grid (ratio
   `2**(1/resolution)`, each point rounded to the dimension's step). A grid
   point covers a step iff it covers the step's rounded shape, so steps with
   the same rounded shape are one weighted group.
2. Candidates: the distinct rounded shapes, the largest rounded shape of each
   phase, and the limits. Start from the limits bucket alone.
3. Greedy: add the candidate that lowers the total padded work most (each group
   pays the cheapest bucket covering it), until `max_graphs` buckets or the
   waste target. The gain of every candidate is one vectorised product.
4. Local search: tighten every bucket to the grid-rounded maximum of the groups
   it serves (cost only falls), and try dropping each bucket and adding the best
   candidate instead, keeping any change that lowers the total; repeat until
   nothing improves.

The objective is a weighted facility-location cost, so the greedy step has the
usual `1 - 1/e` guarantee on the work saved; the local search removes most of
the rest. Work is the linear model of `bucket_plans/cost.py`.
"""
from __future__ import annotations

import time

import numpy as np

from vllm_gaudi_unified.bucket import bucket_from_sizes, codes_of
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.bucket_plans.cost import DIMS, CostModel, Hardware, ModelSpec
from vllm_gaudi_unified.bucket_plans.exponential import exp_values, exponential_plan
from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
from vllm_gaudi_unified.plan.smallest import lift_to_smallest
from vllm_gaudi_unified.tools.shapes import StepShapes

STRATEGIES = ("exponential", "trace")


#: Grid step per dimension (query, shared: blocks_per_tile, unique, logits, causal).
DEFAULT_STEPS = {"query_len": 8, "num_unique_blocks": 8, "num_logits": 4, "num_causal_tiles": 1}


def grid_values(limit: int, step: int, resolution: float, lo: int = 1) -> np.ndarray:
    """0, then a geometric grid of ratio 2**(1/resolution) from `lo`, rounded up to `step`, up to `limit`."""
    vals = exp_values(max(1, min(lo, limit)), limit, 2.0 ** (1.0 / resolution), step) if limit > 0 else []
    return np.array([0] + vals, dtype=np.int64)


def round_up(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Smallest grid value >= x (x beyond the grid stays x: such a step is past the limits)."""
    i = np.searchsorted(grid, x, side="left")
    return np.where(i < len(grid), grid[np.minimum(i, len(grid) - 1)], x)


class _Problem:
    """Weighted groups of grid-rounded shapes, and the coverage of candidate buckets."""

    def __init__(self, sizes: np.ndarray, settings: ServerSettings, cost: CostModel, resolution: float,
                 margin: float = 0.0):
        lim = settings.limits()
        kb = settings.blocks_per_tile
        steps = [DEFAULT_STEPS["query_len"], kb, DEFAULT_STEPS["num_unique_blocks"], DEFAULT_STEPS["num_logits"],
                 DEFAULT_STEPS["num_causal_tiles"]]
        self.grids = [grid_values(int(lim[d]), steps[d], resolution, lo=steps[d]) for d in range(len(DIMS))]
        self.num_over = int((sizes > lim[None, :]).any(1).sum())
        grown = np.ceil(sizes * (1.0 + margin)).astype(np.int64)
        grown = np.where(sizes > 0, np.minimum(grown, np.maximum(lim[None, :], sizes)), 0)
        rounded = np.stack([round_up(grown[:, d], self.grids[d]) for d in range(len(DIMS))], 1)
        self.groups, self.weight = np.unique(rounded, axis=0, return_counts=True)
        self.weight = self.weight.astype(np.float64)
        self.real = float(cost.cost(sizes).sum())
        # The top bucket covers the configured maxima and every step learned from (the
        # limits are a convention for the shared slots; an odd step may exceed them).
        self.limits = np.maximum(lim, self.groups.max(0))
        self.cost = cost

    def covers(self, cands: np.ndarray) -> np.ndarray:
        """bool [len(cands), groups]."""
        g = self.groups
        cov = np.ones((len(cands), len(g)), bool)
        for d in range(len(DIMS)):
            cov &= cands[:, None, d] >= g[None, :, d]
        return cov


class _Gains:
    """`gain[c] = sum over groups g of cov[c, g] w[g] max(cur[g] - cost[c], 0)`: the padded work
    candidate c saves when added to buckets that serve the groups at `cur`.

    The full product is [candidates x groups]; when `cur` changes on a few groups only (a
    bucket added, or one dropped) the sums are updated on those groups. Updated sums can
    differ from a fresh sum in the last bits, so `best` re-sums exactly the candidates within
    a relative 1e-9 of the top and takes the first exact maximum, which is the argmax of the
    exact sums."""

    def __init__(self, cost: np.ndarray, cov: np.ndarray, w: np.ndarray):
        self.cost, self.cov, self.w = cost, cov, w

    def exact(self, cur: np.ndarray, rows=slice(None)) -> np.ndarray:
        return (np.maximum(cur[None, :] - self.cost[rows, None], 0.0) * self.cov[rows]) @ self.w

    def reset(self, cur: np.ndarray) -> np.ndarray:
        self.cur, self.gain = cur, self.exact(cur)
        return self.gain

    def updated(self, new: np.ndarray, changed: np.ndarray) -> np.ndarray:
        """Gains with `cur` replaced by `new` (which differs from it only on `changed`)."""
        if changed.size == 0:
            return self.gain
        c = self.cost[:, None]
        d = (np.maximum(new[changed][None, :] - c, 0.0) - np.maximum(self.cur[changed][None, :] - c, 0.0))
        return self.gain + (d * self.cov[:, changed]) @ self.w[changed]

    def best(self, approx: np.ndarray, cur: np.ndarray) -> tuple[int, float]:
        top = float(approx.max())
        tol = 1e-9 * (float(self.w @ cur) + abs(top)) + 1e-12
        near = np.flatnonzero(approx >= top - tol)
        exact = self.exact(cur, near)
        i = int(np.argmax(exact))
        return int(near[i]), float(exact[i])


def trace_plan(shapes: StepShapes, settings: ServerSettings, model: ModelSpec | None = None,
               hardware: Hardware | None = None, max_graphs: int | None = 32, target_waste: float | None = None,
               resolution: float = 3.0, margin: float = 0.2, local_search: bool = True,
               progress: bool = False) -> BucketPlan:
    """Learn a plan from step shapes; see the module docstring. `max_graphs` counts every bucket,
    the limits bucket included; with `target_waste` it stops at the fewest graphs reaching it."""
    t0 = time.perf_counter()
    model, hardware = model or ModelSpec(), hardware or Hardware()
    if len(shapes) == 0:
        raise ValueError("the traces hold no step to learn from")
    if shapes.block_size != settings.block_size:
        raise ValueError(f"traces have block_size {shapes.block_size}, settings {settings.block_size}")
    if max_graphs is None and target_waste is None:
        raise ValueError("give max_graphs, target_waste or both")
    if max_graphs is not None and max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    if target_waste is not None and target_waste < 1.0:
        raise ValueError(f"target_waste is padded work / real work, so >= 1.0; got {target_waste}")
    if resolution <= 0:
        raise ValueError(f"resolution must be positive, got {resolution}")
    cost = CostModel(model, hardware, settings.block_size, settings.options)
    pb = _Problem(np.asarray(shapes.sizes, np.int64), settings, cost, resolution, margin)
    limit_row = pb.limits[None, :]
    # Candidates: the groups, each phase's largest group, the limits.
    codes = codes_of(pb.groups)
    phase_tops = np.array([pb.groups[codes == c].max(0) for c in np.unique(codes)])
    cands = np.unique(np.concatenate([pb.groups, phase_tops, limit_row]), axis=0)
    cand_cost = cost.cost(cands)
    cand_cov = pb.covers(cands)
    w = pb.weight
    cap = max_graphs if max_graphs is not None else len(cands)

    chosen = [int(np.flatnonzero((cands == limit_row).all(1))[0])]
    cur = np.full(len(pb.groups), cand_cost[chosen[0]])

    def waste(cur_cost):
        return float((w * cur_cost).sum()) / pb.real if pb.real > 0 else 1.0

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cap, desc="choosing buckets", unit="bucket", leave=False)
        bar.update(1)
    gains = _Gains(cand_cost, cand_cov, w)
    approx = gains.reset(cur)
    while len(chosen) < cap and (target_waste is None or waste(cur) > target_waste):
        best, gain = gains.best(approx, cur)
        if gain <= 0:
            break
        chosen.append(best)
        new = np.minimum(cur, np.where(cand_cov[best], cand_cost[best], np.inf))
        if len(chosen) % 64 == 0:
            approx, cur = gains.reset(new), new  # bound the drift of the updated sums
        else:
            approx = gains.updated(new, np.flatnonzero(new < cur))
            gains.cur, gains.gain, cur = new, approx, new
        if bar:
            bar.update(1)
    if bar:
        bar.close()

    buckets = cands[chosen]
    if local_search:
        buckets = _local_search(pb, buckets, cands, cand_cost, cand_cov, gains)
    buckets = lift_to_smallest(buckets, settings.block_size, settings.options, settings.sliding_window)  # all warmable
    plan = BucketPlan([bucket_from_sizes(b) for b in buckets], settings, model, hardware, strategy="trace",
                      info={"max_graphs": max_graphs, "target_waste": target_waste, "resolution": resolution,
                            "sources": [str(s) for s in shapes.sources], "steps": int(len(shapes)),
                            "steps_beyond_limits": pb.num_over,
                            "margin": margin})
    # The waste on the steps learned from, each padded to the bucket `find` picks.
    idx = plan.find_all(shapes.sizes)
    plan.info["expected_padding_waste"] = round(float(plan.costs[idx].sum() / pb.real), 4) if pb.real else 1.0
    plan.info["seconds"] = round(time.perf_counter() - t0, 2)
    return plan


def _local_search(pb: _Problem, buckets: np.ndarray, cands, cand_cost, cand_cov, gains: _Gains,
                  rounds: int = 8) -> np.ndarray:
    """Tighten, then drop-and-add swaps, while the total padded work falls.

    Kept incremental: `table` holds each bucket's cost per group (inf where it does not
    cover it), `cur`/`idx` the cheapest covering bucket per group (the lowest index on a
    tie, as argmin), so a tightened bucket is one row update and dropping bucket b changes
    only the groups b serves, which fall to their second-cheapest bucket."""
    w = pb.weight
    fixed = (buckets == pb.limits[None, :]).all(1)  # the limits bucket stays
    buckets = buckets.copy()

    def table_of(bk):
        return np.where(pb.covers(bk), pb.cost.cost(bk)[:, None], np.inf)

    def row_of(b):
        return np.where(pb.covers(b[None, :])[0], pb.cost.cost(b[None, :])[0], np.inf)

    table = table_of(buckets)
    idx = table.argmin(0)
    cur = table[idx, np.arange(table.shape[1])]
    best_total = float((w * cur).sum())
    for _ in range(rounds):
        improved = False
        # Tighten: each bucket down to the largest (rounded) group it serves.
        for b in range(len(buckets)):
            if fixed[b]:
                continue
            mine = idx == b
            if not mine.any():
                continue
            tight = pb.groups[mine].max(0)
            if (tight < buckets[b]).any():
                row = row_of(tight)
                # b still covers every group it served, now cheaper; other groups may now prefer it.
                new_idx = np.where(row < cur, b, np.where(row == cur, np.minimum(idx, b), idx))
                new_cur = np.minimum(cur, row)
                t = float((w * new_cur).sum())
                if t < best_total - 1e-9:
                    buckets = buckets.copy()
                    buckets[b] = tight
                    table[b] = row
                    idx, cur, best_total, improved = new_idx, new_cur, t, True
        # Swap: drop one bucket, add the best candidate for the groups as they are then served.
        second = np.partition(table, 1, axis=0)[1] if len(buckets) > 1 else np.full_like(cur, np.inf)
        gains.reset(cur)
        for b in range(len(buckets)):
            if fixed[b]:
                continue
            served = np.flatnonzero(idx == b)
            drop = cur.copy()
            drop[served] = second[served]  # served by the others only
            best, gain = gains.best(gains.updated(drop, served), drop)
            t = float((w * drop).sum()) - gain
            if t < best_total - 1e-9 and not (cands[best] == buckets).all(1).any():
                buckets = buckets.copy()
                buckets[b] = cands[best]
                table[b] = np.where(cand_cov[best], cand_cost[best], np.inf)
                idx = table.argmin(0)
                cur = table[idx, np.arange(table.shape[1])]
                second = np.partition(table, 1, axis=0)[1]
                best_total, improved = float((w * cur).sum()), True
                gains.reset(cur)
        if not improved:
            break
    return np.unique(buckets, axis=0)


def make_plan(strategy: str, settings: ServerSettings, shapes: StepShapes | None = None, **kw) -> BucketPlan:
    if strategy == "exponential":
        return exponential_plan(settings, kw.get("model"), kw.get("hardware"), base=kw.get("base", 2.0))
    if strategy == "trace":
        if shapes is None:
            raise ValueError("the trace strategy needs at least one trace (--trace)")
        return trace_plan(shapes, settings, kw.get("model"), kw.get("hardware"), max_graphs=kw.get("max_graphs", 32),
                          target_waste=kw.get("target_waste"), resolution=kw.get("resolution", 3.0), margin=kw.get("margin", 0.2),
                          progress=kw.get("progress", False))
    raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
