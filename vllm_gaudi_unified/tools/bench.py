"""`vllm-gaudi-unified bench`: the benchmark suite of `benchmarks/` (scenarios, baselines, JSON/markdown/PNG).

The suite lives in the repository's `benchmarks/` package; this command finds it
next to the installed package (a source checkout) and runs it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _import_suite():
    try:
        from benchmarks import suite
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "benchmarks" / "suite.py").exists():
            raise SystemExit("bench needs the repository's benchmarks/ folder (run from a source checkout)")
        sys.path.insert(0, str(root))
        from benchmarks import suite
    return suite


def _run(args: argparse.Namespace) -> int:
    suite = _import_suite()
    return suite.main(args=args)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time unified_attention against baselines on CPU or CUDA",
                              description="Plan each scenario, check it against a float32 reference, time it next "
                                          "to SDPA/FlexAttention baselines; writes results.json/.md/.png.")
    _add_suite_args(p)
    p.set_defaults(func=_run)


def _add_suite_args(p: argparse.ArgumentParser) -> None:
    """The suite's own flags (kept in benchmarks/suite.py; imported lazily: it imports torch)."""
    from importlib import util

    root = Path(__file__).resolve().parents[2]
    if util.find_spec("benchmarks") is None and str(root) not in sys.path and (root / "benchmarks").exists():
        sys.path.insert(0, str(root))
    try:
        from benchmarks.options import build_parser
    except ImportError:  # no checkout: the command still lists, and says why when run
        return
    build_parser(p)
