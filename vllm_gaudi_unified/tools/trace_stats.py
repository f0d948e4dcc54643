"""`vllm-gaudi-unified trace-stats TRACE`: the attention work a trace's steps need vs what is computed.

Work is counted in (query token, key) pairs of score work, per path:
*needed* — each token against exactly the keys it may see; *planned* — what the
tiled planner computes (before bucket padding). Other designs add columns of
their own (`python -m benchmarks.trace_work` adds the dense design's).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from typing import Callable

from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.flags import POSITIVE
from vllm_gaudi_unified.plan import PathWork, PlanOptions, StepPlan, plan_step
from vllm_gaudi_unified.tools.plan_flags import add_plan_option_flags, plan_options_from_args

PATHS = ("causal", "shared", "unique")


@dataclass
class TraceWork:
    """Work summed over steps: needed, planned, and one column per `measures` entry (name -> work of a plan)."""

    measures: dict[str, Callable[[StepPlan], PathWork]] = field(default_factory=dict)
    steps: int = 0
    needed: PathWork = field(default_factory=PathWork)
    planned: PathWork = field(default_factory=PathWork)
    measured: dict[str, PathWork] = field(default_factory=dict)
    gathered_steps: int = 0  #: steps whose unique path gathered live blocks instead of reading the slice

    def add(self, plan: StepPlan) -> None:
        self.steps += 1
        self.needed += plan.work_needed
        self.planned += plan.work_planned
        for name, measure in self.measures.items():
            self.measured[name] = self.measured.get(name, PathWork()) + measure(plan)
        self.gathered_steps += plan.unique_layout == "gather"

    def columns(self) -> dict[str, PathWork]:
        return {"planned (tiled)": self.planned, **{n: self.measured.get(n, PathWork()) for n in self.measures}}

    def table(self) -> str:
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"  # noqa: E731
        cols = self.columns()
        lines = ["| path | needed | " + " | ".join(f"{c} | ratio" for c in cols) + " |",
                 "|---|---|" + "---|---|" * len(cols)]
        for path in PATHS + ("all",):
            get = (lambda w: w.total) if path == "all" else (lambda w, p=path: getattr(w, p))
            need = get(self.needed)
            cells = " | ".join(f"{get(w):.3g} | {ratio(get(w), need)}" for w in cols.values())
            lines.append(f"| {path} | {need:.3g} | {cells} |")
        return "\n".join(lines)


def trace_work(steps, options: PlanOptions | None = None, sliding_window: int | None = None,
               progress: bool = False, measures: dict | None = None) -> TraceWork:
    """Sum the work of every step of a trace (an iterable of TraceStep)."""
    from tqdm import tqdm

    total = TraceWork(measures=dict(measures or {}))
    for s in tqdm(steps, desc="planning steps", unit="step", disable=not progress):
        total.add(plan_step(s.query_lens, s.context_lens, s.block_table(), s.block_size,
                            sliding_window=sliding_window, options=options))
    return total


def run(args, measures: dict | None = None) -> int:
    """The command, with extra work columns (`measures`: name -> work of a plan) for other designs."""
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    trace = read_trace(args.trace, limit=args.limit)
    work = trace_work(trace.steps, plan_options_from_args(args), args.sliding_window, progress=not args.no_progress,
                      measures=measures)
    print(f"{args.trace}: {work.steps} steps, block size {trace.block_size}; "
          f"unique path gathered live blocks in {work.gathered_steps} steps")
    print(work.table())
    if args.json:
        with atomic_write(args.json) as f:
            json.dump({"trace": args.trace, "steps": work.steps, "options": asdict(plan_options_from_args(args)),
                       "needed": asdict(work.needed), "planned": asdict(work.planned),
                       **{k: asdict(w) for k, w in work.measured.items()}}, f, indent=1)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="scheduler trace, JSON Lines (.jsonl or .jsonl.gz)")
    add_plan_option_flags(p)
    p.add_argument("--sliding-window", type=POSITIVE, default=None, help="model sliding window (default: none)")
    p.add_argument("--limit", type=POSITIVE, default=None, help="read only the first N steps")
    p.add_argument("--json", type=output_path, default=None, help="also write the numbers to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", dest="no_progress", action="store_true", help=argparse.SUPPRESS)  # the old spelling


def register(subparsers) -> None:
    p = subparsers.add_parser("trace-stats", help="attention work a trace needs vs what the planner computes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
