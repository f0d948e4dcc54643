"""The `buckets` commands round-trip: simulate -> generate -> show -> evaluate -> plot."""
import json

import pytest

from vllm_gaudi_unified.bucketing import BucketPlan
from vllm_gaudi_unified.cli import main

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
    assert main(["buckets", "generate", *SMALL, "--trace", trace, "--max-graphs", "6", "--jobs", "1",
                 "--miss-policy", "largest", "-o", plan_path, "--no-progress"]) == 0
    plan = BucketPlan.load(plan_path)
    assert len(plan) <= 6 and plan.miss_policy == "largest" and plan.settings.block_size == 16
    assert plan.covers_limits()
    capsys.readouterr()
    assert main(["buckets", "show", plan_path]) == 0
    shown = capsys.readouterr().out
    assert f"trace: {len(plan)} buckets" in shown and str(plan.buckets[0].query_len) in shown
    assert main(["buckets", "show", plan_path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["buckets"] == plan.to_dict()["buckets"]
    out_json = str(tmp_path / "eval.json")
    assert main(["buckets", "evaluate", plan_path, "--trace", trace, "--json", out_json, "--jobs", "1",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "covered: 100.00 %" in text and "padding waste" in text
    result = json.load(open(out_json))["results"][0]
    assert result["covered"] == 1.0 and result["padding_waste"] >= 1.0
    assert result["padding_waste"] == pytest.approx(plan.info["expected_padding_waste"], rel=1e-3)
    png = tmp_path / "plan.png"
    assert main(["buckets", "plot", plan_path, "--trace", trace, "-o", str(png), "--jobs", "1"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exponential_generate(tmp_path):
    plan_path = str(tmp_path / "exp.json")
    assert main(["buckets", "generate", "--strategy", "exponential", *SMALL, "--exp-base", "4", "-o", plan_path]) == 0
    plan = BucketPlan.load(plan_path)
    assert plan.strategy == "exponential" and plan.covers_limits()


def test_clear_errors(tmp_path, trace, capsys):
    out = str(tmp_path / "p.json")
    assert main(["buckets", "generate", "--block-size", "0", "--strategy", "exponential", "-o", out]) == 2
    assert "block_size must be a positive integer" in capsys.readouterr().err
    assert main(["buckets", "generate", "--max-num-seqs", "512", "--max-num-batched-tokens", "256",
                 "--strategy", "exponential", "-o", out]) == 2
    assert "below max_num_seqs" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["buckets", "generate", *SMALL, "--trace", str(empty), "-o", out, "--no-progress"]) == 2
    assert "no scheduler step" in capsys.readouterr().err
    assert main(["buckets", "generate", "--trace", trace, "-o", out, "--no-progress"]) == 2  # block size 128 != 16
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
