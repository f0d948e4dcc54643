"""A step with prompts in two parts (`step_parts.py`): the grid's requests in a grid graph, the rest in a
bucket, each its own call; the same result as the step whole."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import Step, assert_matches, make_block_table, make_tensors
from vllm_gaudi_unified.attention import unified_attention
from vllm_gaudi_unified.batch import build_unified_batch
from vllm_gaudi_unified.bucket_plans import ModelSpec, ServerSettings, TraceStep
from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan
from vllm_gaudi_unified import copies, step_parts
from vllm_gaudi_unified.reference import reference_attention
from vllm_gaudi_unified.step_parts import (StepParts, build_step_parts, grid_requests, is_grid_graph,
                                           learn_grid_graphs, parts_attention)

SETTINGS = ServerSettings(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, num_blocks=96)
MODEL = ModelSpec(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=64)
#: two chunks over their contexts between decodes, two decodes over one shared document
MIXED = Step([1, 12, 1, 9, 1], [9, 20, 17, 6, 17], 4, prefix_groups=[([2, 4], 4)])


def trace_step(step: Step, table: np.ndarray) -> TraceStep:
    bs = step.block_size
    blocks = [list(map(int, row[: -(-(q + c) // bs)])) for row, q, c in zip(table, step.query_lens, step.context_lens)]
    return TraceStep(bs, np.array(step.query_lens), np.array(step.context_lens), blocks)


@pytest.fixture(autouse=True)
def free_calls(monkeypatch):
    """The tiny model's steps cost a fraction of a µs: a second call at the 8B setting's price would never pay."""
    monkeypatch.setattr(step_parts, "PART_CALL_US", 0.0)


@pytest.fixture(scope="module")
def case():
    table, num_blocks = make_block_table(MIXED, np.random.default_rng(0))
    tiled = exponential_plan(SETTINGS, MODEL)
    graphs, info = learn_grid_graphs(tiled, [trace_step(MIXED, table)] * 2, 4)
    assert graphs and all(is_grid_graph(g) for g in graphs) and info["prompt_steps_on_prompt_graphs"] == 2
    return replace(tiled, prompt_graphs=graphs, info={**tiled.info, "parts": True}), table, num_blocks


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_a_step_in_parts_equals_the_step_whole(case, dtype):
    plan, table, num_blocks = case
    ql, cl = MIXED.query_lens, MIXED.context_lens
    q, k, v, kc, vc = make_tensors(MIXED, table, num_blocks, dtype, 0)
    assert grid_requests(ql, cl, table, 4, SETTINGS.options).tolist() == [False, True, False, True, False]
    parts = build_step_parts(ql, cl, table, plan, num_blocks=num_blocks)
    assert isinstance(parts, StepParts) and len(parts.batches) == 2
    graph, bucket = parts.buckets
    assert graph in plan.prompt_graphs and is_grid_graph(graph) and bucket in plan.buckets
    assert sorted(torch.cat(parts.rows).tolist()) == list(range(sum(ql)))  # every row in exactly one part
    out = parts_attention(q, k, v, kc, vc, parts, 0.37)
    whole = unified_attention(q, k, v, kc, vc, build_unified_batch(ql, cl, table, 4, num_blocks=num_blocks), 0.37)
    ref = reference_attention(q, k, v, kc, vc, ql, cl, table, 0.37)
    assert_matches(out, ref)
    tol = 1e-6 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(out.double(), whole.double(), atol=tol, rtol=tol)


def test_a_step_without_a_grid_graph_or_prompts_or_saving_runs_whole(case, monkeypatch):
    plan, table, num_blocks = case
    ql, cl = MIXED.query_lens, MIXED.context_lens
    assert build_step_parts(ql, cl, table, plan) is not None
    monkeypatch.setattr(step_parts, "PART_CALL_US", 1.0)  # the parts cost more than the step's tiled bucket
    assert build_step_parts(ql, cl, table, plan) is None
    monkeypatch.setattr(step_parts, "PART_CALL_US", 0.0)
    assert build_step_parts([1, 1], [9, 17], table[:2], plan) is None  # decodes alone
    assert build_step_parts([1, 12], [9, 20], table[:2], replace(plan, prompt_graphs=[])) is None


def test_bad_input_to_a_step_in_parts_is_refused_by_name(case):
    plan, table, num_blocks = case
    ql, cl = MIXED.query_lens, MIXED.context_lens
    with pytest.raises(ValueError, match="needs a BucketPlan"):
        build_step_parts(ql, cl, table, plan.buckets[0])
    with pytest.raises(ValueError, match="must agree"):
        build_step_parts(ql, cl[:-1], table, plan)
    parts = build_step_parts(ql, cl, table, plan, num_blocks=num_blocks)
    q, k, v, kc, vc = make_tensors(MIXED, table, num_blocks, torch.float64, 0)
    with pytest.raises(ValueError, match="the step's 24 tokens"):
        parts_attention(q[:-1], k, v, kc, vc, parts, 0.37)
    with pytest.raises(ValueError, match="must be StepParts"):
        parts_attention(q, k, v, kc, vc, parts.batches[0], 0.37)


def test_warmup_runs_a_parts_plans_buckets_and_grid_graphs(case):
    from vllm_gaudi_unified.bucket_plans.memory import warmup_memory
    from vllm_gaudi_unified.step_parts import in_parts
    from vllm_gaudi_unified.warmup import warmup

    plan, _, _ = case
    small = replace(plan, buckets=[plan.buckets[0], plan.buckets[-1]])
    assert in_parts(small) and not in_parts(replace(small, prompt_graphs=[]))
    assert not in_parts(replace(small, info={}))  # grid graphs alone, not made in parts: the plan runs steps whole
    report = warmup(small, device="cpu", mode="eager", dtype=torch.float32, progress=False)
    assert report.buckets == small.buckets + small.prompt_graphs and not report.skipped
    assert warmup_memory(small).describe()  # both parts' graphs in the plan's memory model


def test_generate_parts_learns_grid_graphs_and_evaluate_runs_steps_in_parts(tmp_path, capsys):
    import json

    from vllm_gaudi_unified.bucket_plans import BucketPlan
    from vllm_gaudi_unified.step_parts import in_parts
    from vllm_gaudi_unified.tools.cli import main

    path = str(tmp_path / "plan.json")
    assert main(["buckets", "generate", "--preset", "bs32-seqs64", "--seeds", "1", "--load-fractions", "",
                 "--prompt-graphs", "8", "--parts", "-o", path, "--no-progress"]) == 0
    plan = BucketPlan.load(path)
    assert in_parts(plan) and 1 <= len(plan.prompt_graphs) <= 8 and "--parts" in plan.info["command"]
    trace = str(tmp_path / "t.jsonl")
    assert main(["buckets", "simulate", "--preset", "bs32-seqs64", "--seed", "7", "-o", trace, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["buckets", "evaluate", path, "--trace", trace, "--json", str(tmp_path / "e.json"),
                 "--no-progress"]) == 0
    (found,) = json.load(open(tmp_path / "e.json"))["prompt_graphs"]
    routes = found["routes"]
    assert routes["parts"]["steps"] > 0 and found["on_prompt_graphs"] == routes["parts"]["steps"]
    assert routes["padding"] >= 1.0 and f"parts steps {routes['parts']['steps']}" in capsys.readouterr().out


def test_steps_split_once_pad_and_leave_the_same_rests_as_split_again(case):
    """`grid_splits`, found once for `rest_steps` and `padding_in_parts`, gives what each finds itself."""
    from vllm_gaudi_unified.step_parts import grid_splits, padding_in_parts, rest_steps

    plan, table, _ = case
    decode = Step([1, 1, 1], [9, 20, 17], 4)
    steps = [trace_step(MIXED, table), trace_step(decode, make_block_table(decode, np.random.default_rng(1))[0])]
    splits = grid_splits(plan, steps)
    assert [k.any() for k, _ in splits] == [True, False] and splits[1][1] is None
    assert padding_in_parts(plan, steps, splits) == padding_in_parts(plan, steps)
    assert padding_in_parts(plan, steps)["parts"]["steps"] == 1 and padding_in_parts(plan, steps)["decode"]["steps"] == 1
    assert [s.query_lens.tolist() for s in rest_steps(plan, steps, splits)] == [
        s.query_lens.tolist() for s in rest_steps(plan, steps)] == [[1, 1, 1], [1, 1, 1]]


def test_the_plugin_refuses_a_plan_of_grid_graphs_by_name(case, tmp_path):
    from test_auto_plan import _server

    from vllm_gaudi_unified.plan import PlanOptions
    from vllm_gaudi_unified.vllm_plugin.steps import _load_bucket_plan

    plan, _, _ = case
    path = str(tmp_path / "parts.json")
    plan.save(path)
    config, kv = _server()
    with pytest.raises(ValueError, match=r"VLLM_GAUDI_UNIFIED_BUCKETS=.*parts.json: a plan of grid graphs"):
        _load_bucket_plan(path, config, kv, PlanOptions(), None)


@pytest.mark.parametrize("name", ["seed", "prefill", "chunked_prefill", "prefix_caching", "ragged_partial"])
def test_the_grid_part_is_the_planners_own_grid(name):
    """`grid_requests` (the planner's selection without the rest of its plan) names the requests whose rows the
    prompt route's grid holds."""
    from conftest import SPECS

    from vllm_gaudi_unified.plan import plan_step
    from vllm_gaudi_unified.plan.options import on_route

    step = SPECS[name]
    table, _ = make_block_table(step, np.random.default_rng(0))
    plan = plan_step(step.query_lens, step.context_lens, table, step.block_size,
                     options=on_route(SETTINGS.options, "dense"))
    starts = np.concatenate([[0], np.cumsum(step.query_lens)])
    held = np.zeros(len(step.query_lens), bool)
    if plan.shape.num_prompts:
        held[np.searchsorted(starts, plan.prompt_rows[plan.prompt_len > 0, 0], side="right") - 1] = True
    assert held.any() == (name != "prefix_caching")  # (its 6-token request reads a prefix others read: tiles)
    got = grid_requests(step.query_lens, step.context_lens, table, step.block_size, SETTINGS.options)
    assert got.tolist() == held.tolist()


@pytest.mark.parametrize("requests", [[0, 1, 2, 3, 4], [1, 3], [0, 1, 3, 4]], ids=["mixed", "grid", "two"])
def test_a_step_in_parts_is_copied_once_and_equals_its_parts_made_one_by_one(case, requests):
    from vllm_gaudi_unified.batch import UnifiedBatch, _array_fields
    from vllm_gaudi_unified.plan import pad_plan, plan_step
    from vllm_gaudi_unified.plan.arrays import ranges

    plan, table, num_blocks = case
    query_lens, context_lens = (np.asarray(x)[requests] for x in (MIXED.query_lens, MIXED.context_lens))
    table = table[requests]
    parts = build_step_parts(query_lens, context_lens, table, plan, num_blocks=num_blocks)
    assert isinstance(parts, StepParts)
    q = np.asarray(query_lens)
    keep = grid_requests(q, context_lens, table, 4, SETTINGS.options)
    plans = step_parts.part_plans(plan, q, context_lens, table, keep, num_blocks)
    graphs = step_parts.plan_parts(plan, *(None if p is None else p.shape for p in plans), lambda: plan_step(
        q, context_lens, table, 4, options=SETTINGS.options).shape)
    expected = [UnifiedBatch.from_plan(pad_plan(p, g)) for p, g in zip(plans, graphs) if p is not None]
    starts = np.cumsum(q) - q
    rows = [ranges(starts[part], q[part])[0] for part in (keep, ~keep)[:len(expected)]]
    assert len(parts.batches) == len(expected) == len(parts.rows) == 2 - bool(keep.all())
    assert all(np.array_equal(a, b) and a.dtype == np.int64 for a, b in zip(parts.host_rows, rows))
    with pytest.MonkeyPatch.context() as m:  # the one packed copy a device gets, here into the CPU
        m.setattr(copies, "on_cpu", lambda device: False)
        copied = UnifiedBatch.from_plans([b.plan for b in expected], "cpu", rows)
    tensors = []
    for batches, part_rows in ((parts.batches, parts.rows), copied):
        for got, want in zip(part_rows, rows):
            assert got.dtype == torch.int64 and torch.equal(got, torch.as_tensor(want))
        for got, want in zip(batches, expected):
            assert got.bucket == want.bucket and got.plan.shape == want.plan.shape
            for name in _array_fields(UnifiedBatch):
                a, b = getattr(got, name), getattr(want, name)
                assert (a is None) == (b is None), name
                if a is not None:
                    assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b), name
                    tensors.append(a)
    tensors = tensors[len(tensors) // 2:] + list(copied[1])
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one buffer, one copy
    assert all(t.storage_offset() % copies.ALIGN == 0 for t in tensors)


def test_the_causal_tiles_counted_are_the_tiled_plans_and_decide_as_it_does(case, monkeypatch):
    from vllm_gaudi_unified.plan import plan_step
    from vllm_gaudi_unified.plan.options import PlanOptions, on_route
    from vllm_gaudi_unified.plan.rules import causal_tile_count

    rng = np.random.default_rng(3)
    for tile in (4, 16, 128):
        opts = on_route(PlanOptions(causal_tile=tile), "tiles")
        for _ in range(20):
            q = rng.choice([1, 1, 2, 3, 7, 20, 40], size=int(rng.integers(1, 9)))
            step = Step(list(map(int, q)), [int(x) for x in rng.integers(0, 30, q.size)], 4)
            table, _ = make_block_table(step, rng)
            want = plan_step(step.query_lens, step.context_lens, table, 4, options=opts).shape.num_causal_tiles
            assert causal_tile_count(np.asarray(step.query_lens), tile) == want
    plan, table, num_blocks = case
    ql, cl = np.asarray(MIXED.query_lens), MIXED.context_lens
    keep = grid_requests(ql, cl, table, 4, SETTINGS.options)
    shapes = step_parts.part_shapes(plan, ql, cl, table, keep)
    tiles = on_route(SETTINGS.options, "tiles")
    tiled = lambda: plan_step(ql, cl, table, 4, options=tiles).shape  # noqa: E731
    for call_us in (0.0, 1.0, 1e9):  # parts, whole, whole (the bound never decides against the tiled plan)
        monkeypatch.setattr(step_parts, "PART_CALL_US", call_us)
        assert step_parts.plan_parts(plan, *shapes, tiled) == step_parts.plan_parts(
            plan, *shapes, tiled, lambda: causal_tile_count(ql, tiles.causal_tile))
