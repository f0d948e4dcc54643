"""A step with prompts as two parts, each in a graph of its own: the prompt route's grid, and the rest.

A prompt graph (`bucket_plans/prompt_graphs.py`) holds a step's prompt call *and* the decodes beside it,
so a plan needs a graph per prompt shape and decode load: the product of the two. Traffic varies them
apart (the same prompts beside 20 decodes at a quiet hour, beside 256 over long documents at a busy one),
and a product learned from some traffic pads other traffic in both. Cut by requests instead:

* the **grid part**: the requests the prompt route's grid takes (`plan/prompts.py: fill_grid`), planned
  alone on the prompt route, a step of prompts alone (one fused call): padded to a *grid graph*, a prompt
  graph with no decode part (`grid_graph`);
* the **rest**: every other request (decodes, verify steps, the short prompts the grid leaves to the
  tiles), planned alone on the tiled route: padded to one of the plan's buckets, like a decode step.

A request's attention reads only its own new keys and its own cached blocks, so the two parts share no
(query, key) pair and no row: each part's rows come out final, written where they belong, with no merge
(exact: `tests/test_step_parts.py`, float64 against the unsplit step). The graphs a plan warms are then its
buckets plus its grid graphs: per path, the sum of the sizes, not their product. The price is one graph call
more per step with prompts and decodes (`PART_CALL_US` in the time model), and the shared tiles of a
document read by a prompt and by decodes at once are not shared across the parts (the grid reads its
context itself on the prompt route either way).

`plan_parts` decides (the plan's time model, `CostModel.graph_cost`): a step runs in parts when its grid
part has a grid graph and the two parts cost no more than the whole step's tiled bucket; `build_step_parts`
plans and pads the parts, `parts_attention` runs them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.plan import plan_checked, plan_step
from vllm_gaudi_unified.plan.arrays import cached_pairs, ranges, validate
from vllm_gaudi_unified.plan.prompts import fill_grid, prompt_requests
from vllm_gaudi_unified.plan.options import on_route
from vllm_gaudi_unified.plan.rules import causal_tile_count

#: Time-model price (estimated µs) of the second graph call of a step in parts: a graph launch and the
#: copies of the part's rows (q/k/v in, output out). The device's per-call cost is tens of µs beside steps
#: of 1-30 ms.
PART_CALL_US = 30.0


@dataclass(frozen=True)
class StepParts:
    """A step planned in parts: per part its batch (padded to its graph) and its token rows of the step,
    `[t_i]` int64 on the batch's device, in order; every row of the `num_tokens` in exactly one part;
    `host_rows` the same rows on the host (int64 numpy), for what the host reads of them (no device sync)."""

    batches: tuple
    rows: tuple
    num_tokens: int
    host_rows: tuple

    @property
    def buckets(self) -> tuple:
        """The graph of each part: a grid graph, then a bucket of the plan."""
        return tuple(b.bucket for b in self.batches)


def grid_requests(query_lens, context_lens, block_table, block_size: int, options, sliding_window=None) -> np.ndarray:
    """Bool `[R]`: the requests of the step whose new tokens the prompt route's grid takes (none when the
    step has no prompt for it): the planner's own choice (`plan/default.py`: `prompt_requests`, `fill_grid`),
    without the rest of its plan."""
    checked = validate(query_lens, context_lens, block_table, block_size, sliding_window, None)
    return _grid_of(checked, block_size, options, sliding_window)


def _grid_of(checked, block_size: int, options, sliding_window) -> np.ndarray:
    """`grid_requests` of a step's checked arrays (`arrays.validate`)."""
    q, ctx, bt, nb_ctx = checked
    if int(q.max()) < 2 or sliding_window is not None or options.batch_invariant:  # (no prompt route)
        return np.zeros(q.size, bool)
    pair_req, _, phys, _, max_block_id = cached_pairs(ctx, nb_ctx, bt, block_size, None, None)
    return fill_grid(prompt_requests(q, ctx, pair_req, phys, max_block_id, options.unique_tokens), q, nb_ctx,
                     block_size)


