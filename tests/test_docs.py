"""The docs against the repository: docs/benchmarks.md is what benchmarks/results/ give, every results file it
cites exists, and every command docs/ and README.md show exists and answers `--help`."""
from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
RESULTS = ROOT / "benchmarks" / "results"


def _code(text: str) -> list[str]:
    """The text of every fenced block and inline code span: where the docs show commands."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return fenced + re.findall(r"`([^`]+)`", rest)


def _shown(pattern: str) -> list[str]:
    """Every match of `pattern` in the docs' code, in order of first appearance, once."""
    found = [m.group(1).split() for doc in DOCS for code in _code(doc.read_text()) for m in re.finditer(pattern, code)]
    return list(dict.fromkeys(" ".join(words) for words in found))


BENCHMARKS = _shown(r"python3?\s+-m\s+benchmarks\.([a-z_][a-z0-9_]*)\b")
#: `vllm-gaudi-unified` and the subcommand words after it (up to a flag, a placeholder, a path or a comment).
COMMANDS = _shown(r"vllm-gaudi-unified((?:[ \t]*\\?\n?[ \t]*[a-z][a-z0-9-]*(?![\w./]))*)")


def test_the_docs_show_commands():
    assert {"speed", "report", "planning", "mla_decode", "serving"} <= set(BENCHMARKS)
    assert {"serve", "buckets generate", "warmup"} <= set(COMMANDS)


@pytest.mark.filterwarnings("ignore:'benchmarks.:RuntimeWarning")  # runpy: the module was imported before
@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_the_docs_show_answers_help(name, monkeypatch):
    assert (ROOT / "benchmarks" / f"{name}.py").is_file(), f"docs show python -m benchmarks.{name}: no such module"
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{name}", "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__")
    assert done.value.code in (0, None) and "usage" in out.getvalue(), f"benchmarks.{name} --help"


@pytest.mark.parametrize("words", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("vllm") else c
                                   for c in COMMANDS])
def test_every_command_the_docs_show_answers_help(words):
    done = subprocess.run([sys.executable, "-m", "vllm_gaudi_unified", *words.split(), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"vllm-gaudi-unified {words} --help: {done.stderr[-2000:]}"
    assert "usage" in done.stdout.lower()


def test_the_pages_with_tables_are_what_the_results_give():
    from benchmarks.report import PAGES, render

    for page in PAGES:
        text = page.read_text()
        assert render(text) == text, f"{page.name} differs from benchmarks/results/: run python -m benchmarks.report"


def test_every_results_file_the_docs_cite_exists_and_has_its_provenance():
    cited = {m for doc in DOCS for m in re.findall(r"benchmarks/results/([\w./+-]*\w)", doc.read_text())}
    assert cited, "docs/benchmarks.md cites its results files"
    assert not sorted(c for c in cited if not (RESULTS / c).exists())
    from benchmarks.report import recorded_commit

    provenance = json.loads((RESULTS / "provenance.json").read_text())
    stored = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file()} - {"provenance.json"}
    unrecorded = {n for n in stored if not recorded_commit(json.loads((RESULTS / n).read_text()))}
    assert unrecorded <= set(provenance) <= stored, "a results file without its commit has it in provenance.json"
    assert all(re.fullmatch(r"[0-9a-f]{7,40}", e["commit"]) for e in provenance.values())
