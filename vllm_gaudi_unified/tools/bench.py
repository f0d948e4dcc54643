"""`vllm-gaudi-unified bench`: the benchmark suite of the repository's `benchmarks/` (scenarios, baselines,
JSON/markdown/PNG); the same as `python -m benchmarks.suite`.

The suite is not part of the installed package: the command runs it when `benchmarks`
is importable, that is from the root of a source checkout (`python -m vllm_gaudi_unified
bench`, or with the checkout on PYTHONPATH), and says so otherwise.
"""
from __future__ import annotations

import argparse
from importlib import util

NOT_FOUND = ("bench needs the repository's benchmarks/ package: run it from the root of a source checkout "
             "(python -m vllm_gaudi_unified bench, or python -m benchmarks.suite)")


def _run(args: argparse.Namespace) -> int:
    if util.find_spec("benchmarks") is None:
        raise SystemExit(NOT_FOUND)
    from benchmarks import suite

    return suite.main(args=args)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time unified_attention against baselines on CPU or CUDA",
                              description="Plan each scenario, check it against a float32 reference, time it next "
                                          "to SDPA/FlexAttention baselines; writes results.json/.md/.png.")
    if util.find_spec("benchmarks") is not None:  # the suite's own flags (torch-free module)
        from benchmarks.options import build_parser

        build_parser(p)
    p.set_defaults(func=_run)