def part_plans(plan, query_lens, context_lens, block_table, keep: np.ndarray, num_blocks: int | None = None,
               checked=None):
    """(grid part's StepPlan on the prompt route, the rest's on the tiled route or None) of a step split at
    `keep` (`grid_requests`), each planned as `plan_step` plans the part's own arrays (`plan_checked`).
    `checked`: the step's arrays as `arrays.validate` returns them, when already checked."""
    s = plan.settings
    if checked is None:
        checked = validate(query_lens, context_lens, block_table, s.block_size, s.sliding_window, num_blocks)
    part = functools.partial(plan_checked, checked, s.block_size, sliding_window=s.sliding_window,
                             num_blocks=num_blocks)
    return part(rows=keep, options=plan.step_options), None if keep.all() else part(
        rows=~keep, options=on_route(s.options, "tiles"))


def part_shapes(plan, query_lens, context_lens, block_table, keep: np.ndarray):
    """The shapes of `part_plans`: (grid part's, the rest's or None)."""
    return tuple(None if p is None else p.shape for p in part_plans(plan, query_lens, context_lens, block_table, keep))


def plan_parts(plan, grid: Bucket, rest: Bucket | None, tiled_shape, causal_tiles=None) -> tuple | None:
    """The graphs of a step in parts, `(grid graph, the rest's bucket or None)`, or None: the step runs whole
    (`BucketPlan.route`). Parts when a grid graph of `plan` covers the grid part (`grid`), a bucket covers the
    rest, and the two, with `PART_CALL_US` for the second call, cost no more in the plan's time model than the
    bucket the step's tiled plan (`tiled_shape()`) pads to; that plan is made only when the cheapest bucket with
    the step's query tokens and logits (as `BucketPlan.route` does), and with `causal_tiles()` causal tiles too
    (the tiled plan's, `rules.causal_tile_count`, or fewer; asked for after the first), costs less than the parts."""
    graph = plan.prompt_graph(grid)
    if graph is None or not is_grid_graph(graph):
        return None
    bucket, cost = None, plan.graph_cost(graph)
    if rest is not None:
        i = plan.covering(rest)
        if i < 0:
            return None
        bucket, cost = plan.buckets[i], cost + float(plan.costs[i]) + PART_CALL_US
    tokens = grid.query_len + (0 if rest is None else rest.query_len)
    logits = grid.num_logits + (0 if rest is None else rest.num_logits)
    if cost <= plan.tiled_floor(tokens, logits) or (causal_tiles is not None and cost <= plan.tiled_floor(
            tokens, logits, causal_tiles())):
        return graph, bucket
    tiled = tiled_shape()
    i = plan.covering(tiled)
    return (graph, bucket) if i < 0 or cost <= float(plan.costs[i]) else None


def is_grid_graph(graph: Bucket) -> bool:
    """A prompt graph with no decode part: no shared or unique slots, no causal tiles."""
    return graph.num_prompts > 0 and not (graph.num_shared_blocks or graph.num_unique_blocks or graph.num_causal_tiles)


def build_step_parts(query_lens, context_lens, block_table, plan, *, num_blocks: int | None = None,
                     device=None) -> StepParts | None:
    """The step in parts as `plan` (a `BucketPlan` with grid graphs) decides (`plan_parts`), each part planned
    and padded to its graph and put on `device`; None: the step runs whole (`build_unified_batch(...,
    options=plan.step_options, bucket=plan)`)."""
    from vllm_gaudi_unified.batch import UnifiedBatch, check_device
    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
    from vllm_gaudi_unified.plan import pad_plan

    if not isinstance(plan, BucketPlan):
        raise ValueError(f"a step in parts needs a BucketPlan, got {type(plan).__name__}")
    s = plan.settings
    q = np.asarray(query_lens, np.int64)
    table = np.asarray(block_table)
    if q.ndim != 1 or np.shape(context_lens) != q.shape or table.ndim != 2 or table.shape[0] != q.size:
        raise ValueError(f"query_lens [R], context_lens [R] and block_table [R, M] must agree, got {q.shape}, "
                         f"{np.shape(context_lens)}, {table.shape}")
    if not plan.prompt_graphs or plan.settings.sliding_window is not None or (q.size and q.min() == q.max() == 1):
        return None  # (decodes alone run whole: their planning checks them)
    checked = validate(q, context_lens, table, s.block_size, None, num_blocks)  # once for the step and its parts
    keep = _grid_of(checked, s.block_size, s.options, None)
    if not keep.any():
        return None
    plans = part_plans(plan, q, context_lens, table, keep, num_blocks, checked)
    tiles = on_route(s.options, "tiles")
    graphs = plan_parts(plan, *(None if p is None else p.shape for p in plans), lambda: plan_checked(
        checked, s.block_size, options=tiles).shape, lambda: causal_tile_count(q, tiles.causal_tile))
    if graphs is None:
        return None
    starts = np.cumsum(q) - q
    padded = [pad_plan(p, graph) for p, graph in zip(plans, graphs) if p is not None]
    host = tuple(ranges(starts[part], q[part])[0] for part in (keep, ~keep)[:len(padded)])  # the parts' rows
    batches, rows = UnifiedBatch.from_plans(padded, check_device(device or "cpu"), host)  # (one copy)
    return StepParts(batches, rows, int(q.sum()), host)


