"""Host planning time per step (the goal: <= 100 us p50 for 256 decoding requests).

Scenarios at Gaudi-like settings (block size 128, block ids handed out from a
shuffled free list, as in a long-running server):

- decode with 1, 64 and 256 requests (contexts 1k-8k) in a 16000-block cache,
  and a mixed 8192-token step (prefill chunks over cached context, decodes, a
  shared system prompt) (`scenarios`);
- decode steps over a large cache: 256 decodes (contexts 1k-8k) in a 40000-block
  cache, with no block shared, and with 8 of the 256 sharing an 8-block prefix
  (`decode_scenarios`).

Times `plan_step` (numpy plan) and `build_unified_batch` (plan + CPU tensors),
each two ways: with new arrays per call (a library caller), and into buffers
kept from step to step (`PlanBuffers` / `StepBuffers`: what the vLLM metadata
builder does). Wall time is what a step pays; the load average is printed with
the table, since load on a shared host inflates it.

`--compare DIR` times the same steps with the package of another checkout
(e.g. `git worktree add ../before <commit>`) in alternating subprocess rounds,
so both sides see the same load; each cell is then the median over rounds.

    python -m benchmarks.planning [--repeat 300] [--json out.json] [--compare DIR --rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.tools.cli import Parser

BS, NUM_BLOCKS = 128, 16000
KINDS = ("plan", "plan_kept", "batch", "batch_kept")
LABELS = {"plan": "plan_step, new arrays", "plan_kept": "plan_step, PlanBuffers",
          "batch": "build_unified_batch, new arrays", "batch_kept": "build_unified_batch, StepBuffers"}


def _table(ctx_plus_q: np.ndarray, rng, shared_prefix_blocks: int = 0, sharing: int | None = None,
           num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    """Block tables from a shuffled free list; the first `sharing` requests (default all) hold the same
    first `shared_prefix_blocks` blocks."""
    need = -(-ctx_plus_q // BS)
    free = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((need.size, need.max()), np.int64)
    prefix = free[:shared_prefix_blocks]
    used = shared_prefix_blocks
    for r, n in enumerate(need):
        k = shared_prefix_blocks if sharing is None or r < sharing else 0
        table[r, :k] = prefix[:k]
        table[r, k:n] = free[used:used + n - k]
        used += n - k
    return table


def scenarios(seed: int = 0) -> dict:
    """The first steps (the test of plans before and after its rewrite holds them too)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in (1, 64, 256):
        ctx = rng.integers(1024, 8193, n)
        q = np.ones(n, np.int64)
        out[f"decode {n} x 1k-8k"] = (q, ctx, _table(ctx + q, rng))
    # Mixed 8192 tokens: 224 decodes + 8 prefill chunks of ~1000 tokens over cached context,
    # all behind one 512-token system prompt (4 shared blocks).
    q = np.r_[np.ones(224, np.int64), np.full(8, (8192 - 224) // 8)]
    ctx = np.r_[rng.integers(1024, 4096, 224), rng.integers(512, 2048, 8)]
    out["mixed 8192 tokens, 232 reqs"] = (q, ctx, _table(ctx + q, rng, shared_prefix_blocks=4))
    return out


#: The large cache: block ids spread over 40000 blocks
DECODE_NUM_BLOCKS = 40000


def decode_scenarios(seed: int = 23) -> dict:
    """Decode steps over a large cache: 256 x 1k-8k over a 40000-block cache, no block shared / 8 of the 256
    sharing an 8-block prefix."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(1024, 8193, 256)
    q = np.ones(256, np.int64)
    return {"decode 256 x 1k-8k, 40k blocks": (q, ctx, _table(ctx + q, rng, num_blocks=DECODE_NUM_BLOCKS)),
            "same, 8 sharing an 8-block prefix": (q, ctx, _table(ctx + q, rng, 8, 8, DECODE_NUM_BLOCKS))}


def verify_scenarios(seed: int = 36) -> dict:
    """Speculative verify steps: 128 requests (contexts 1k-8k), each its last token and up to 3
    drafts (ragged: a proposer that found fewer for some), and all with 3."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(1024, 8193, 128)
    ragged, full = rng.integers(1, 5, 128), np.full(128, 4, np.int64)
    return {"verify 128 x (1-4 over 1k-8k)": (ragged, ctx, _table(ctx + ragged, rng)),
            "verify 128 x (4 over 1k-8k)": (full, ctx, _table(ctx + full, rng))}


def verify_options():
    """The options a server with 3 speculative tokens plans with (None where the package predates them:
    `--compare` against an older checkout times its default)."""
    from vllm_gaudi_unified import PlanOptions

    try:
        return PlanOptions(unique_tokens=4)
    except TypeError:
        return None


def all_scenarios() -> dict:
    """name -> (query_lens, context_lens, block_table, num_blocks, planner options or None)."""
    out = {k: v + (NUM_BLOCKS, None) for k, v in scenarios().items()}
    out.update({k: v + (DECODE_NUM_BLOCKS, None) for k, v in decode_scenarios().items()})
    opts = verify_options()
    out.update({k: v + (NUM_BLOCKS, opts) for k, v in verify_scenarios().items()})
    return out


def time_us(fn, repeat: int, clock=time.perf_counter) -> tuple[float, float]:
    """p50, p90 in microseconds. `clock=time.process_time` counts this process's CPU time only,
    which other processes on a busy machine do not inflate (wall time is what a step pays)."""
    for _ in range(10):
        fn()
    ts = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        ts.append((clock() - t0) * 1e6)
    return float(np.percentile(ts, 50)), float(np.percentile(ts, 90))


def measure(repeat: int) -> list[dict]:
    """One row per scenario: p50 / p90 wall time of each way of planning, with the package importable
    here (this checkout, or the one `--compare` put first on the path)."""
    from vllm_gaudi_unified import build_unified_batch, plan_step
    from vllm_gaudi_unified.batch import StepBuffers
    from vllm_gaudi_unified.plan import PlanBuffers

    rows = []
    for name, (q, ctx, table, nb, opts) in all_scenarios().items():
        plan = plan_step(q, ctx, table, BS, num_blocks=nb, options=opts)
        kept, step_buffers = PlanBuffers(), StepBuffers("cpu")
        timed = {
            "plan": lambda: plan_step(q, ctx, table, BS, num_blocks=nb, options=opts),
            "plan_kept": lambda: plan_step(q, ctx, table, BS, num_blocks=nb, options=opts, buffers=kept),
            "batch": lambda: build_unified_batch(q, ctx, table, BS, num_blocks=nb, options=opts),
            "batch_kept": lambda: build_unified_batch(q, ctx, table, BS, num_blocks=nb, options=opts,
                                                      buffers=step_buffers),
        }
        row = dict(scenario=name, phase=plan.shape.phase, bucket=str(plan.shape), unique=plan.unique_layout)
        for key, fn in timed.items():
            row[f"{key}_p50_us"], row[f"{key}_p90_us"] = time_us(fn, repeat)
        row["plan_kept_cpu_p50_us"], row["plan_kept_cpu_p90_us"] = time_us(timed["plan_kept"], repeat,
                                                                           clock=time.process_time)
        rows.append(row)
    return rows


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _worker(tree: str, repeat: int) -> list[dict]:
    """`measure` in a subprocess that imports the package of `tree`."""
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
    out = subprocess.run([sys.executable, __file__, "--worker", "--repeat", str(repeat)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def _median_rows(rounds: list[list[dict]]) -> list[dict]:
    rows = [dict(r) for r in rounds[0]]
    for i, row in enumerate(rows):
        for key in row:
            if key.endswith("_us"):
                row[key] = float(np.median([rnd[i][key] for rnd in rounds]))
    return rows


def main(argv=None) -> int:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=300, help="timed calls per scenario (and round)")
    ap.add_argument("--json", type=output_path, default=None, help="write the results to this file")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="another checkout whose package to time beside this one (alternating rounds)")
    ap.add_argument("--rounds", type=int, default=4, help="with --compare: rounds per side")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        json.dump(measure(args.repeat), sys.stdout)
        return 0
    here = str(Path(__file__).resolve().parents[1])
    load0 = _load()
    if args.compare:
        before, after = [], []
        for _ in range(args.rounds):
            before.append(_worker(args.compare, args.repeat))
            after.append(_worker(here, args.repeat))
        sides = {"before": _median_rows(before), "after": _median_rows(after)}
    else:
        sides = {"this checkout": _worker(here, args.repeat)}
    load = _load()
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{load0:.2f} before / {load:.2f} after, numpy {np.__version__}")
    print("wall p50 / p90 (us)" + (f", median of {args.rounds} alternating rounds" if args.compare else ""))
    print("| step | side | " + " | ".join(LABELS[k] for k in KINDS) + " | plan_step, PlanBuffers, CPU time "
          "| bucket | unique layout |")
    print("|---|---|" + "---|" * (len(KINDS) + 3))
    for i in range(len(next(iter(sides.values())))):
        for side, rows in sides.items():
            r = rows[i]
            cells = [f"{r[k + '_p50_us']:.0f} / {r[k + '_p90_us']:.0f}" for k in KINDS + ("plan_kept_cpu",)]
            print(f"| {r['scenario']} | {side} | " + " | ".join(cells) + f" | {r['bucket']} | {r['unique']} |")
    if args.json:
        with atomic_write(args.json) as f:
            json.dump({"load_average": [load0, load], "compare": args.compare, "sides": sides}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
