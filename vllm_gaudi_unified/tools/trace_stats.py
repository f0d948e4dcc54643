"""`vllm-gaudi-unified trace-stats TRACE`: the attention work a trace's steps need vs what is computed.

Work is counted in (query token, key) pairs of score work, per path:
*needed* — each token against exactly the keys it may see; *planned* — what the
tiled planner computes (before bucket padding); *dense* — what the dense design
computes (512-row causal slices over the flattened batch, every token against
every shared block, the unique slice `[0, max id]`).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field

from vllm_gaudi_unified.plan import PathWork, PlanOptions, plan_step

PATHS = ("causal", "shared", "unique")


@dataclass
class TraceWork:
    steps: int = 0
    needed: PathWork = field(default_factory=PathWork)
    planned: PathWork = field(default_factory=PathWork)
    dense: PathWork = field(default_factory=PathWork)
    gathered_steps: int = 0  #: steps whose unique path gathered live blocks instead of reading the slice

    def add(self, plan) -> None:
        self.steps += 1
        self.needed += plan.work_needed
        self.planned += plan.work_planned
        self.dense += plan.work_dense
        self.gathered_steps += plan.unique_layout == "gather"

    def rows(self) -> list[tuple[str, int, int, int]]:
        """(path, needed, planned, dense) for each path and 'all'."""
        out = [(p, getattr(self.needed, p), getattr(self.planned, p), getattr(self.dense, p)) for p in PATHS]
        return out + [("all", self.needed.total, self.planned.total, self.dense.total)]

    def table(self) -> str:
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"
        lines = ["| path | needed | planned (tiled) | ratio | dense design | ratio |", "|---|---|---|---|---|---|"]
        for path, need, plan, dense in self.rows():
            lines.append(f"| {path} | {need:.3g} | {plan:.3g} | {ratio(plan, need)} | {dense:.3g} | {ratio(dense, need)} |")
        return "\n".join(lines)


def trace_work(steps, options: PlanOptions | None = None, sliding_window: int | None = None,
               progress: bool = False) -> TraceWork:
    """Sum the work of every step of a trace (an iterable of TraceStep)."""
    from tqdm import tqdm

    total = TraceWork()
    for s in tqdm(steps, desc="planning steps", unit="step", disable=not progress):
        total.add(plan_step(s.query_lens, s.context_lens, s.block_table(), s.block_size,
                            sliding_window=sliding_window, options=options, dense_work=True))
    return total


def options_from_args(args) -> PlanOptions:
    return PlanOptions(causal_tile=args.causal_tile, shared_rows=args.shared_rows,
                       shared_tile_keys=args.shared_tile_keys, unique_layout=args.unique_layout)


def add_plan_option_flags(parser: argparse.ArgumentParser) -> None:
    """The planner's tile options as flags, defaults from PlanOptions."""
    d = PlanOptions()
    parser.add_argument("--causal-tile", type=int, default=d.causal_tile, help="rows = keys of a causal tile")
    parser.add_argument("--shared-rows", type=int, default=d.shared_rows, help="query rows of a shared tile")
    parser.add_argument("--shared-tile-keys", type=int, default=d.shared_tile_keys,
                        help="keys of a shared tile (whole blocks)")
    parser.add_argument("--unique-layout", choices=("auto", "slice", "gather"), default=d.unique_layout,
                        help="unique path: contiguous slice, gathered live blocks, or per-step choice")


def _run(args) -> int:
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    trace = read_trace(args.trace, limit=args.limit)
    work = trace_work(trace.steps, options_from_args(args), args.sliding_window, progress=not args.quiet)
    print(f"{args.trace}: {work.steps} steps, block size {trace.block_size}; "
          f"unique path gathered live blocks in {work.gathered_steps} steps")
    print(work.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "steps": work.steps, "options": asdict(options_from_args(args)),
                       **{k: asdict(getattr(work, k)) for k in ("needed", "planned", "dense")}}, f, indent=1)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("trace-stats", help="attention work a trace needs vs what the planner computes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="scheduler trace, JSON Lines (.jsonl or .jsonl.gz)")
    add_plan_option_flags(p)
    p.add_argument("--sliding-window", type=int, default=None, help="model sliding window (default: none)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N steps")
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
