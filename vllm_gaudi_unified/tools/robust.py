"""The `robust` strategy: a plan that holds when the load changes.

A plan learned by total padded work (`trace`) serves the heavy steps of the
load it saw and pads everything else: at a quieter hour every step is small and
pays for buckets sized for a busy one. Three changes make a plan hold:

1. **A skeleton over the whole range.** A chain of buckets for each phase of
   the decode steps seen (`--u`, `-su`; no causal work) and one for the steps
   with causal work (all three paths), from the smallest step up to the
   settings' limits (clipped to the gather cap), each bucket about
   `skeleton_ratio` times cheaper than the next, every bucket of its chain's
   phase: `BucketPlan.find` gives a step a bucket of its own phase, so a decode
   step never pays for causal tiles, nor a `--u` step for shared ones (and the
   learner below counts a bucket as covering only the decode steps of its
   phase; steps with causal work, rarer on the tiled route since prompt graphs,
   take any bucket with causal work). The skeleton grows by one chain per
   decode phase, about log(top cost / smallest cost) / log(ratio) buckets
   each. A chain bucket is the
   per-dimension maximum of the learned steps at most as costly as its level
   (so it follows the traffic's proportions), never more than the level's cost
   in any one dimension, and, below the cheapest step seen, the next bucket
   divided by the ratio. Every step up to the limits is covered; a step near a
   chain bucket's proportions pays at most about the ratio there (a step far
   from them can pay more: five independent sizes cannot all be bounded
   without a product grid).
2. **Several traces, several loads.** Every trace given counts equally, and
   the learner also sees each trace again at lower loads: its steps with only
   some of their requests (each kept with probability 1/2, 1/4, 1/16, at least
   one), replayed through the planner's shape rules (`load_scaled_shapes`). A
   trace at high load shows what many requests do; its subsets what a few do.
   With `drain`, each fraction is also seen as a burst draining: the requests
   left running are the ones with the longest outputs, so each step keeps the
   share of its requests with the most blocks of their own (blocks no other
   request of the step reads). A random subset keeps short and long requests
   alike; a draining server keeps long ones, about twice the unique blocks per
   request at the same batch size (the second half of the RAG trace, its
   decodes only, is such a drain), so buckets learned from random subsets
   alone fit its steps only in buckets with far more shared slots.
3. **Both measures.** A step padded to a bucket costs its share of its trace's
   total estimated time (`cost.py`) plus its share of the trace's total score
   pairs (`CostModel.pair_weights`); `total_share < 1` mixes in each step's own
   padding ratio (small steps then count as much as large ones), and with
   `worst` a step padded beyond `worst` times its work (either measure) costs
   more than all other padding together, so the greedy covers it first.

Then, as for `trace`: steps are rounded onto a geometric grid and grouped,
candidates are the group shapes, greedy facility location adds the candidate
that lowers the objective most until `max_graphs`, and a local search tightens
and swaps buckets while the objective falls. The objective is linear in a
bucket's sizes for each group (`A_g time(bucket) + B_g pairs(bucket)`), so
the greedy and the swaps are products of a [candidates x groups] matrix.

No bucket gathers more block slots than the gather cap (`plan.split.GatherCap`, a
share of device memory): steps beyond it are cut into pieces by the planner,
and the learner plans for the pieces.
"""
from __future__ import annotations

import time

import numpy as np

from vllm_gaudi_unified.bucket_plans.cost import DIMS, CostModel, Hardware, ModelSpec
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
from vllm_gaudi_unified.bucket import PHASES, SIZE_NAMES, bucket_from_sizes, codes_of
from vllm_gaudi_unified.plan.smallest import lift_to_smallest
from vllm_gaudi_unified.tools.shapes import StepShapes
from vllm_gaudi_unified.tools.strategies import grid_values, round_up
from vllm_gaudi_unified.plan.split import GatherCap, piece_sizes
from vllm_gaudi_unified.bucket_plans.trace import step_lines

