"""The `buckets` commands round-trip: simulate -> generate -> show -> evaluate -> plot."""
import json

import pytest

from vllm_gaudi_unified.bucket_plans import BucketPlan
from vllm_gaudi_unified.tools.cli import main

SMALL = ["--block-size", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--max-model-len", "1024",
         "--num-blocks", "400"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("t") / "sim.jsonl.gz")
    assert main(["buckets", "simulate", *SMALL, "--workload", "mixed", "--num-requests", "30", "--seed", "3",
                 "-o", path, "--no-progress"]) == 0
    return path


def test_round_trip(tmp_path, trace, capsys):
    plan_path = str(tmp_path / "plan.json")
    assert main(["buckets", "generate", *SMALL, "--trace", trace, "--max-graphs", "8", "--jobs", "1",
                 "--miss-policy", "largest", "-o", plan_path, "--no-progress"]) == 0
    plan = BucketPlan.load(plan_path)
    assert len(plan) <= 8 and plan.miss_policy == "largest" and plan.settings.block_size == 16
    assert plan.covers_limits()
    capsys.readouterr()
    assert main(["buckets", "show", plan_path]) == 0
    shown = capsys.readouterr().out
    assert f"robust: {len(plan)} buckets" in shown and str(plan.buckets[0].query_len) in shown
    assert main(["buckets", "show", plan_path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["buckets"] == plan.to_dict()["buckets"]
    out_json = str(tmp_path / "eval.json")
    assert main(["buckets", "evaluate", plan_path, "--trace", trace, "--json", out_json, "--jobs", "1",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "uncovered steps: 0" in text and "padding, time model" in text and "padding, score pairs" in text
    result = json.load(open(out_json))["results"][0]
    assert result["uncovered"] == 0 and result["padding_time"] >= 1.0 and result["worst_pairs"] >= 1.0
    assert result["padding_time"] == pytest.approx(plan.info["expected_padding_waste"], rel=1e-3)
    assert result["padding_pairs"] == pytest.approx(plan.info["expected_padding_pairs"], rel=1e-3)
    routes = json.load(open(out_json))["prompt_graphs"][0]["routes"]  # what `generate` prints: the routes taken
    assert plan.prompt_graphs and routes["padding"] == pytest.approx(plan.info["expected_padding_on_routes"], rel=1e-3)
    png = tmp_path / "plan.png"
    assert main(["buckets", "plot", plan_path, "--trace", trace, "-o", str(png), "--jobs", "1"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_records_the_command_that_makes_it_again(tmp_path, trace):
    import shlex

    first = str(tmp_path / "a.json")
    assert main(["buckets", "generate", *SMALL, "--trace", trace, "--max-graphs", "5", "--margin", "0.3",
                 "--resolution", "4", "--skeleton-ratio", "64", "--jobs", "1", "-o", first, "--no-progress"]) == 0
    command = BucketPlan.load(first).info["command"]
    # no --preset given: the base is the trace's header (repeated by --trace), so none is recorded
    assert command.startswith("vllm-gaudi-unified buckets generate --strategy robust --block-size 16")
    assert "--margin 0.3" in command and "--resolution 4.0" in command and "--jobs" not in command
    again = shlex.split(command)[1:]
    again[again.index("--output") + 1] = str(tmp_path / "b.json")
    assert main(again + ["--no-progress"]) == 0
    assert BucketPlan.load(str(tmp_path / "b.json")).buckets == BucketPlan.load(first).buckets


def test_curve_plot(tmp_path):
    from vllm_gaudi_unified.tools.plot import plot_curves

    path = tmp_path / "c.png"
    plot_curves({"trace: t": [(4, 2.5), (32, 1.3)], "exponential: t": [(300, 3.0), (3000, 1.4)]}, str(path), "t",
                styles={"trace: t": {"color": "blue", "marker": "o"}}, hlines={"goal": 1.15})
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_exponential_generate(tmp_path):
    plan_path = str(tmp_path / "exp.json")
    assert main(["buckets", "generate", "--strategy", "exponential", *SMALL, "--exp-base", "4", "-o", plan_path]) == 0
    plan = BucketPlan.load(plan_path)
    assert plan.strategy == "exponential" and plan.covers_limits()


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # the parser's own errors
        return exc.code


def test_clear_errors(tmp_path, trace, capsys):
    out = str(tmp_path / "p.json")
    assert _exit_code(["buckets", "generate", "--block-size", "0", "--strategy", "exponential", "-o", out]) == 2
    assert "argument --block-size: 0 is outside [1, " in capsys.readouterr().err
    assert main(["buckets", "generate", "--max-num-seqs", "512", "--max-num-batched-tokens", "256",
                 "--strategy", "exponential", "-o", out]) == 2
    assert "max_num_batched_tokens (256) is below max_num_seqs (512)" in capsys.readouterr().err
    assert _exit_code(["buckets", "simulate", "--num-blocks", "0", "-o", out, "--no-progress"]) == 2
    assert "argument --num-blocks: 0 is outside [1, " in capsys.readouterr().err
    assert main(["buckets", "simulate", "--num-blocks", "1", "-o", out, "--no-progress"]) == 2
    assert "num_blocks (1) must leave at least one block besides the null block" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["buckets", "generate", *SMALL, "--trace", str(empty), "-o", out, "--no-progress"]) == 2
    assert f"{empty}: the trace holds no scheduler step" in capsys.readouterr().err
    assert main(["buckets", "evaluate", out, "--trace", str(empty), "--no-progress"]) == 2  # no plan at `out`
    assert "no such bucket plan" in capsys.readouterr().err
    assert _exit_code(["buckets", "generate", *SMALL, "--trace", trace, "--max-graphs", "0", "-o", out,
                       "--no-progress", "--jobs", "1"]) == 2
    assert "argument --max-graphs: 0 is outside [1, 4096]" in capsys.readouterr().err
    assert main(["buckets", "generate", "--preset", "llama8b-gaudi3", "--trace", trace, "-o", out,
                 "--no-progress"]) == 2  # the preset's block size 128 != the trace's 16
    assert "differs" in capsys.readouterr().err
    assert main(["buckets", "show", str(tmp_path / "missing.json")]) == 2
    assert "no such bucket plan" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["buckets", "--help"], ["buckets", "generate", "--help"],
                                  ["buckets", "evaluate", "--help"], ["buckets", "plot", "--help"],
                                  ["buckets", "show", "--help"], ["buckets", "simulate", "--help"],
                                  ["warmup", "--help"]])
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_commands_with_progress_bars_on(tmp_path, trace, capsys):
    """What a user runs: the default, progress bars on (they go to stderr)."""
    out = str(tmp_path / "sim.jsonl.gz")
    assert main(["buckets", "simulate", *SMALL, "--workload", "mixed", "--num-requests", "10", "--seed", "4",
                 "-o", out]) == 0
    assert "simulating" in capsys.readouterr().err
    plan = str(tmp_path / "plan.json")
    assert main(["buckets", "generate", *SMALL, "--strategy", "trace", "--max-graphs", "8", "--trace", trace,
                 "--trace", out, "-o", plan]) == 0
    assert main(["buckets", "evaluate", plan, "--trace", out]) == 0


def test_invariant_capped_and_upstream(tmp_path, trace, capsys):
    inv = str(tmp_path / "inv.json")
    assert main(["buckets", "generate", *SMALL, "--trace", trace, "--batch-invariant", "--invariant-chunk", "16",
                 "--max-graphs", "8", "--jobs", "1", "-o", inv, "--no-progress"]) == 0
    plan = BucketPlan.load(inv)
    assert plan.settings.options.batch_invariant and plan.settings.options.invariant_chunk == 16
    assert (plan.sizes[:, 1] % 16 == 0).all() and "--batch-invariant" in plan.info["command"]
    capped = str(tmp_path / "cap.json")
    assert main(["buckets", "generate", *SMALL, "--trace", trace, "--memory-share", "0.000042",
                 "--device-memory-gb", "100", "--max-graphs", "8", "--jobs", "1", "-o", capped, "--no-progress"]) == 0
    plan = BucketPlan.load(capped)
    cap = plan.gather_cap
    assert cap.max_unique_blocks == int(0.000042 * 100e9 // (2 * 16 * 8 * 128 * 2))
    assert (plan.sizes[:, 1] <= cap.max_shared_blocks).all() and (plan.sizes[:, 2] <= cap.max_unique_blocks).all()
    capsys.readouterr()
    out_json = str(tmp_path / "e.json")
    assert main(["buckets", "evaluate", capped, "--trace", trace, "--upstream", "--json", out_json, "--jobs", "1",
                 "--no-progress"]) == 0
    assert "upstream plan on" in capsys.readouterr().out
    result = json.load(open(out_json))
    assert result["results"][0]["calls"] > result["results"][0]["steps"] and result["results"][0]["uncovered"] == 0
    assert result["upstream"][0]["graphs"] > 0


def test_generate_takes_the_settings_from_the_trace_header(tmp_path, trace):
    """`generate --trace` ignored the trace's header (`trace block_size 16 differs from the settings'
    block_size 128`, 13 flags to retype). The header's settings (the simulator's `scheduler`, the plugin's
    top-level keys) are the base; flags override them; --preset replaces them."""
    plan_path = str(tmp_path / "plan.json")
    assert main(["buckets", "generate", "--trace", trace, "--max-graphs", "8", "--jobs", "1", "-o", plan_path,
                 "--no-progress"]) == 0
    s = BucketPlan.load(plan_path).settings
    assert (s.block_size, s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.num_blocks) == \
        (16, 8, 128, 1024, 400)
    assert main(["buckets", "generate", "--trace", trace, "--max-num-seqs", "4", "--max-graphs", "8", "--jobs", "1",
                 "-o", plan_path, "--no-progress"]) == 0
    assert BucketPlan.load(plan_path).settings.max_num_seqs == 4
    assert main(["buckets", "generate", "--preset", "llama8b-gaudi3", "--trace", trace, "--jobs", "1",
                 "-o", plan_path, "--no-progress"]) == 2  # the preset's block size 128 against the trace's 16

    from vllm_gaudi_unified.bucket_plans.trace import TraceWriter, iter_trace

    steps = [x for x in iter_trace(trace) if not isinstance(x, dict)]
    recorded = str(tmp_path / "recorded.jsonl")  # the plugin's header: settings at the top level
    with TraceWriter(recorded, header={"source": "vllm-gaudi-unified vLLM plugin", "block_size": 16,
                                       "max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 1024,
                                       "num_blocks": 512, "sliding_window": None}) as w:
        for step in steps:
            w.write(step)
    assert main(["buckets", "generate", "--trace", recorded, "--max-graphs", "8", "--jobs", "1", "-o", plan_path,
                 "--no-progress"]) == 0
    s = BucketPlan.load(plan_path).settings
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.num_blocks) == (16, 256, 512)


def test_generate_shows_progress_while_it_simulates():
    """11-14 s of trace simulation with nothing on the screen."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-m", "vllm_gaudi_unified", "buckets", "generate", *SMALL, "--seeds", "1",
                            "--max-graphs", "8", "--jobs", "1", "-o", os.path.join(d, "plan.json")],
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0, r.stderr
    assert "simulating chat seed 1" in r.stderr and "step" in r.stderr


@pytest.mark.parametrize("strategy", ["robust", "trace"])
def test_generated_plans_hold_only_buckets_warmup_can_run(tmp_path, trace, strategy):
    """A fresh plan held `csu:q21:s16:u2:l1:c1`, which no step of its phase fits (such steps need two
    requests); the generators lift every bucket to its phase's smallest step (`lift_to_smallest`)."""
    from vllm_gaudi_unified.plan.smallest import can_hold_a_step

    plan_path = str(tmp_path / "plan.json")
    assert main(["buckets", "generate", "--strategy", strategy, "--trace", trace, "--max-graphs", "8",
                 "--jobs", "1", "-o", plan_path, "--no-progress"]) == 0
    plan = BucketPlan.load(plan_path)
    s = plan.settings
    assert all(can_hold_a_step(b, s.block_size, s.options, s.sliding_window) for b in plan.buckets)


def test_lift_to_smallest_makes_the_reported_bucket_warmable():
    import numpy as np

    from vllm_gaudi_unified.bucket import Bucket, bucket_from_sizes
    from vllm_gaudi_unified.bucket_plans.settings import BUCKET_OPTIONS
    from vllm_gaudi_unified.plan.smallest import can_hold_a_step, lift_to_smallest

    bad = Bucket("csu", 21, 16, 2, 1, 1)  # the bucket that was made (block size 32: 16 blocks a shared tile)
    ok = Bucket("---", 4, 0, 0, 4, 0)
    assert not can_hold_a_step(bad, 32, BUCKET_OPTIONS)
    rows = lift_to_smallest(np.array([bad.sizes, ok.sizes, ok.sizes]), 32, BUCKET_OPTIONS)
    lifted = sorted((bucket_from_sizes(r.tolist()) for r in rows), key=str)
    assert len(lifted) == 2 and ok in lifted  # duplicates merged, a warmable bucket unchanged
    (up,) = [b for b in lifted if b.phase == "csu"]
    assert can_hold_a_step(up, 32, BUCKET_OPTIONS) and up.num_logits == 2 and up.query_len == 21


def test_evaluate_a_window_of_steps(tmp_path, trace, capsys):
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    plan_path, whole, part = (str(tmp_path / n) for n in ("plan.json", "whole.json", "part.json"))
    assert main(["buckets", "generate", *SMALL, "--trace", trace, "--max-graphs", "8", "--jobs", "1",
                 "-o", plan_path, "--no-progress"]) == 0
    n = len(read_trace(trace).steps)
    for window, out in ((f"0:{n + 5}", whole), ("2:6", part)):
        assert main(["buckets", "evaluate", plan_path, "--trace", trace, "--steps", window, "--json", out,
                     "--no-progress"]) == 0
    assert main(["buckets", "evaluate", plan_path, "--trace", trace, "--json", str(tmp_path / "all.json"),
                 "--no-progress", "--jobs", "1"]) == 0
    results = [json.load(open(p))["results"][0] for p in (whole, part, str(tmp_path / "all.json"))]
    assert results[0]["steps"] == results[2]["steps"] == n and results[1]["steps"] == 4
    assert results[0]["padding_time"] == pytest.approx(results[2]["padding_time"])
    capsys.readouterr()
    assert _exit_code(["buckets", "evaluate", plan_path, "--trace", trace, "--steps", "6:2"]) == 2
    assert "argument --steps: '6:2' needs 0 <= START < STOP" in capsys.readouterr().err
    assert main(["buckets", "evaluate", plan_path, "--trace", trace, "--steps", "0:2", "--upstream"]) == 2
    assert "--steps and --upstream" in capsys.readouterr().err
