"""The benchmark suite end to end on CPU, tiny: every scenario checked, files written, CLI wired."""
import json

import pytest

pytest.importorskip("matplotlib")

from vllm_gaudi_unified.cli import build_parser  # noqa: E402

SMALL = ["--device", "cpu", "--scale", "0.01", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
         "--dtype", "float32", "--tol", "1e-4", "--baselines", "sdpa_loop,padded_sdpa,flex"]


def test_bench_cli_runs_checks_and_writes(tmp_path):
    args = build_parser().parse_args(["bench", *SMALL, "--out", str(tmp_path),
                                      "--scenarios", "decode_256x2k,mixed,shared_prefix,scattered"])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    ours = [r for r in data["rows"] if r["method"] == "unified"]
    assert len(ours) == 4 * 2  # 4 scenarios x block sizes 16 and 128, eager on CPU
    assert all(r["ok"] and r["ms"] > 0 and r["rel_err"] < 1e-4 for r in ours)
    layouts = {r["scenario"]: r["unique_layout"] for r in ours}
    assert layouts["decode_256x2k"] == "slice" and layouts["scattered"] == "gather"  # the planner says which
    base = {(r["scenario"], r["method"]): r for r in data["rows"] if r["method"] in ("sdpa_loop", "padded_sdpa")}
    assert all(r["ok"] for r in base.values()) and len(base) == 8
    md = (tmp_path / "results.md").read_text()
    assert "SDPA loop / ours" in md and "decode 256 x 2k" in md
    assert (tmp_path / "results.png").stat().st_size > 1000


def test_scenario_floors_match_the_issue():
    from benchmarks.options import HBM_BYTES_PER_S
    from benchmarks.scenarios import floors, layout, scenarios

    by_name = {s.name: s for s in scenarios()}
    f = floors(by_name["decode_256x2k"], 16, 32, 8, 128)
    assert abs(f["kv_bytes"] / HBM_BYTES_PER_S * 1e3 - 0.64) < 0.01  # issue 7: the HBM floor is 0.64 ms
    lay = layout(by_name["scattered"], 16)
    live = sum(len(b) for b in lay.owned)
    assert lay.block_table.max() + 1 > 4 * live  # ids spread over a cache about 6x the live blocks
    shared = layout(by_name["shared_prefix"], 16)
    assert (shared.block_table[:, :256] == shared.block_table[0, :256]).all()  # 4k common tokens, one copy
