"""Attention work of a trace: needed, planned (tiled) and the dense design's, per path.

    python -m benchmarks.trace_work TRACE [--limit N] [--json OUT] [planner flags]

`vllm-gaudi-unified trace-stats` with one more column, the dense design this
project started from (`benchmarks/dense.py`).
"""
from __future__ import annotations

import argparse
import sys

from benchmarks.dense import dense_work
from vllm_gaudi_unified.tools import trace_stats
from vllm_gaudi_unified.tools.cli import Parser


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.trace_work", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_stats.add_arguments(p)
    return trace_stats.run(p.parse_args(argv), measures={"dense": dense_work})


if __name__ == "__main__":
    sys.exit(main())
