"""Warmup runs every bucket with the bucket's exact shapes; padded results equal unpadded ones."""
import json
from dataclasses import replace

import pytest
import torch

from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.bucket_plans import ServerSettings
from vllm_gaudi_unified.bucket import PHASES
from vllm_gaudi_unified.tools.shapes import shapes_of_steps
from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
from vllm_gaudi_unified.bucket_plans.workloads import workload_from
from vllm_gaudi_unified.tools.strategies import trace_plan
from vllm_gaudi_unified.tools.cli import main
from vllm_gaudi_unified.warmup import batch_for_bucket, resolve_mode, warmup

SETTINGS = ServerSettings(block_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512,
                          num_blocks=256)
SCHED = SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512,
                        num_blocks=256)
WORK = workload_from("mixed", num_requests=24, prompt_median=80, prompt_max=300, output_median=12, output_max=40,
                     prefix_lens=(32, 48))


@pytest.fixture(scope="module")
def steps():
    return list(Simulator(SCHED, WORK, 2).steps())


@pytest.fixture(scope="module")
def plan(steps):
    return trace_plan(shapes_of_steps(steps, SETTINGS), SETTINGS, max_graphs=5)


@pytest.mark.parametrize("route", ["tiles", "dense"])
@pytest.mark.parametrize("code", range(8))
def test_step_for_bucket_has_the_phase(code, route):
    """Every phase, with the plan's options or the prompt route's: a bucket of the five sizes is warmed on
    the tiled route it describes."""
    phase = PHASES[code]
    kb = SETTINGS.blocks_per_tile
    bucket = Bucket(phase, 8, kb if phase[1] == "s" else 0, 4 if phase[2] == "u" else 0, 4, 2 if phase[0] == "c" else 0)
    batch = batch_for_bucket(bucket, 16, replace(SETTINGS.options, prompt_route=route))
    assert batch.bucket == bucket and batch.shape.phase == phase


def test_bucket_too_small_for_its_phase():
    with pytest.raises(ValueError, match="cannot hold"):
        batch_for_bucket(Bucket("c--", 1, 0, 0, 1, 1), 16, SETTINGS.options)


def test_padded_to_plan_buckets_equals_unpadded(plan, steps):
    """Every simulated step, padded to the bucket the plan finds, gives the unpadded result (float64)."""
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 8
    kc = torch.randn(SETTINGS.num_blocks, 16, hkv, d, dtype=torch.float64)
    vc = torch.randn_like(kc)
    for step in steps[::12]:
        t = int(step.query_lens.sum())
        q, k, v = torch.randn(t, hq, d, dtype=torch.float64), torch.randn(t, hkv, d, dtype=torch.float64), \
            torch.randn(t, hkv, d, dtype=torch.float64)
        table = step.block_table()
        plain = build_unified_batch(step.query_lens, step.context_lens, table, 16, options=SETTINGS.options)
        padded = build_unified_batch(step.query_lens, step.context_lens, table, 16, options=SETTINGS.options,
                                     bucket=plan)
        assert padded.bucket in plan.buckets and padded.bucket.covers(plain.shape)
        torch.testing.assert_close(unified_attention(q, k, v, kc, vc, padded, 0.3),
                                   unified_attention(q, k, v, kc, vc, plain, 0.3), rtol=1e-9, atol=1e-9)


def test_warmup_runs_every_bucket_with_its_shapes(plan):
    """Every bucket runs once, cheapest first, and its time is the time its run took."""
    import time

    seen = []

    def run(bucket, batch):
        assert batch.bucket == bucket
        seen.append(bucket)
        time.sleep(0.002)
        return torch.zeros(1)

    report = warmup(plan, run=run, progress=False)
    assert seen == plan.buckets == report.buckets and len(report.seconds) == len(plan)
    assert min(report.seconds) >= 0.002  # each bucket's time includes its run
    assert report.total_seconds >= sum(report.seconds)  # the total spans them all


def test_warmup_default_attention(plan):
    report = warmup(plan, num_qo_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, progress=False)
    assert report.mode == "eager" and len(report.buckets) == len(plan)
    assert "warmed" in report.table()


def test_modes():
    assert resolve_mode("auto", "cpu") == "eager" and resolve_mode("auto", "hpu") == "hpu_graphs"
    with pytest.raises(ValueError, match="needs an HPU"):
        resolve_mode("hpu_graphs", "cpu")
    with pytest.raises(ValueError, match="warmup mode"):
        resolve_mode("fast", "cpu")


