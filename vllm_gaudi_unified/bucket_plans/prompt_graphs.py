"""Prompt graphs: the few buckets of a plan in which prompts take the prompt route.

A plan's buckets count the five sizes of the tiled paths, so every step has a
bucket. The prompt route (`plan/prompts.py`: each prompt or chunk over its own
context as one fused SDPA call, how vllm-gaudi runs prompts) is much faster for
chunked prompts, but a step on it needs a graph of its bucket *and* its prompt
shape `(num_prompts, prompt_len, prompt_blocks)`: a product no server can warm
whole. So a plan also holds a few *prompt graphs*, the shapes that save the
prompt steps of its traces the most time in the plan's time model (a step in no
graph runs tiled, padded to a bucket), each dimension rounded up to a power of
two or to one and a half times one (`rounded_shape`, `half_pow2`), none with
more padded rows than `MAX_GRID_BUDGETS` token budgets, warmed like the other
buckets. A step runs in the cheapest graph covering it.

A graph is the product of its prompt call and the decodes beside it, and
traffic varies the two apart: the same prompts arrive beside 20 decodes at a
quiet hour and beside 256 over long contexts at a busy one. So a learned
graph's decode part may be raised to a decode load of the plan or of its steps
(`decode_levels`): one prompt shape then holds every load up to that one (the
sum of the two sizes, not their product), at the cost of padding the decodes
of quieter steps, which the learner weighs. And a few `top_graphs` (the most
rows, a few prompt counts) hold the bursts of prompts no learned graph holds,
which the tiled route would pad to the plan's largest buckets.

At serving time a step is planned on the prompt route first; when no prompt
graph covers it, it is planned again on the tiled route, whose buckets cover
it (`batch.build_unified_batch`). Never a graph compiled while serving, and the
common prompt shapes at the prompt route's speed. A plan without prompt graphs
(made with `--prompt-graphs 0`, or before they existed) plans on the tiled route.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, bucket_from_sizes, codes_of, phase_of, pow2
from vllm_gaudi_unified.bucket_plans.memory import graph_bytes
from vllm_gaudi_unified.bucket_plans.trace import TraceStep
from vllm_gaudi_unified.plan.options import on_route
from vllm_gaudi_unified.plan.smallest import smallest_prompt_shape

#: Prompt graphs `buckets generate` learns unless told otherwise (each one more graph to warm): with a robust
#: plan's 50 buckets (`tools/robust.py: DEFAULT_ROBUST_GRAPHS`), 100 graphs in all. With 40 the learner spent
#: them on the prompt steps beside the busiest decodes; the 10 more hold prompts beside half as many too, for
#: less than the 10 buckets save on decodes (`docs/bucketing.md`).
DEFAULT_PROMPT_GRAPHS = 50
#: Most padded rows (`num_prompts x prompt_len`) a prompt graph may have, in token budgets
#: (`max_num_batched_tokens`): the grid's scores and index arrays grow with its rows, so a graph of many
#: prompts each padded to the longest would dominate warmup's memory; a step beyond it takes the tiles.
MAX_GRID_BUDGETS = 2
#: What the learner expects a step with prompts on the tiled route to pay, as a multiple of its own tiled
#: shape's cost: the 8B default plan's buckets padded such steps of the shared RAG and chat traces 2.6 and
#: 5.1x in the time model (a step of causal tiles finds few buckets of its size). Lower, the learner
#: leaves more steps to the buckets, which then spend graphs on them.
TILED_PADDING = 2.0
#: The learner also sees each step with prompts beside decodes with each decode kept with this probability
#: (0: not), its copies weighing `FEWER_DECODES_WEIGHT` against the steps as they came: a graph's decode part
#: learned at one load pads the same prompts beside fewer decodes (a quieter hour, a server of fewer
#: sequences: the mix's prompt steps sit beside the most decodes for 83-90 %).
FEWER_DECODES, FEWER_DECODES_WEIGHT = 0.5, 0.5
#: Prompts per step of the top graphs (`top_graphs`), each with the most rows `MAX_GRID_BUDGETS` allows, and
#: the share of the prompt graphs they may take (none in a plan of fewer than `TOP_GRAPH_FEWEST`). RAG brings
#: bursts of 7-23 prompts over one document: in no graph, such a step takes the limits bucket (18-44x its time).
TOP_GRAPH_PROMPTS = (1, 3, 6, 8, 12, 16, 24, 32)
SHORT_GRAPH_PROMPTS = (4,)  #: and short ones beside the most decodes, half the token budget, 2nd quantile's context
TOP_GRAPH_SHARE, TOP_GRAPH_FEWEST = 0.18, 10
#: Context blocks of the top graphs: the first quantile of the learned steps' prompt blocks (rounded by
#: `half_pow2`): the bursts no learned graph holds are over the longest documents (at 0.9, 24 blocks at the 8B
#: setting, bursts of the held-out traces over 26-50 blocks found no top graph). A top graph whose warmup working
#: set would pass the plan's largest bucket's holds less context, down to the second quantile, then shorter
#: prompts (`within_bytes`).
TOP_GRAPH_BLOCKS_QUANTILES = (0.99, 0.9)
#: The top graphs' unique blocks: the learned prompt steps' most, this share more (within the limits and the gather
#: cap): decodes' own blocks grow with their contexts; a longer-context hour's long prompts would take the limits.
TOP_GRAPH_UNIQUE_MARGIN = 0.25
#: Causal tiles of the top graphs, in multiples of the most a learned step with prompts has (rounded up to a
#: power of two): a burst of prompts over a long document, some short ones left to the tiles beside the grid,
#: otherwise finds only the plan's largest causal bucket. On the device 128 of them took a top graph of 12 prompts
#: from 13.2 to 15.4 ms, more than the time model says; the tiled limits bucket is priced 8x the top graph.
TOP_GRAPH_CAUSAL = 2
#: Shares of the prompt steps (by decode cost) whose decode loads' envelope is a level (`decode_levels`): the busiest
#: alone; one below (0.25-0.9 tried) is a corner of the learning load, where the plan's decode buckets fit other loads.
LEVEL_QUANTILES = (1.0,)
DECODE_BUCKET_LEVELS = 2  #: and the cheapest this many of the plan's decode buckets covering a candidate's decodes


def prompt_work(b: Bucket, block_size: int) -> int:
    """(query row, key) pairs of a bucket's prompt call: its padded size, to order graphs by."""
    return b.num_prompts * b.prompt_len * (b.prompt_len + b.prompt_blocks * block_size)


