"""Host planning time per step (issue: <= 100 us p50 for 256 decoding requests).

Scenarios at Gaudi-like settings (block size 128, a 16000-block cache whose ids
are handed out from a shuffled free list, as in a long-running server):
decode with 1, 64 and 256 requests (contexts 1k-8k), and a mixed 8192-token
step (prefill chunks over cached context, decodes, a shared system prompt).
Times `plan_step` (numpy plan) and `build_unified_batch` (plan + CPU tensors),
each two ways: with new arrays per call (a library caller), and into buffers
kept from step to step (`PlanBuffers` / `StepBuffers`: what the vLLM metadata
builder does; on this 2-core host new arrays cost page faults, up to ~700 a
call for the mixed step). Wall time is what a step pays; the load average is
printed with the table, since other jobs on the two cores inflate it.

    python -m benchmarks.planning [--repeat 300] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from vllm_gaudi_unified import build_unified_batch, plan_step
from vllm_gaudi_unified.batch import StepBuffers
from vllm_gaudi_unified.plan import PlanBuffers

BS, NUM_BLOCKS = 128, 16000


def _table(ctx_plus_q: np.ndarray, rng, shared_prefix_blocks: int = 0) -> np.ndarray:
    need = -(-ctx_plus_q // BS)
    free = rng.permutation(np.arange(1, NUM_BLOCKS))
    table = np.zeros((need.size, need.max()), np.int64)
    prefix = free[:shared_prefix_blocks]
    used = shared_prefix_blocks
    for r, n in enumerate(need):
        own = n - shared_prefix_blocks
        table[r, :shared_prefix_blocks] = prefix
        table[r, shared_prefix_blocks:n] = free[used:used + own]
        used += own
    return table


def scenarios(seed: int = 0) -> dict:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=300, help="timed calls per scenario")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    rows = []
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for name, (q, ctx, table) in scenarios().items():
        plan = plan_step(q, ctx, table, BS, num_blocks=NUM_BLOCKS)
        kept, step_buffers = PlanBuffers(), StepBuffers("cpu")
        timed = {
            "plan": lambda: plan_step(q, ctx, table, BS, num_blocks=NUM_BLOCKS),
            "plan_kept": lambda: plan_step(q, ctx, table, BS, num_blocks=NUM_BLOCKS, buffers=kept),
            "batch": lambda: build_unified_batch(q, ctx, table, BS, num_blocks=NUM_BLOCKS),
            "batch_kept": lambda: build_unified_batch(q, ctx, table, BS, num_blocks=NUM_BLOCKS, buffers=step_buffers),
        }
        row = dict(scenario=name, phase=plan.shape.phase, bucket=str(plan.shape), unique=plan.unique_layout)
        for key, fn in timed.items():
            row[f"{key}_p50_us"], row[f"{key}_p90_us"] = time_us(fn, args.repeat)
        row["plan_kept_cpu_p50_us"], row["plan_kept_cpu_p90_us"] = time_us(timed["plan_kept"], args.repeat,
                                                                           clock=time.process_time)
        rows.append(row)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{load0:.2f} before / {load:.2f} after, numpy {np.__version__}")
    print("| step | phase | plan_step, new arrays: wall p50 / p90 (us) | plan_step into kept buffers: wall | "
          "same, CPU time | build_unified_batch, new arrays: wall | build_unified_batch, StepBuffers: wall "
          "| unique layout |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k + '_p50_us']:.0f} / {r[k + '_p90_us']:.0f}"
                 for k in ("plan", "plan_kept", "plan_kept_cpu", "batch", "batch_kept")]
        print(f"| {r['scenario']} | {r['phase']} | " + " | ".join(cells) + f" | {r['unique']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": [load0, load], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