def test_warmup_command(plan, tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    plan.save(path)
    out = str(tmp_path / "w.json")
    assert main(["warmup", path, "--num-qo-heads", "2", "--num-kv-heads", "1", "--head-dim", "8", "--dtype",
                 "float32", "--limit", "3", "--json", out, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "warmed 3 buckets" in text
    assert len(json.load(open(out))["buckets"]) == 3


def test_warmup_compile_mode_one_bucket(plan):
    pytest.importorskip("torch._inductor")
    try:
        report = warmup(plan, mode="compile", buckets=plan.buckets[:1], num_qo_heads=2, num_kv_heads=1, head_dim=8,
                        dtype=torch.float32, progress=False)
    except Exception as exc:  # no C++ compiler on the machine
        if "compiler" in str(exc).lower() or "InductorError" in type(exc).__name__:
            pytest.skip(f"torch.compile unavailable here: {exc}")
        raise
    assert report.mode == "compile" and len(report.seconds) == 1


def test_warmup_reports_each_bucket_as_it_goes(plan, caplog):
    """One line per bucket while it runs, with the time left, through the logger it is given (the
    plugin passes vLLM's, so the lines are in vLLM's log), and no summary of its own (the caller's)."""
    import logging

    log = logging.getLogger("vllm.gaudi_unified.steps")
    with caplog.at_level(logging.INFO, logger="vllm.gaudi_unified.steps"):
        report = warmup(plan, run=lambda b, batch: torch.zeros(1), log=log)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.gaudi_unified.steps"]
    assert len(lines) == len(plan) == len(report.buckets)
    for i, (line, bucket) in enumerate(zip(lines, plan.buckets)):
        assert line.startswith(f"warmup {i + 1}/{len(plan)}: bucket {bucket} in ") and "left)" in line
    assert lines[-1].endswith("about 0 s left)") and not any("warmed" in r.getMessage() for r in caplog.records)


def test_an_interrupted_warmup_keeps_the_buckets_done(plan):
    calls = []

    def run(bucket, batch):
        calls.append(bucket)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return torch.zeros(1)

    with pytest.raises(KeyboardInterrupt) as exc:
        warmup(plan, run=run, progress=False)
    assert exc.value.warmup_report.buckets == plan.buckets[:2] and len(exc.value.warmup_report.seconds) == 2


def test_warmup_command_interrupted_keeps_table_and_json(plan, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the third bucket: the table and the JSON of the two buckets done, then the one line, 130."""
    from vllm_gaudi_unified import warmup as module

    real, calls = module._attention_fn, []

    def interrupting(mode):
        fn = real(mode)

        def attend(*args):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return fn(*args)
        return attend

    monkeypatch.setattr(module, "_attention_fn", interrupting)
    path, out = str(tmp_path / "plan.json"), tmp_path / "w.json"
    plan.save(path)
    assert main(["warmup", path, "--num-qo-heads", "2", "--num-kv-heads", "1", "--head-dim", "8", "--dtype",
                 "float32", "--json", str(out), "--no-progress"]) == 130
    captured = capsys.readouterr()
    assert "warmed 2 buckets" in captured.out and f"interrupted: {len(plan) - 2} of {len(plan)}" in captured.out
    assert captured.err.strip().splitlines()[-1] == "vllm-gaudi-unified: interrupted"
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and [b["bucket"] for b in data["buckets"]] == [str(b) for b in plan.buckets[:2]]


def test_warmup_command_prints_warmed_once_and_a_line_per_bucket(plan, tmp_path):
    """"warmed N buckets" was printed twice, and nothing per bucket until the end."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = str(tmp_path / "plan.json")
    plan.save(path)
    r = subprocess.run([sys.executable, "-m", "vllm_gaudi_unified", "warmup", path, "--num-qo-heads", "2",
                        "--num-kv-heads", "1", "--head-dim", "8", "--dtype", "float32", "--limit", "3"],
                       capture_output=True, text=True, env={**os.environ,
                                                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0, r.stderr
    assert (r.stdout + r.stderr).count("warmed 3 buckets") == 1
    progress = [x for x in r.stderr.splitlines() if "warmup " in x and "left)" in x]
    assert [x.split("warmup ")[1].split(":")[0] for x in progress] == ["1/3", "2/3", "3/3"]