def parts_attention(query, key, value, key_cache, value_cache, parts: StepParts, scale: float, attention=None,
                    **kwargs) -> torch.Tensor:
    """`unified_attention` of a step in parts (`build_step_parts`): each part's rows of q/k/v through its own
    graph (`attention`: a function like `unified_attention`, default it; `graphs.compiled_attention` compiles
    one per part's graph), its output written at its rows. No merge: the parts share no row and no key.
    Returns `[num_tokens, Hq, Dv]` in query's dtype."""
    from vllm_gaudi_unified.attention import unified_attention

    if not isinstance(parts, StepParts):
        raise ValueError(f"parts must be StepParts (build_step_parts), got {type(parts).__name__}")
    if query.shape[0] != parts.num_tokens or key.shape[0] != parts.num_tokens or value.shape[0] != parts.num_tokens:
        raise ValueError(f"query, key and value must hold the step's {parts.num_tokens} tokens, got "
                         f"{query.shape[0]}, {key.shape[0]}, {value.shape[0]}")
    run = unified_attention if attention is None else attention
    out = query.new_empty((parts.num_tokens, query.shape[1], value.shape[-1]))
    for batch, rows in zip(parts.batches, parts.rows):
        rows = rows.to(query.device)
        part = run(*(x.index_select(0, rows) for x in (query, key, value)), key_cache, value_cache, batch, scale,
                   **kwargs)
        out.index_copy_(0, rows, part[:rows.numel()])
    return out


def grid_parts(plan, steps, sources=None) -> tuple[list, list]:
    """The grid part of each step of `steps` (TraceSteps) that has one, as a TraceStep, and its source id
    (`sources`, one per step; default 0): what a plan's grid graphs learn from (`learn_grid_graphs`)."""
    from vllm_gaudi_unified.bucket_plans.trace import TraceStep

    s, out, ids = plan.settings, [], []
    for step, k in zip(steps, [0] * len(steps) if sources is None else sources):
        keep = grid_requests(step.query_lens, step.context_lens, step.block_table(), step.block_size, s.options,
                             s.sliding_window)
        if keep.any():
            out.append(TraceStep(step.block_size, step.query_lens[keep], step.context_lens[keep],
                                 [b for b, x in zip(step.block_ids, keep) if x]))
            ids.append(k)
    return out, ids


def learn_grid_graphs(plan, steps, max_graphs: int, sources=None, with_top: bool = True) -> tuple[list[Bucket], dict]:
    """The `max_graphs` grid graphs that save the grid parts of `steps` the most time
    (`prompt_graphs.learn_prompt_graphs` on `grid_parts`: a part of prompts alone has no decode part to raise,
    so every graph learned is a grid graph), and how many parts they cover. Each holds a logit per prompt (a
    grid part has at most one a prompt; the top graphs, made for bursts, would take the decode level's, 13 at
    the 8B setting, and miss a burst of 14 prompts)."""
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import learn_prompt_graphs

    steps = list(steps)
    parts, ids = grid_parts(plan, steps, sources)
    graphs, info = learn_prompt_graphs(plan, parts, max_graphs, sources=ids if sources is not None else None,
                                       with_top=with_top)
    return list(dict.fromkeys(replace(g, num_logits=max(g.num_logits, g.num_prompts)) for g in graphs
                              if is_grid_graph(g))), info


def in_parts(plan) -> bool:
    """Whether `plan` runs steps with prompts in parts: made so (`buckets generate --parts`: `info["parts"]`), its
    prompt graphs grid graphs (`learn_grid_graphs`), which hold no decode part. (A plan whose learned prompt graphs
    all happen to be of prompts alone runs its steps whole.)"""
    return bool(plan.info.get("parts")) and bool(plan.prompt_graphs) and all(is_grid_graph(g) for g in plan.prompt_graphs)