class PromptGraphs:
    """The prompt graphs of a plan and `find`, the first one covering a step: the cheapest by `cost` (a
    function of a graph; the plan's `CostModel.graph_cost`), else the smallest prompt call."""

    def __init__(self, buckets, block_size: int, cost=None):
        for b in buckets:
            if not isinstance(b, Bucket) or not b.num_prompts:
                raise ValueError(f"a prompt graph is a Bucket with num_prompts > 0, got {b!r}")
        key = (lambda b: (prompt_work(b, block_size), b)) if cost is None else (lambda b: (cost(b), b))
        buckets = sorted(set(buckets), key=key)
        self.buckets = buckets
        self._shapes = np.array([b.sizes + b.prompts for b in buckets], np.int64).reshape(len(buckets), 8)

    def __len__(self) -> int:
        return len(self.buckets)

    def find(self, shape: Bucket) -> Bucket | None:
        """The first graph covering `shape`, or None."""
        if not self.buckets or not shape.num_prompts:
            return None
        covers = (self._shapes >= np.asarray(shape.sizes + shape.prompts)).all(1)
        i = int(covers.argmax())
        return self.buckets[i] if covers[i] else None


def half_pow2(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and one and a half times them) >= n;
    0 for n <= 0."""
    p = pow2(n)
    return p * 3 // 4 if p >= 4 and n <= p * 3 // 4 else p


def _limits(settings, cap) -> list[int]:
    """The settings' limits (`ServerSettings.limits`), shared and unique slots within the gather cap."""
    q, s, u, n, c = (int(x) for x in settings.limits())
    return [q, min(s, cap.max_shared_blocks or s), min(u, cap.max_unique_blocks or u), n, c]