Q, S, U, L, C = range(5)
#: Buckets of a robust plan unless told otherwise: with `prompt_graphs.DEFAULT_PROMPT_GRAPHS` 100 graphs in all
#: (the skeleton's four chains take 12 of the 50 at the 8B Gaudi-3 setting).
DEFAULT_ROBUST_GRAPHS = 50
#: The shared dimension's grid is this many times finer than the others': a padded shared slot costs the device
#: 16 x 128 score pairs, the most of any size after a causal tile, and shared slots change only when prefix
#: groups do, so steps sit on few values that a coarse grid rounds far up. Not in batch-invariant mode, whose shared
#: grid steps are whole products of `invariant_chunk` units.
SHARED_FINER = 2
#: Fractions of a step's requests kept to see it at lower loads.
LOAD_FRACTIONS = (0.5, 0.25, 0.0625)


def _level_down(b: np.ndarray, ratio: float, steps, causal: bool) -> np.ndarray:
    """A bucket about `ratio` times cheaper: every size divided by the ratio, kept legal."""
    out = np.ceil(b / ratio).astype(np.int64)
    out[S] = -(-out[S] // steps[S]) * steps[S]
    out[C] = -(-out[C] // steps[C]) * steps[C]
    out[Q], out[L] = max(out[Q], 1), max(out[L], 1)
    if causal:
        out[C], out[Q] = max(out[C], 1), max(out[Q], 2)
    return np.where(b > 0, out, 0)


def learn_phase(sizes: np.ndarray) -> np.ndarray:
    """The phase code a bucket or step is learned under: a decode step's own (`--u`, `-su`, ...), every
    step with causal work as `csu` (one chain; `find` falls back to any covering bucket for them)."""
    codes = codes_of(sizes)
    return np.where(codes >= 4, 7, codes)


def skeleton(points: np.ndarray, own_cost: np.ndarray, top: np.ndarray, weights: np.ndarray, ratio: float,
             grids: list, steps) -> np.ndarray:
    """The chains of the module docstring, one per phase of `points`, as sizes [K, 5]; `ratio` 0: only
    each chain's top bucket (every step still has a bucket of its phase)."""
    out = []
    codes = learn_phase(points)
    for code in np.unique(codes).tolist():
        causal = PHASES[code][0] == "c"
        # (a size the settings never reach is no path: batch-invariant mode has no unique one)
        has = np.array([True, PHASES[code][1] == "s", PHASES[code][2] == "u", True, causal]) & (top > 0)
        mine = codes == code
        hi = np.where(has, top, 0)
        if not causal:
            hi[Q] = min(top[Q], top[L])  # decodes: one token per request
        hi = np.maximum(hi, points[mine].max(0))  # (a step's rounded sizes may pass the limits: still covered)
        floor = np.where(has, np.array([2 if causal else 1, steps[S], 1, 1, steps[C]], np.int64), 0)
        lo_cost = float(floor @ weights)
        level = float(hi @ weights)
        prev = hi
        out.append(hi)
        while ratio:
            level /= ratio
            if level < lo_cost:
                break
            sel = mine & (own_cost <= level)
            if sel.any():
                env = points[sel].max(0)
                env = np.minimum(env, np.floor(level / np.maximum(weights, 1e-30)).astype(np.int64))
                env = np.minimum(np.maximum(env, floor), prev)
                b = np.stack([round_up(env[d:d + 1], grids[d])[0] for d in range(len(DIMS))])
            else:
                b = _level_down(prev, ratio, steps, causal)
            b = np.where(has, np.minimum(np.maximum(b, floor), prev), 0)
            if (b == prev).all():
                continue
            out.append(b)
            prev = b
    return np.unique(np.array(out, np.int64), axis=0)


def robust_plan(shapes: list[StepShapes], settings: ServerSettings, model: ModelSpec | None = None,
                hardware: Hardware | None = None, max_graphs: int = DEFAULT_ROBUST_GRAPHS, worst: float | None = None,
                skeleton_ratio: float = 32.0, resolution: float = 3.0, margin: float = 0.1,
                total_share: float = 1.0, source_weights=None, cap: GatherCap | None = None, local_search: bool = True,
                sources: list | None = None, margin_sizes=None) -> BucketPlan:
    """Learn a plan from several sets of step shapes (traces, and the same traces at lower loads);
    see the module docstring. `max_graphs` counts every bucket, skeleton included. `margin` grows the sizes named
    in `margin_sizes` (`bucket.SIZE_NAMES`; default all): a step's unique blocks and causal tiles grow with its
    contexts, while its requests (query rows of a decode, logits) stop at a server's batch and its shared slots
    come in whole tiles of its prefix groups, so grown they would take the next grid value above steps that sit
    on them (a full batch of 128 decodes in a bucket of 164)."""
    t0 = time.perf_counter()
    model, hardware = model or ModelSpec(), hardware or Hardware()
    shapes = [s for s in shapes if len(s)]
    if not shapes:
        raise ValueError("the traces hold no step to learn from")
    for s in shapes:
        if s.block_size != settings.block_size:
            raise ValueError(f"traces have block_size {s.block_size}, settings {settings.block_size}")
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    if worst is not None and worst <= 1.0:
        raise ValueError(f"worst is a padding ratio, so > 1; got {worst}")
    if skeleton_ratio != 0 and skeleton_ratio <= 1.0:
        raise ValueError(f"skeleton_ratio must be 0 (no skeleton) or > 1, got {skeleton_ratio}")
    if not 0.0 <= total_share <= 1.0:
        raise ValueError(f"total_share must be in [0, 1], got {total_share}")
    cap = cap or GatherCap()
    cost = CostModel(model, hardware, settings.block_size, settings.options)
    wt, wp = cost.weights, cost.pair_weights
    o = settings.options
    # The shared dimension's step: a shared tile's blocks; in batch-invariant mode a product of
    # `invariant_chunk` units (and of `invariant_causal_chunk` causal tiles), which the device computes
    # whole, so a bucket between two multiples would only hide padding.
    kb = o.invariant_chunk if o.batch_invariant else settings.blocks_per_tile
    c_step = o.invariant_causal_chunk if o.batch_invariant else 1
    lim = settings.limits()
    top = lim.copy()
    if cap.max_shared_blocks is not None:
        top[S] = min(top[S], cap.max_shared_blocks)
    if cap.max_unique_blocks is not None:
        top[U] = min(top[U], cap.max_unique_blocks)

    # Pieces of every step, with their coefficients: A (per µs of a bucket), B (per score pair).
    sizes, coef_a, coef_b = [], [], []
    weights = np.ones(len(shapes)) if source_weights is None else np.asarray(source_weights, np.float64)
    if weights.shape != (len(shapes),) or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"source_weights must be {len(shapes)} non-negative numbers, got {source_weights!r}")
    weights = weights / weights.sum()
    for s, ws in zip(shapes, weights):
        pieces, owner = piece_sizes(s.sizes, cap, kb)
        own_t, own_p = pieces @ wt, np.maximum(pieces @ wp, 1.0)
        n = len(s)
        sizes.append(pieces)
        coef_a.append(ws * (total_share / own_t.sum() + (1 - total_share) / (n * own_t)))
        coef_b.append(ws * (total_share / own_p.sum() + (1 - total_share) / (n * own_p)))
    sizes = np.concatenate(sizes)
    coef_a, coef_b = np.concatenate(coef_a), np.concatenate(coef_b)
    top = np.maximum(top, sizes.max(0))  # pieces are within the cap

    steps = [4, kb, 4, 2, c_step]  # grid steps: small, so that a one-request step is not padded by the grid
    top[S], top[C] = -(-top[S] // kb) * kb, -(-top[C] // c_step) * c_step
    finer = [SHARED_FINER if d == S and not o.batch_invariant else 1 for d in range(len(DIMS))]  # (invariant: products)
    grids = [grid_values(int(top[d]), steps[d], resolution * finer[d], lo=steps[d] if d in (S, C) else 1)
             for d in range(len(DIMS))]
    grow = np.array([margin_sizes is None or name in margin_sizes for name in SIZE_NAMES], np.float64)
    if margin_sizes is not None and set(margin_sizes) - set(SIZE_NAMES):
        raise ValueError(f"margin_sizes must name some of {', '.join(SIZE_NAMES)}, got {margin_sizes!r}")
    grown = np.where(sizes > 0, np.minimum(np.ceil(sizes * (1 + margin * grow)).astype(np.int64), top[None, :]), 0)
    grown = np.maximum(grown, sizes)
    rounded = np.stack([round_up(grown[:, d], grids[d]) for d in range(len(DIMS))], 1)
    rounded = np.minimum(rounded, np.maximum(top[None, :], sizes))
    # A decode step has at most `unique_tokens` query tokens per logit (one per request without drafts): its
    # query rows rounded past that are rows no decode step fills (a padded row costs 20x its FLOPs).
    per = settings.options.unique_tokens
    rounded[:, Q] = np.where(rounded[:, C] == 0, np.maximum(np.minimum(rounded[:, Q], rounded[:, L] * per), sizes[:, Q]),
                             rounded[:, Q])
    groups, inv = np.unique(rounded, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    G = len(groups)
    A = np.bincount(inv, coef_a, G)
    B = np.bincount(inv, coef_b, G)
    own_t, own_p = sizes @ wt, np.maximum(sizes @ wp, 1.0)
    min_t = np.full(G, np.inf)
    np.minimum.at(min_t, inv, own_t)
    min_p = np.full(G, np.inf)
    np.minimum.at(min_p, inv, own_p)

    group_codes = learn_phase(groups)
    top_row = np.maximum(top, groups.max(0))
    skel = skeleton(groups, groups @ wt, top_row, wt, skeleton_ratio, grids, steps)
    skel = np.unique(np.concatenate([skel, top_row[None]]), axis=0)
    if len(skel) > max_graphs:
        raise ValueError(f"the skeleton alone has {len(skel)} buckets, more than max_graphs {max_graphs}: "
                         f"raise --skeleton-ratio or max_graphs")

    def rows(cands: np.ndarray) -> np.ndarray:
        """Objective of each candidate for each group [len(cands), G]; inf where it does not cover."""
        ct, cp = cands @ wt, cands @ wp
        m = ct[:, None] * A[None, :] + cp[:, None] * B[None, :]
        if worst is not None:
            bad = (ct[:, None] > worst * min_t[None, :]) | (cp[:, None] > worst * min_p[None, :])
            m = np.where(bad, m + big, m)
        cov = learn_phase(cands)[:, None] == group_codes[None, :]  # a decode step takes a bucket of its phase
        for d in range(len(DIMS)):
            cov &= cands[:, None, d] >= groups[None, :, d]
        return np.where(cov, m, np.inf)

    # A group padded beyond `worst` costs more than padding every group to the top bucket: the greedy
    # covers such groups first (set cover), then lowers the total.
    big = float((top_row @ wt) * A.sum() + (top_row @ wp) * B.sum())
    cands = np.unique(np.concatenate([groups, skel]), axis=0)
    M = rows(cands)
    fixed = [int(np.flatnonzero((cands == b).all(1))[0]) for b in skel]
    chosen = list(fixed)
    cur = M[chosen].min(0)
    while len(chosen) < max_graphs:
        gain = np.maximum(cur[None, :] - M, 0.0).sum(1)
        best = int(np.argmax(gain))
        if gain[best] <= 0:
            break
        chosen.append(best)
        cur = np.minimum(cur, M[best])
    buckets = cands[chosen]
    if local_search:
        buckets = _local_search(buckets, len(fixed), cands, M, rows, groups)
    buckets = lift_to_smallest(buckets, settings.block_size, settings.options, settings.sliding_window)  # all warmable
    plan = BucketPlan([bucket_from_sizes(b) for b in buckets], settings, model, hardware, strategy="robust", gather_cap=cap,
                      info={"max_graphs": max_graphs, "worst": worst, "skeleton_ratio": skeleton_ratio,
                            "skeleton_buckets": int(len(skel)), "resolution": resolution, "margin": margin,
                            **({} if margin_sizes is None else {"margin_sizes": list(margin_sizes)}),
                            "total_share": total_share, "steps": int(sum(len(s) for s in shapes)),
                            "sources": [str(x) for x in (sources or [src for s in shapes for src in s.sources])]})
    plan.info["seconds"] = round(time.perf_counter() - t0, 2)
    return plan


def _local_search(buckets, num_fixed, cands, M, rows, groups, rounds: int = 6) -> np.ndarray:
    """Tighten each learned bucket to the groups it serves, then swap it for the best candidate,
    while the objective falls. The first `num_fixed` buckets (the skeleton) stay."""
    buckets = buckets.copy()
    table = rows(buckets)
    total = float(table.min(0).sum())
    for _ in range(rounds):
        improved = False
        for b in range(num_fixed, len(buckets)):
            idx = table.argmin(0)
            mine = (idx == b) & np.isfinite(table[b])
            if mine.any():
                tight = groups[mine].max(0)
                if (tight < buckets[b]).any():
                    row = rows(tight[None])[0]
                    trial = table.copy()
                    trial[b] = row
                    t = float(trial.min(0).sum())
                    if t < total - 1e-12:
                        buckets[b], table, total, improved = tight, trial, t, True
            others = np.delete(table, b, 0).min(0)
            gain = np.maximum(others[None, :] - M, 0.0).sum(1)
            best = int(np.argmax(gain))
            t = float(others.sum()) - float(gain[best])
            if t < total - 1e-12 and not (cands[best] == buckets).all(1).any():
                buckets[b] = cands[best]
                table[b] = M[best]
                total, improved = float(table.min(0).sum()), True
        if not improved:
            break
    return np.unique(buckets, axis=0)


def load_scaled_shapes(trace, settings: ServerSettings, fractions=LOAD_FRACTIONS, max_steps: int = 2000,
                       seed: int = 0, drain: bool = False) -> list[StepShapes]:
    """The steps of a trace (a path, or a list of TraceSteps) at lower loads: for each fraction f, up
    to `max_steps` of its steps (a seeded sample) with each request kept with probability f (at least
    one per step), replayed by the shape-only rules of `shapes.batch_shapes`; with `drain`, then the
    same steps with the round(f * n) requests (at least one) of the most blocks of their own kept
    (module docstring, 2.). Steps in a layout the fast parser does not read, and settings it does not
    model, give no scaled steps."""
    from vllm_gaudi_unified.tools import shapes as sh

    if not sh.shape_only_supported(settings):
        return []
    rng = np.random.default_rng(seed)
    if isinstance(trace, str):
        items, name = step_lines(trace)[0], trace
    else:
        items, name = list(trace), "steps"
    if len(items) > max_steps:
        items = [items[i] for i in np.sort(rng.choice(len(items), max_steps, replace=False))]
    arrays = []
    for lo in range(0, len(items), sh._BATCH):
        part = items[lo:lo + sh._BATCH]
        a = (sh._parse_lines(part, settings.block_size) if isinstance(part[0], str)
             else sh._arrays_of_steps(part) if all(x.block_size == settings.block_size for x in part) else None)
        if a is not None:
            arrays.append(a)
    ranks = [_own_rank(a) for a in arrays] if drain and fractions else []
    out = []
    for mode, f in [("load", f) for f in fractions] + [("drain", f) for f in fractions if drain]:
        sizes, needed = [], []
        for i, a in enumerate(arrays):
            counts = np.bincount(a.req_step, minlength=a.num_steps)
            first = np.r_[0, np.cumsum(counts)[:-1]]
            if mode == "drain":
                keep = ranks[i] < np.maximum(np.round(f * counts), 1)[a.req_step]
            else:
                keep = rng.random(a.q.size) < f
                keep[first + (rng.random(a.num_steps) * counts).astype(np.int64)] = True  # at least one
            sub = sh._Arrays(a.block_size, a.q[keep], a.ctx[keep], a.flat, a.row_starts[keep], a.req_step[keep],
                             a.num_steps)
            s, w, fallback = sh.batch_shapes(sub, settings.options)
            sizes.append(s[~fallback])
            needed.append(w[~fallback])
        if sizes:
            out.append(StepShapes(np.concatenate(sizes), np.concatenate(needed), settings.block_size,
                                  (f"{name}@{mode}{f:g}",)))
    return out


def _own_rank(a) -> np.ndarray:
    """Per request of `a`: its place in its step by blocks of its own, most first (0, 1, ...)."""
    order = np.lexsort((-_own_blocks(a), a.req_step))
    counts = np.bincount(a.req_step, minlength=a.num_steps)
    rank = np.empty(a.q.size, np.int64)
    rank[order] = np.arange(a.q.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return rank


def _own_blocks(a) -> np.ndarray:
    """Per request of the flat arrays `a` (`shapes._Arrays`): its blocks no other request of its step reads."""
    n = -(-(a.ctx + a.q) // a.block_size)
    req = np.repeat(np.arange(n.size), n)
    ids = a.flat[a.row_starts[req] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)]
    _, inv, uses = np.unique(a.req_step[req].astype(np.int64) * (1 << 32) + ids, return_inverse=True,
                             return_counts=True)
    return np.bincount(req, uses[inv.reshape(-1)] == 1, n.size).astype(np.int64)