def grid_splits(plan, steps) -> list:
    """Per step of `steps` (TraceSteps): `(grid requests, the parts' shapes)` at `plan`'s settings (`grid_requests`,
    `part_shapes`; None for a step with no grid): found once for `rest_steps` and `padding_in_parts` (their
    `splits`), which see the same steps."""
    s, out = plan.settings, []
    for step in steps:
        q, c, table = step.query_lens, step.context_lens, step.block_table()
        keep = grid_requests(q, c, table, s.block_size, s.options, s.sliding_window)
        out.append((keep, part_shapes(plan, q, c, table, keep) if keep.any() else None))
    return out


def rest_steps(plan, steps, splits=None) -> list:
    """`steps` (TraceSteps) as the buckets of a plan with `plan`'s grid graphs see them (its buckets still to be
    learned): a step whose grid part a grid graph covers as its rest (none where the grid is all), every other
    step as it is. `splits`: the steps' `grid_splits`, when already found."""
    from vllm_gaudi_unified.bucket_plans.trace import TraceStep

    out = []
    for step, (keep, shapes) in zip(steps, grid_splits(plan, steps) if splits is None else splits):
        graph = None if shapes is None else plan.prompt_graph(shapes[0])
        if graph is None or not is_grid_graph(graph):
            out.append(step)
        elif not keep.all():
            out.append(TraceStep(step.block_size, step.query_lens[~keep], step.context_lens[~keep],
                                 [b for b, x in zip(step.block_ids, ~keep) if x]))
    return out


def padding_in_parts(plan, steps, splits=None) -> dict:
    """Time (the plan's model) of `steps` (TraceSteps) unpadded and padded as a server with a plan of grid graphs
    runs them (`build_step_parts`): a step with prompts in parts where `plan_parts` says so (its grid graph and
    its rest's bucket, `PART_CALL_US` for the second call; against the unpadded prompt route), else whole on
    the tiled route in its bucket (against its unpadded prompt route too); every other step in its bucket. Per
    kind (`decode`, `parts`, `tiled`): count, unpadded, padded; a step no bucket covers is counted in `skipped`.
    The measure of `prompt_graphs.padding_on_routes` for plans that run steps in parts. `splits`: the steps'
    `grid_splits`, when already found. Each step is planned once per route."""
    s, model = plan.settings, plan.cost_model
    tiles = on_route(s.options, "tiles")
    out, skipped = {k: [0, 0.0, 0.0] for k in ("decode", "parts", "tiled")}, 0
    for step, (keep, shapes) in zip(steps, grid_splits(plan, steps) if splits is None else splits):
        q, c, table = step.query_lens, step.context_lens, step.block_table()
        tiled = []  # the step's tiled shape, planned at most once

        def tiled_shape():
            if not tiled:
                tiled.append(plan_step(q, c, table, s.block_size, sliding_window=s.sliding_window, options=tiles).shape)
            return tiled[0]
        graphs = None if shapes is None else plan_parts(plan, *shapes, tiled_shape,
                                                        lambda: causal_tile_count(q, tiles.causal_tile))
        unpadded = model.graph_cost(tiled_shape() if shapes is None else plan_step(
            q, c, table, s.block_size, sliding_window=s.sliding_window, options=plan.step_options).shape)
        if graphs is not None:
            kind, padded = "parts", model.graph_cost(graphs[0]) + (
                0.0 if graphs[1] is None else model.bucket_cost(graphs[1]) + PART_CALL_US)
        else:
            i = plan.covering(tiled_shape())
            if i < 0:
                skipped += 1
                continue
            kind, padded = "tiled" if shapes is not None else "decode", float(plan.costs[i])
        row = out[kind]
        row[0], row[1], row[2] = row[0] + 1, row[1] + unpadded, row[2] + padded
    unpadded, padded = (sum(r[i] for r in out.values()) for i in (1, 2))
    return {"padding": padded / unpadded if unpadded else 1.0, "unpadded_us": unpadded, "padded_us": padded,
            **{k: {"steps": r[0], "unpadded_us": r[1], "padded_us": r[2]} for k, r in out.items()}, "skipped": skipped}