def rounded_shape(shape: Bucket, settings, cap, up=pow2) -> Bucket:
    """The prompt graph of a step: each of its eight dimensions rounded up by `up` (powers of two; shared
    slots: whole tiles), within the settings' limits and the gather cap. Not a bucket of the plan:
    a prompt step has no causal tiles to speak of and a handful of decodes, which the plan's
    buckets, made for the tiled route, would pad with empty tiles."""
    kb, lim = settings.blocks_per_tile, _limits(settings, cap)
    q, _, u, n, c = (max(min(up(x), hi), x) for x, hi in zip(shape.sizes, lim))
    tiles = -(-shape.num_shared_blocks // kb)
    s = kb * max(min(up(tiles), lim[1] // kb), tiles)
    return Bucket(shape.phase, q, s, u, n, c, *(up(x) for x in shape.prompts))


def warmable(graph: Bucket, plan) -> Bucket:
    """`graph` raised to cover the step warmup runs for it where that step keeps the graph's phase
    (`smallest_prompt_shape`: rounded in `half_pow2` steps a graph may have fewer logits or tokens than any
    step of its phase with a prompt, e.g. `csu` with 3 logits); else as it is."""
    s = plan.settings
    least = smallest_prompt_shape(graph.phase, bool(graph.prompt_blocks), s.block_size, plan.options_for(graph),
                                  s.sliding_window)
    if least is None or least.phase != graph.phase:
        return graph
    return Bucket(graph.phase, *(int(x) for x in np.maximum(graph.sizes + graph.prompts, least.sizes + least.prompts)))


def decode_levels(plan, sizes: np.ndarray, weights: np.ndarray, sources=None) -> tuple[np.ndarray, np.ndarray]:
    """The decode loads `(shared, unique, logits)` a prompt graph's decode part may be raised to, so that one
    prompt shape covers the decodes of a quiet and of a busy server alike (the sum of a prompt call and a
    decode load, not their product), each [K, 3] by cost (`weights`: µs per unit, DIMS order): the envelopes
    of the decode loads of the prompt steps `sizes` [N, 5] up to each of `LEVEL_QUANTILES` of their cost, each
    trace of `sources` (an id per step; default: one trace) apart (an envelope over chat's many unique blocks
    and RAG's many shared slots would fit neither), and the plan's decode buckets (no causal tiles) but the
    costliest of each phase (the limits)."""
    own = sizes[:, 1:4]
    cost = own @ weights[1:4]
    sources = np.zeros(len(own), np.int64) if sources is None else np.asarray(sources)
    env = np.array([own[(sources == k) & (cost <= np.quantile(cost[sources == k], f))].max(0)
                    for k in np.unique(sources) for f in LEVEL_QUANTILES], np.int64).reshape(-1, 3)
    b, codes = plan.sizes, codes_of(plan.sizes)  # (sorted by cost)
    mine = [b[(codes == c) & (b[:, 4] == 0)][:-1, 1:4] for c in np.unique(codes[b[:, 4] == 0])]
    return tuple(x[np.argsort(x @ weights[1:4], kind="stable")]
                 for x in (np.unique(env, axis=0), np.unique(np.concatenate([np.zeros((0, 3), np.int64), *mine]), axis=0)))


def with_decodes(graph: Bucket, level, settings) -> Bucket:
    """`graph` with its decode part raised to the decode load `level` (shared, unique, logits) and its
    query tokens to every prompt row of its grid beside that many decodes (within the token budget): one
    more decode or one shorter prompt beside a longer one still fits. Shared slots in whole tiles."""
    q, s, u, n, c = graph.sizes
    s, u, n = (max(int(a), int(b)) for a, b in zip((s, u, n), level))
    s = -(-s // settings.blocks_per_tile) * settings.blocks_per_tile
    q = max(q, min(graph.num_prompts * graph.prompt_len + n, settings.max_num_batched_tokens))
    return Bucket(phase_of(c, s, u), q, s, u, n, c, *graph.prompts)


def top_graphs(settings, level, prompt_blocks: int, causal_tiles: int = 0, short_blocks: int = 0) -> list[Bucket]:
    """The prompt graphs every plan with prompt graphs keeps, learned steps or not: for each of
    `TOP_GRAPH_PROMPTS`, that many prompts of the most rows `MAX_GRID_BUDGETS` allows over `prompt_blocks`
    context blocks, beside the decode load `level` and `causal_tiles` causal tiles (the short prompts the
    prompt route leaves to the tiles beside a grid). A burst of prompts no learned graph holds (several requests
    over one long document at once) would take the tiled route (the cheaper of the two). Then `SHORT_GRAPH_PROMPTS`:
    3-4 short prompts beside many decodes would otherwise take a top graph of 4096-row prompts."""
    rows, budget = MAX_GRID_BUDGETS * settings.max_num_batched_tokens, settings.max_num_batched_tokens
    tops = [Bucket("c--" if causal_tiles else "---", 1, 0, 0, 1, causal_tiles, n, min(rows // n, budget), prompt_blocks)
            for n in TOP_GRAPH_PROMPTS if n <= settings.max_num_seqs]
    shorts = [Bucket("---", 1, 0, 0, 1, 0, n, budget // (2 * n), short_blocks or prompt_blocks)
              for n in SHORT_GRAPH_PROMPTS if n <= settings.max_num_seqs]
    return [with_decodes(top, level, settings) for top in tops + shorts]


def within_bytes(graph: Bucket, most: int, plan, fewest_blocks: int) -> Bucket:
    """`graph` within `most` bytes of warmup working set (`memory.graph_bytes`; the plan's largest bucket's, so a
    top graph never raises warmup's peak): its context lowered in `half_pow2` levels down to `fewest_blocks`,
    then its prompt length, until it fits."""
    def lower(n: int) -> int:  # the next `half_pow2` level below n
        p = pow2(n)
        return p * 3 // 4 if p >= 4 and n > p * 3 // 4 else p // 2
    big = lambda g: sum(graph_bytes(g, plan.settings, plan.model).values()) > most  # noqa: E731
    while big(graph) and graph.prompt_blocks > fewest_blocks:
        graph = replace(graph, prompt_blocks=max(fewest_blocks, lower(graph.prompt_blocks)))
    while big(graph) and graph.prompt_len > 1:
        graph = replace(graph, prompt_len=lower(graph.prompt_len))
    return graph


def _fits(graph: Bucket, settings, cap) -> bool:
    """Whether a prompt graph is within the gather cap and `MAX_GRID_BUDGETS`."""
    return (not cap.exceeded(graph) and graph.num_prompts * graph.prompt_len <= MAX_GRID_BUDGETS *
            settings.max_num_batched_tokens and (cap.max_unique_blocks is None or
                                                 graph.num_prompts * graph.prompt_blocks <= cap.max_unique_blocks))


def _choose(candidates: list[Bucket], shapes: np.ndarray, graph_cost: np.ndarray, fallback: np.ndarray,
            weight: np.ndarray, count: int, fixed: int = 0) -> list[Bucket]:
    """`count` graphs among `candidates` (costs `graph_cost`) for the step shapes `shapes` [N, 8]: greedy
    facility location on the steps' weighted time, a step costing its cheapest covering graph, or
    `fallback` (the tiled route) where that is less or none covers it; each time the candidate that
    lowers the total most, after the first `fixed` candidates, always chosen."""
    cand = np.array([g.sizes + g.prompts for g in candidates], np.int64).reshape(-1, 8)
    covers = np.ones((len(cand), len(shapes)), bool)
    for d in range(8):
        covers &= cand[:, None, d] >= shapes[None, :, d]
    # Only (candidate, step) pairs where the candidate beats the tiled route can ever save time: kept sparse.
    rows, cols = np.nonzero(covers & (graph_cost[:, None] < fallback[None, :]))
    cur = fallback.astype(np.float64).copy()
    chosen = list(range(min(fixed, count)))
    for i in chosen:
        cur[covers[i]] = np.minimum(cur[covers[i]], graph_cost[i])
    while len(chosen) < count:
        gain = np.bincount(rows, np.maximum(cur[cols] - graph_cost[rows], 0.0) * weight[cols], len(cand))
        best = int(np.argmax(gain))
        if gain[best] <= 0:
            break
        chosen.append(best)
        cur[covers[best]] = np.minimum(cur[covers[best]], graph_cost[best])
    return [candidates[i] for i in chosen]


def prompt_shapes(plan, steps, every: bool = False):
    """The shape of each step of `steps` (TraceSteps) that has prompts, planned on the prompt route;
    `every`: one per step, None for a step without prompts."""
    from vllm_gaudi_unified.plan import plan_step

    s = plan.settings
    options = on_route(s.options, "dense")
    for step in steps:
        if int(step.query_lens.max()) < 2:  # a decode step never takes the prompt route
            if every:
                yield None
            continue
        shape = plan_step(step.query_lens, step.context_lens, step.block_table(), step.block_size,
                          sliding_window=s.sliding_window, options=options).shape
        if shape.num_prompts or every:
            yield shape if shape.num_prompts else None


def on_prompt_graphs(plan, steps) -> np.ndarray:
    """Bool per step of `steps`: whether it runs in one of `plan`'s prompt graphs (so its tiled shape
    needs no bucket)."""
    return np.array([g is not None and plan.prompt_graph(g) is not None for g in prompt_shapes(plan, steps, True)],
                    bool)


def fewer_decodes(steps, sources, seed: int = 0):
    """`steps` and, after them, each step with prompts and decodes again with each decode kept with
    probability `FEWER_DECODES` (a quieter hour, a server of fewer sequences), with their source ids
    (a copy's: -1 - its step's)."""
    rng = np.random.default_rng(seed)
    out, ids = list(steps), list(sources)
    for st, k in zip(steps, sources):
        q = st.query_lens
        if FEWER_DECODES and int(q.max()) > 1 and (q == 1).sum() > 1:
            keep = (q > 1) | (rng.random(q.size) < FEWER_DECODES)
            out.append(TraceStep(st.block_size, q[keep], st.context_lens[keep],
                                 [b for b, x in zip(st.block_ids, keep) if x]))
            ids.append(-1 - int(k))
    return out, np.array(ids, np.int64)


def tiled_cost(plan, tiled: Bucket) -> float:
    """What a step of tiled shape `tiled` costs on the tiled route of `plan` in its time model: the bucket it
    pads to, or, where none of the plan's buckets covers it (a plan whose buckets are still to be learned),
    its own shape `TILED_PADDING` times."""
    i = plan.covering(tiled)
    return float(plan.costs[i]) if i >= 0 else TILED_PADDING * plan.cost_model.bucket_cost(tiled)


def learn_prompt_graphs(plan, steps, max_graphs: int = DEFAULT_PROMPT_GRAPHS, sources=None,
                        with_top: bool = True) -> tuple[list[Bucket], dict]:
    """The `max_graphs` prompt graphs that save the steps of `steps` (TraceSteps) the most time, and how
    many steps they cover.

    Each step with prompts is planned on the prompt route (`plan_step`, the rules a server applies) and on
    the tiled route. Candidates are its prompt shape rounded up in powers of two and, finer, in
    `half_pow2` steps (at most 1.33x a dimension), each also with its decode part raised to the decode loads
    above it (`decode_levels`, `with_decodes`), within `MAX_GRID_BUDGETS` and the gather cap. A step
    costs, in the plan's time model, its cheapest covering graph (`CostModel.graph_cost`, what
    `BucketPlan.route` weighs) or its tiled shape padded (`tiled_cost`); the `top_graphs` come first
    (`TOP_GRAPH_SHARE` of the count; none without `with_top`), the others are chosen greedily by the time
    they save (`_choose`), each trace of `sources` (an id per step; default: one trace) counted equally."""
    if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 0:
        raise ValueError(f"the number of prompt graphs must be an int >= 0, got {max_graphs!r}")
    from vllm_gaudi_unified.plan import plan_step

    s, cap, model = plan.settings, plan.gather_cap, plan.cost_model
    steps = list(steps)
    sources = np.zeros(len(steps), np.int64) if sources is None else np.asarray(sources, np.int64)
    if sources.shape != (len(steps),):
        raise ValueError(f"sources must give one id per step ({len(steps)}), got {sources.shape}")
    tiles = on_route(s.options, "tiles")
    steps, sources = fewer_decodes(steps, sources)
    shapes, fallback, own, src = [], [], [], []
    for step, shape, k in zip(steps, prompt_shapes(plan, steps, True), sources):
        if shape is None:
            continue
        tiled = plan_step(step.query_lens, step.context_lens, step.block_table(), step.block_size,
                          sliding_window=s.sliding_window, options=tiles).shape
        shapes.append(shape)
        own.append(model.graph_cost(shape))
        fallback.append(tiled_cost(plan, tiled))
        src.append(k)
    info = {"prompt_steps": int(sum(k >= 0 for k in src)), "prompt_steps_on_prompt_graphs": 0,
            "prompt_graph_candidates": 0}
    if not shapes or not max_graphs:
        return [], info
    sizes = np.array([x.sizes + x.prompts for x in shapes], np.int64)
    envelopes, buckets = decode_levels(plan, sizes[:, :5], model.weights, [k if k >= 0 else -1 - k for k in src])
    rounded = {rounded_shape(shape, s, cap, up) for shape in shapes for up in (pow2, half_pow2)}
    raised = set(rounded)
    for r in rounded:  # each also at every envelope above its decodes and the decode buckets covering them
        load = np.array(r.sizes[1:4])
        above = [*envelopes[(envelopes >= load).all(1)], *buckets[(buckets >= load).all(1)][:DECODE_BUCKET_LEVELS]]
        raised.update(with_decodes(r, level, s) for level in above)
    blocks, fewer = (half_pow2(int(np.quantile(sizes[:, 7], f))) for f in TOP_GRAPH_BLOCKS_QUANTILES)
    causal = TOP_GRAPH_CAUSAL * pow2(int(sizes[:, 4].max()))
    level, lim = envelopes.max(0), _limits(s, cap)  # (every learned plan holds a bucket at `lim`, its largest)
    level[1] = min(int(level[1] * (1 + TOP_GRAPH_UNIQUE_MARGIN)), lim[2])
    most = max(sum(graph_bytes(b, s, plan.model).values()) for b in [*plan.buckets, bucket_from_sizes(lim)])
    top = list(dict.fromkeys(g for g in (warmable(within_bytes(r, most, plan, fewer), plan)
                                         for r in top_graphs(s, level, blocks, causal, fewer)) if _fits(g, s, cap)))
    top = top[:int(TOP_GRAPH_SHARE * max_graphs) if with_top and max_graphs >= TOP_GRAPH_FEWEST else 0]
    candidates = top + sorted({g for g in (warmable(r, plan) for r in raised) if _fits(g, s, cap)} - set(top))
    info["prompt_graph_candidates"] = len(candidates)
    if not candidates:
        return [], info
    src = np.array(src)
    seen = src >= 0  # (`fewer_decodes` numbers its steps' traces below 0)
    src = np.unique(src, return_inverse=True)[1].reshape(-1)
    own = np.array(own)
    weight = np.where(seen, 1.0, FEWER_DECODES_WEIGHT) / np.bincount(src, own)[src]  # a trace's steps weigh 1
    chosen = PromptGraphs(_choose(candidates, sizes, np.array([model.graph_cost(g) for g in candidates]),
                                  np.array(fallback), weight, max_graphs, len(top)), s.block_size, model.graph_cost)
    info["prompt_steps_on_prompt_graphs"] = int(sum(chosen.find(x) is not None for x, k in zip(shapes, seen) if k))
    return chosen.buckets, info


def padding_on_routes(plan, steps) -> dict:
    """Time (the plan's model) of `steps` (TraceSteps) unpadded and padded as a server runs them: a step with
    prompts planned on the prompt route, in its graph where `BucketPlan.route` keeps it there (graph against
    the unpadded prompt call), else on the tiled route in its bucket (against its unpadded prompt call too: the
    route is the plan's choice); every other step in its bucket. Per kind of step: count, unpadded, padded.
    A step beyond the gather cap (its pieces) or no bucket covers is left out and counted in `skipped`."""
    from vllm_gaudi_unified.plan import plan_step

    s, model = plan.settings, plan.cost_model
    tiles = on_route(s.options, "tiles")
    out = {k: [0, 0.0, 0.0] for k in ("decode", "graph", "tiled")}
    skipped = 0
    for step, shape in zip(steps, prompt_shapes(plan, steps, True)):
        plan_with = lambda options: plan_step(step.query_lens, step.context_lens, step.block_table(),  # noqa: E731
                                              step.block_size, sliding_window=s.sliding_window, options=options)
        if shape is None:
            shape, kind, target = plan_with(plan.step_options).shape, "decode", None
        elif plan.route(shape, lambda: plan_with(tiles).shape) == "dense":
            kind, target = "graph", plan.prompt_graph(shape)
        else:
            kind, target = "tiled", None
        if target is None:
            tiled = shape if kind == "decode" else plan_with(tiles).shape
            i = plan.covering(tiled)
            if i < 0:
                skipped += 1
                continue
            target = plan.buckets[i]
        row = out[kind]
        row[0] += 1
        row[1] += model.graph_cost(shape)
        row[2] += model.graph_cost(target)
    unpadded, padded = (sum(r[i] for r in out.values()) for i in (1, 2))
    return {"padding": padded / unpadded if unpadded else 1.0, "unpadded_us": unpadded, "padded_us": padded,
            **{k: {"steps": r[0], "unpadded_us": r[1], "padded_us": r[2]} for k, r in out.items()}, "skipped": skipped}
