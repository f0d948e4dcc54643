"""Prompt graphs: the buckets of a plan in which prompts take the prompt route.

A step with prompts runs on the prompt route when a prompt graph covers it and is planned again on
the tiled route otherwise; both give the float64 reference. Plans learn them from traces, save and
load them, warm them, and refuse bad ones by name.
"""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import Step, assert_matches, run_case
from vllm_gaudi_unified import Bucket
from vllm_gaudi_unified.bucket import SIZE_FIELDS
from vllm_gaudi_unified.bucket_plans import BucketPlan, ModelSpec, ServerSettings, TraceStep
from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
from vllm_gaudi_unified.bucket_plans.prompt_graphs import half_pow2, learn_prompt_graphs, rounded_shape
from vllm_gaudi_unified.plan import plan_step
from vllm_gaudi_unified.tools.cli import main
from vllm_gaudi_unified.warmup import warmup

SETTINGS = ServerSettings(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64)
MODEL = ModelSpec(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=64)
CHUNK = Step([12, 1], [20, 9], 4)  # a chunk over 5 context blocks and a decode
LONG = Step([40, 1], [8, 9], 4)  # a longer chunk than any prompt graph holds


def trace_step(step: Step) -> TraceStep:
    bs, ids = step.block_size, iter(range(1, 1000))
    blocks = [[next(ids) for _ in range(-(-(q + c) // bs))] for q, c in zip(step.query_lens, step.context_lens)]
    return TraceStep(bs, np.array(step.query_lens), np.array(step.context_lens), blocks)


@pytest.fixture(scope="module")
def plan():
    tiled = exponential_plan(SETTINGS, MODEL)
    graphs, info = learn_prompt_graphs(tiled, [trace_step(CHUNK)] * 3 + [trace_step(Step([1, 1], [5, 9], 4))], 9)
    assert info["prompt_steps"] == info["prompt_steps_on_prompt_graphs"] == 3 and info["prompt_graph_candidates"] >= 2
    return replace(tiled, prompt_graphs=graphs)


def test_a_learned_graph_is_the_steps_prompt_shape_rounded_up_the_cheaper_way(plan):
    (graph,) = plan.prompt_graphs
    shape = plan_step(CHUNK.query_lens, CHUNK.context_lens, trace_step(CHUNK).block_table(), 4,
                      options=plan.step_options).shape
    coarse = rounded_shape(shape, SETTINGS, plan.gather_cap)
    assert shape.prompts == (1, 12, 5) and coarse.prompts == (1, 16, 8)
    # both roundings are candidates; the finer one (1, 12, 6) covers the same steps for less time
    assert graph == rounded_shape(shape, SETTINGS, plan.gather_cap, half_pow2) and graph.prompts == (1, 12, 6)
    assert graph.phase == shape.phase == "--u" and graph.covers(shape) and coarse.covers(graph)
    assert plan.cost_model.graph_cost(graph) < plan.cost_model.graph_cost(coarse)
    assert plan.step_options.prompt_route == "dense" and plan.settings.options.prompt_route == "tiles"
    assert plan.options_for(graph).prompt_route == "dense" and plan.options_for(plan.buckets[0]).prompt_route == "tiles"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_a_step_a_graph_covers_runs_on_the_prompt_route(plan, dtype):
    out, ref, batch = run_case(CHUNK, dtype=dtype, options=plan.step_options, bucket=plan)
    assert batch.bucket == plan.prompt_graphs[0] and batch.bucket.num_prompts == 1
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_a_step_no_graph_covers_is_planned_again_on_the_tiled_route(plan, dtype):
    out, ref, batch = run_case(LONG, dtype=dtype, options=plan.step_options, bucket=plan)
    assert batch.bucket.num_prompts == 0 and batch.bucket in plan.buckets  # a warmed tiled bucket
    assert batch.bucket.num_causal_tiles > 0  # the chunk's pairs went through the causal tiles
    assert_matches(out, ref)


@pytest.mark.parametrize("buffers", [False, True], ids=["arrays", "step-buffers"])
def test_a_step_whose_only_prompt_graph_costs_more_than_its_tiled_bucket_takes_the_tiled_route(plan, buffers):
    """A short chunk covered only by a large prompt graph (a question over a long document, at the largest
    graph) runs in the cheaper tiled bucket, by the plan's time model weighed as the device runs it; with the small
    graph, the prompt route."""
    from vllm_gaudi_unified.batch import StepBuffers, build_unified_batch
    from conftest import make_block_table, make_tensors
    from vllm_gaudi_unified.reference import reference_attention
    from vllm_gaudi_unified.attention import unified_attention

    (graph,) = plan.prompt_graphs
    big = replace(graph, num_prompts=4, prompt_len=64, prompt_blocks=48)
    for graphs, route in (([big], "tiles"), ([graph, big], "dense")):
        both = replace(plan, prompt_graphs=graphs)
        model = both.cost_model
        table, num_blocks = make_block_table(CHUNK, np.random.default_rng(0))
        q, k, v, kc, vc = make_tensors(CHUNK, table, num_blocks, torch.float64, 0)
        into = StepBuffers("cpu") if buffers else None
        batch = build_unified_batch(CHUNK.query_lens, CHUNK.context_lens, table, 4, num_blocks=num_blocks,
                                    options=both.step_options, bucket=both, buffers=into)
        tiled = both.find(plan_step(CHUNK.query_lens, CHUNK.context_lens, table, 4, options=both.settings.options).shape)
        assert tiled.num_prompts == 0 and model.graph_cost(graph) < model.graph_cost(tiled) < model.graph_cost(big)
        assert batch.bucket == (tiled if route == "tiles" else graph)
        ref = reference_attention(q, k, v, kc, vc, CHUNK.query_lens, CHUNK.context_lens, table, 0.37)
        assert_matches(unified_attention(q, k, v, kc, vc, batch, 0.37), ref)


def test_a_plan_without_prompt_graphs_keeps_every_step_on_the_tiled_route(plan):
    tiled = replace(plan, prompt_graphs=[])
    assert tiled.step_options.prompt_route == "tiles"
    out, ref, batch = run_case(CHUNK, options=replace(tiled.step_options, prompt_route="dense"), bucket=tiled)
    assert batch.bucket.num_prompts == 0 and batch.bucket in tiled.buckets
    assert_matches(out, ref)


def test_prompt_graphs_survive_a_save_and_load_and_old_files_have_none(plan, tmp_path):
    path = str(tmp_path / "plan.json")
    plan.save(path)
    assert BucketPlan.load(path).prompt_graphs == plan.prompt_graphs
    d = json.load(open(path))
    for key in ("prompt_graphs", "prompt_fields"):
        d.pop(key)
    assert BucketPlan.from_dict(d).prompt_graphs == []


@pytest.mark.parametrize("row, message", [
    (lambda g: [g.phase, *g.sizes, 0, 16, 8], "num_prompts > 0"),
    (lambda g: [g.phase, *g.sizes, 1, 16, -1], "prompt_blocks must be an integer"),
    (lambda g: ["-su", g.query_len, 1, *g.sizes[2:], 1, 16, 8], "not whole tiles"),
])
def test_bad_prompt_graph_rows_are_refused_by_name(plan, tmp_path, row, message):
    d = plan.to_dict()
    d["prompt_graphs"] = [row(plan.prompt_graphs[0])]
    with pytest.raises(ValueError, match=message):
        BucketPlan.from_dict(d, "plan.json")


def test_learning_respects_the_count_and_refuses_a_bad_one(plan):
    tiled = replace(plan, prompt_graphs=[])
    assert learn_prompt_graphs(tiled, [trace_step(CHUNK)], 0)[0] == []
    with pytest.raises(ValueError, match="number of prompt graphs"):
        learn_prompt_graphs(tiled, [], -1)


def test_warmup_runs_the_prompt_graphs_too(plan):
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import top_graphs

    alone, _ = learn_prompt_graphs(plan, [trace_step(Step([33], [0], 4))])  # a prompt alone: phase '---'
    top = top_graphs(SETTINGS, (0, 0, 1), 0)  # (its top graphs: up to max_num_seqs prompts, no decodes)
    # (and the short one: 4 prompts of half the 64-token budget between them)
    assert [g.prompts for g in top] == [(1, 64, 0), (3, 42, 0), (4, 8, 0)] and set(top) < set(alone)
    assert {g.phase for g in alone} == {"---"} and [g.prompts for g in alone if g not in top] == [(1, 48, 0)]
    small = replace(plan, buckets=[plan.buckets[0], plan.buckets[-1]], prompt_graphs=plan.prompt_graphs + alone)
    report = warmup(small, device="cpu", mode="eager", dtype=torch.float32, progress=False)
    assert report.buckets == small.buckets + small.prompt_graphs and not report.skipped


def test_generate_learns_prompt_graphs_and_show_lists_them(tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    args = ["buckets", "generate", "--preset", "bs32-seqs64", "--seeds", "1", "--load-fractions", "",
            "--prompt-graphs", "8", "-o", path, "--no-progress"]
    assert main(args) == 0
    plan = BucketPlan.load(path)
    assert 1 <= len(plan.prompt_graphs) <= 8
    assert 0 < plan.info["prompt_steps_on_prompt_graphs"] <= plan.info["prompt_steps"]
    assert f"{len(plan.prompt_graphs)} prompt graphs take" in capsys.readouterr().out
    assert main(["buckets", "show", path]) == 0
    assert f"prompt graphs ({len(plan.prompt_graphs)})" in capsys.readouterr().out
    trace = str(tmp_path / "t.jsonl")
    assert main(["buckets", "simulate", "--preset", "bs32-seqs64", "--seed", "7", "-o", trace, "--no-progress"]) == 0
    assert main(["buckets", "evaluate", path, "--trace", trace, "--json", str(tmp_path / "e.json"),
                 "--no-progress"]) == 0
    (found,) = json.load(open(tmp_path / "e.json"))["prompt_graphs"]
    assert 0 < found["on_prompt_graphs"] <= found["steps_with_prompts"]
    assert f"{found['on_prompt_graphs']} of the {found['steps_with_prompts']} steps with prompts" in \
        capsys.readouterr().out
    assert main(args[:-5] + ["--prompt-graphs", "0", "-o", path, "--no-progress"]) == 0
    assert BucketPlan.load(path).prompt_graphs == []


def test_a_bucket_does_not_count_as_a_prompt_graph():
    with pytest.raises(ValueError, match="num_prompts > 0"):
        from vllm_gaudi_unified.bucket_plans.prompt_graphs import PromptGraphs

        PromptGraphs([Bucket("--u", 4, 0, 4, 4, 0)], 4)


def test_graphs_are_chosen_by_the_time_they_save_and_a_step_takes_the_cheapest_covering_one():
    import numpy as np

    from vllm_gaudi_unified.bucket_plans.prompt_graphs import PromptGraphs, _choose

    small = Bucket("--u", 64, 0, 64, 64, 0, 1, 64, 4)
    large = Bucket("--u", 4096, 0, 64, 64, 0, 1, 4096, 4)
    steps = np.array([small.sizes + small.prompts] * 10 + [large.sizes + large.prompts])
    cost = np.array([1.0, 100.0])
    # the one long prompt saves more time on its graph (1000 -> 100) than ten short ones (10 x (2 -> 1))
    assert _choose([small, large], steps, cost, np.array([2.0] * 10 + [1000.0]), np.ones(11), 1) == [large]
    assert _choose([small, large], steps, cost, np.array([2.0] * 10 + [1000.0]), np.ones(11), 2) == [large, small]
    # a graph that costs more than the tiled route saves nothing: not chosen
    assert _choose([small, large], steps, cost, np.array([0.5] * 10 + [50.0]), np.ones(11), 2) == []
    graphs = PromptGraphs([large, small], 4, {small: 1.0, large: 100.0}.__getitem__)
    assert graphs.buckets == [small, large] and graphs.find(small) == small and graphs.find(large) == large


def test_half_powers_of_two_and_the_cap_on_a_graphs_rows():
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import MAX_GRID_BUDGETS, _fits

    assert [half_pow2(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 24, 25, 611)] == [0, 1, 2, 3, 4, 6, 6, 8, 12, 16, 24,
                                                                                  32, 768]
    plan = exponential_plan(SETTINGS, MODEL)
    rows = MAX_GRID_BUDGETS * SETTINGS.max_num_batched_tokens
    assert _fits(Bucket("--u", 64, 0, 4, 4, 0, 2, rows // 2, 4), SETTINGS, plan.gather_cap)
    assert not _fits(Bucket("--u", 64, 0, 4, 4, 0, 4, rows // 2, 4), SETTINGS, plan.gather_cap)


def test_buffers_reserved_for_the_buckets_and_the_prompt_graphs_allocate_nothing(plan, monkeypatch):
    """What the vLLM metadata builder reserves (`reserve_for(plan.buckets + plan.prompt_graphs)`): steps in
    prompt graphs, and one on the tiled route, plan into the kept memory without growing it."""
    from vllm_gaudi_unified.batch import StepBuffers, build_unified_batch
    from conftest import make_block_table

    graphs, _ = learn_prompt_graphs(plan, [trace_step(CHUNK), trace_step(LONG)])
    both = replace(plan, prompt_graphs=graphs)
    buffers = StepBuffers("cpu", reserve=StepBuffers.reserve_for(both.buckets + both.prompt_graphs,
                                                                 both.step_options, 4))
    grown = []
    monkeypatch.setattr(buffers.host, "_grow", lambda *a: grown.append(a))
    for step, graph in ((CHUNK, True), (LONG, True), (Step([9, 1], [60, 9], 4), False)):
        table, _ = make_block_table(step, np.random.default_rng(0))
        batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=both.step_options,
                                    bucket=both, buffers=buffers)
        assert (batch.bucket in both.prompt_graphs) == graph, batch.bucket
    assert not grown


def test_padding_on_routes_counts_each_step_where_a_server_runs_it(plan):
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import padding_on_routes

    steps = [trace_step(CHUNK), trace_step(Step([1, 1], [5, 9], 4)), trace_step(LONG)]
    r = padding_on_routes(plan, steps)
    assert (r["graph"]["steps"], r["decode"]["steps"], r["tiled"]["steps"], r["skipped"]) == (1, 1, 1, 0)
    model = plan.cost_model
    chunk = plan_step(CHUNK.query_lens, CHUNK.context_lens, steps[0].block_table(), 4, options=plan.step_options).shape
    assert r["graph"]["unpadded_us"] == pytest.approx(model.graph_cost(chunk))
    assert r["graph"]["padded_us"] == pytest.approx(model.graph_cost(plan.prompt_graphs[0]))
    assert r["padding"] == pytest.approx(r["padded_us"] / r["unpadded_us"]) and r["padding"] >= 1.0
    assert all(r[k]["padded_us"] >= r[k]["unpadded_us"] for k in ("decode", "graph"))


def test_the_learner_also_sees_prompt_steps_beside_fewer_decodes():
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import FEWER_DECODES, fewer_decodes

    mixed = trace_step(Step([12] + [1] * 40, [20] + [9] * 40, 4))
    steps, ids = fewer_decodes([mixed, trace_step(CHUNK), trace_step(Step([1, 1], [5, 9], 4))], np.array([0, 0, 1]))
    assert len(steps) == 4 and ids.tolist() == [0, 0, 1, -1]  # only a prompt step with several decodes is copied
    copy = steps[3]
    assert copy.query_lens[0] == 12 and 1 <= (copy.query_lens == 1).sum() < 40  # the prompt kept, decodes thinned
    assert 0 < FEWER_DECODES < 1
    kept = [list(mixed.block_ids).index(b) for b in copy.block_ids]
    assert kept == sorted(kept) and copy.context_lens.tolist() == mixed.context_lens[kept].tolist()


def test_the_time_model_is_the_roofline_times_the_factors_measured_on_the_device(plan):
    from vllm_gaudi_unified.bucket_plans.cost import CONTEXT_FACTOR, GRID_FACTOR, MEASURED_FACTORS
    from vllm_gaudi_unified.plan.prompts import grid_pairs

    model = plan.cost_model
    roofline = np.array([model._unit(d) for d in SIZE_FIELDS])
    assert model.weights == pytest.approx(roofline * MEASURED_FACTORS)
    assert MEASURED_FACTORS[0] > 10 * MEASURED_FACTORS[2]  # a padded query row costs far more than its FLOPs
    (graph,) = plan.prompt_graphs
    p, qp, cb = graph.prompts
    m = model.model
    kv = m.num_layers * p * cb * plan.settings.block_size * 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
    call = (GRID_FACTOR * float(grid_pairs(p, qp, cb, plan.settings.block_size)) * model.pair_cost()
            + CONTEXT_FACTOR * 1e6 * kv / (model.hardware.hbm_tb_s * 1e12))
    assert model.graph_cost(graph) == pytest.approx(model.bucket_cost(graph) + call)


def test_one_graph_covers_a_long_prompt_beside_few_decodes_and_a_short_one_beside_many():
    """Candidates raise a prompt shape's decode part to the decode loads of the plan's decode buckets and of the
    steps (`decode_levels`): one graph then holds the longest prompt beside the most decodes (a sum of the two
    loads), where the steps' own shapes rounded up (a product) need one graph each."""
    from vllm_gaudi_unified.bucket import pow2
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import decode_levels, prompt_shapes, with_decodes

    plan = exponential_plan(SETTINGS, MODEL)
    busy = Step([6, 1, 1, 1], [8, 20, 24, 16], 4)  # a short chunk beside three decodes over long contexts
    steps = [trace_step(CHUNK)] * 2 + [trace_step(busy)] * 2
    shapes = list(prompt_shapes(plan, steps[1:3]))
    assert not any(rounded_shape(a, SETTINGS, plan.gather_cap, up).covers(b) for a, b in (shapes, shapes[::-1])
                   for up in (half_pow2, pow2))
    (graph,), info = learn_prompt_graphs(plan, steps, max_graphs=1)
    assert all(graph.covers(s) for s in shapes) and info["prompt_steps_on_prompt_graphs"] == 4
    envelopes, buckets = decode_levels(plan, np.array([s.sizes for s in shapes]), plan.cost_model.weights)
    assert (envelopes[-1] == np.max([s.sizes[1:4] for s in shapes], 0)).all()  # the busiest decodes' envelope
    decode = {b.sizes[1:4] for b in plan.buckets if not b.num_causal_tiles}
    assert {tuple(x) for x in buckets} < decode  # the plan's decode buckets but the limits
    raised = with_decodes(rounded_shape(shapes[0], SETTINGS, plan.gather_cap, half_pow2), envelopes[-1], SETTINGS)
    assert raised.prompts == (1, 12, 6) and raised.covers(shapes[1]) and graph.covers(raised)
    shared = with_decodes(raised, (1, 0, 0), SETTINGS)  # shared slots in whole tiles
    assert shared.num_shared_blocks == SETTINGS.blocks_per_tile and shared.phase == "-su"


def test_top_graphs_hold_prompts_no_learned_graph_holds_and_take_a_tenth_of_the_count():
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import MAX_GRID_BUDGETS, TOP_GRAPH_PROMPTS, prompt_shapes

    plan = exponential_plan(SETTINGS, MODEL)
    steps = [trace_step(CHUNK)] * 3
    long = next(prompt_shapes(plan, [trace_step(LONG)]))
    few, _ = learn_prompt_graphs(plan, steps, max_graphs=9)
    assert len(few) == 1 and not few[0].covers(long)  # learned from the chunk alone
    graphs, _ = learn_prompt_graphs(plan, steps, max_graphs=10)
    top = [g for g in graphs if g not in few]
    assert len(top) == 1 and len(graphs) == 2 and top[0].covers(long)
    assert top[0].num_prompts == TOP_GRAPH_PROMPTS[0] and top[0].prompt_len == SETTINGS.max_num_batched_tokens
    assert top[0].num_prompts * top[0].prompt_len <= MAX_GRID_BUDGETS * SETTINGS.max_num_batched_tokens
    assert replace(plan, prompt_graphs=graphs).prompt_graph(long) == top[0]


def test_decode_levels_are_each_traces_own_and_top_graphs_hold_a_few_causal_tiles():
    """An envelope over two traces' decode loads takes the shared slots of one and the unique blocks of the other, a
    load neither has: the levels are each trace's own. A top graph also holds causal tiles (the short prompts the
    prompt route leaves to the tiles beside its grid)."""
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import decode_levels, top_graphs

    plan = exponential_plan(SETTINGS, MODEL)
    sizes = np.array([[8, 8, 2, 2, 0], [8, 0, 40, 2, 0]])  # documents read by many; long contexts of their own
    mixed, _ = decode_levels(plan, sizes, plan.cost_model.weights)
    apart, _ = decode_levels(plan, sizes, plan.cost_model.weights, [0, 1])
    assert (8, 40, 2) in {tuple(x) for x in mixed} and {tuple(x) for x in apart} == {(8, 2, 2), (0, 40, 2)}
    top = top_graphs(SETTINGS, (0, 0, 1), 0, causal_tiles=4)
    assert top and all(g.num_causal_tiles == 4 and g.phase[0] == "c" for g in top[:-1])
    assert top[-1].prompts == (4, 8, 0) and top[-1].phase == "---"  # the short one: every prompt in its grid
    assert [g.prompts for g in top] == [g.prompts for g in top_graphs(SETTINGS, (0, 0, 1), 0)]


def test_a_top_graph_keeps_within_a_working_set_context_first_and_the_first_pass_has_none():
    """`within_bytes` lowers a top graph's context (to its floor), then its prompt length, until its warmup working set
    fits; the first pass of `buckets generate` learns without top graphs (`with_top=False`)."""
    from vllm_gaudi_unified.bucket_plans.memory import graph_bytes
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import half_pow2, top_graphs, within_bytes

    plan = exponential_plan(SETTINGS, MODEL)
    size = lambda g: sum(graph_bytes(g, SETTINGS, MODEL).values())  # noqa: E731
    (top, *_) = top_graphs(SETTINGS, (0, 0, 1), 12)
    assert within_bytes(top, size(top), plan, 3) == top
    fewer = replace(top, prompt_blocks=6)
    assert within_bytes(top, size(fewer), plan, 6) == fewer  # the context first (12 -> 8 -> 6) ...
    shorter = within_bytes(top, size(fewer) - 1, plan, 6)  # ... then, at its floor, the prompt length
    assert shorter.prompt_blocks == 6 and shorter.prompt_len < top.prompt_len and size(shorter) < size(fewer)
    assert shorter.prompt_len == half_pow2(shorter.prompt_len)
    steps = [trace_step(CHUNK)] * 3
    with_top, _ = learn_prompt_graphs(plan, steps, max_graphs=10)
    without, _ = learn_prompt_graphs(plan, steps, max_graphs=10, with_top=False)
    assert len(with_top) == 2 and without == [g for g in with_top if g.num_prompts == 1 and g.prompt_len < 64]
