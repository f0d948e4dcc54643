"""Consecutive steps of a recorded vLLM trace, end to end, on both routes and the peer.

    python -m benchmarks.trace_steps --trace PATH [--start 300] [--steps 200] [--plan PLAN] [--out DIR]

Each step of the window (block size and block ids from the trace; random bf16 q/k/v and caches at
32 query heads, 8 KV heads, head size 128) runs, on the same tensors:

* **ours, CUDA default**: `plan_step` at the default options (timed on the host), the batch copied
  to the device (`UnifiedBatch.from_plan` + sync, timed), then `unified_attention` as a replayed
  CUDA graph of its eager calls (timed);
* **ours, Gaudi route**: the same under `paths.fused.gaudi_route()` (no flash varlen, no Triton:
  what an HPU runs, its FusedSDPA calls as torch SDPA);
* with `--plan PLAN` (a bucket plan for the trace's settings, e.g. `buckets generate --preset
  llama8b-gaudi3`): **ours, Gaudi route, bucket plan**, every step padded to its bucket as a Gaudi
  server runs it (`build_unified_batch(options=plan.step_options, bucket=plan)`: prompts on the prompt
  route in the plan's prompt graphs, else the tiled route), and **the same plan without its prompt
  graphs** (every prompt on the tiled route: bucket plans before prompt graphs), and **in parts** (`gaudi_parts`,
  `--parts-plan`: a step's grid and rest, `step_parts.py`). Planning: `build_unified_batch` (`build_step_parts`);
* **vllm-gaudi's algorithm** (`benchmarks/gaudi_peer.py`: its `ops.py` unchanged, prompts as one
  padded prefill batch, decodes through `flat_pa`), a replayed CUDA graph of its eager ops. Its host
  metadata (built in Python here) is reported apart and left out of its step time, which favours it;
  with `--plan`, also **vllm-gaudi padded to its own `exp` buckets** (`gaudi_peer.ExpBuckets` for the
  plan's settings: its default bucketing strategy, prompt batch x query length x context blocks and
  decode batch x blocks), so both sides pay their padding (`peer_exp_ms`).

A step's time for ours is plan + copy + device; planning is timed `PLAN_REPEATS` times a step, the
median kept. Every output is compared with the peer's (relative
error, bf16) and every tenth step with the float32 reference. Writes `DIR/trace_steps.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import baselines, gaudi_peer
from benchmarks.baselines import _rel_err, capture, environment, sync, time_ms
from vllm_gaudi_unified.attention import unified_attention
from vllm_gaudi_unified.batch import UnifiedBatch, build_unified_batch
from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
from vllm_gaudi_unified.bucket_plans.trace import read_trace
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.plan import plan_step
from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.step_parts import StepParts, build_step_parts, parts_attention
from vllm_gaudi_unified.tools.cli import Parser

ROUTES = {"cuda": contextlib.nullcontext, "gaudi": fused.gaudi_route}
#: Host planning is timed this many times a step and the median kept: one timing of a few ms catches the
#: collector or the compile workers of the step before now and then (10+ ms spikes on the H100's host).
PLAN_REPEATS = 3


def _median_ms(make, device=None):
    """(median host ms of `PLAN_REPEATS` calls of `make`, its last result); with `device`, each call
    starts and ends on an idle device (the copy `build_unified_batch` makes is part of its time)."""
    times = []
    for _ in range(PLAN_REPEATS):
        if device is not None:
            sync(device)
        t0 = time.perf_counter()
        out = make()
        if device is not None:
            sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out
PLAN_ROUTES = ("gaudi_bucketed", "gaudi_bucketed_tiles", "gaudi_parts")


def _plan_routes(path: str | None, names=PLAN_ROUTES, parts: str | None = None) -> dict:
    """name -> (options, bucket plan) of the bucket-plan routes among `names` (none without --plan);
    gaudi_parts: the plan `parts` (grid graphs, `step_parts.py`), else `path`."""
    plan = BucketPlan.load(path) if path else None
    routes = {} if plan is None else {"gaudi_bucketed": (plan.step_options, plan),
              "gaudi_parts": (None, BucketPlan.load(parts or path)),
              "gaudi_bucketed_tiles": (plan.settings.options, replace(plan, prompt_graphs=[]))}
    return {k: v for k, v in routes.items() if k in names}


def _device_ms(fn, device) -> tuple[float, torch.Tensor]:
    if device.type != "cuda":  # (a smoke run on the CPU: eager calls)
        return time_ms(fn, device, reps=1), fn()
    replay, out = capture(fn, device)
    ms = time_ms(replay, device, reps=10, warmup_ms=2, rep_ms=10)
    return ms, out.clone()


def run(args) -> dict:
    device = torch.device(args.device)
    trace = read_trace(args.trace)
    steps = trace.steps[args.start:args.start + args.steps]
    bs = steps[0].block_size
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    num_blocks = max(int(s.block_table().max()) for s in steps) + 1
    g = torch.Generator(device=device).manual_seed(0)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g, device=device, dtype=dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g, device=device, dtype=dtype)
    scale = d ** -0.5
    rows = []
    plan_routes = _plan_routes(args.plan, args.plan_routes, args.parts_plan)
    s = BucketPlan.load(args.plan).settings if args.plan else None
    exp = None if s is None else gaudi_peer.ExpBuckets.for_server(s.max_num_seqs, s.max_num_batched_tokens,
                                                                  s.max_model_len, s.block_size, s.num_blocks)
    for i, st in enumerate(steps):
        ql, cl, table = st.query_lens, st.context_lens, st.block_table()
        t = int(ql.sum())
        q, k, v = (torch.randn(t, h, d, generator=g, device=device, dtype=dtype) for h in (hq, hkv, hkv))
        owned = [table[r][: -(-(int(c) + int(n)) // bs)] for r, (n, c) in enumerate(zip(ql, cl))]
        row = dict(step=args.start + i, tokens=t, requests=len(ql), prompts=int((ql > 1).sum()))
        t0 = time.perf_counter()
        peer = gaudi_peer.build(q, k, v, kc, vc, list(map(int, ql)), list(map(int, cl)), owned, scale)
        sync(device)
        row["peer_host_ms"] = (time.perf_counter() - t0) * 1e3
        row["peer_ms"], peer_out = _device_ms(peer, device)
        if exp is not None:
            padded = gaudi_peer.build(q, k, v, kc, vc, list(map(int, ql)), list(map(int, cl)), owned, scale, exp)
            row["peer_exp_ms"], padded_out = _device_ms(padded, device)
            row["peer_exp_vs_peer_err"] = _rel_err(padded_out, peer_out)
            del padded, padded_out
        ref = None
        if i % 10 == 0:
            blocks = [torch.as_tensor(b, device=device) for b in owned]
            ref = baselines.reference_fp32(q, k, v, kc, vc, list(map(int, ql)), list(map(int, cl)), blocks, scale)
            row["peer_err"] = _rel_err(peer_out, ref)
        for name, route in ROUTES.items():
            with route():
                plan_ms, step_plan = _median_ms(lambda: plan_step(ql, cl, table, bs, num_blocks=num_blocks))
                t0 = time.perf_counter()
                batch = UnifiedBatch.from_plan(step_plan, device)
                sync(device)
                h2d_ms = (time.perf_counter() - t0) * 1e3
                ms, out = _device_ms(lambda: unified_attention(q, k, v, kc, vc, batch, scale), device)
            row[f"{name}_plan_ms"], row[f"{name}_h2d_ms"], row[f"{name}_ms"] = plan_ms, h2d_ms, ms
            row[f"{name}_step_ms"] = plan_ms + h2d_ms + ms
            row[f"{name}_bucket"] = str(step_plan.bucket)
            row[f"{name}_vs_peer_err"] = _rel_err(out, peer_out)
            row.update({} if ref is None else {f"{name}_err": _rel_err(out, ref)})
            del batch, out
        for name, (options, plan) in plan_routes.items():
            with fused.gaudi_route():  # (in parts: both parts' graphs in one capture)
                ms, batch = _median_ms(lambda: (options is None and build_step_parts(
                    ql, cl, table, plan, num_blocks=num_blocks, device=device)) or build_unified_batch(
                    ql, cl, table, bs, num_blocks=num_blocks, options=options or plan.step_options, bucket=plan,
                    device=device), device)
                row[f"{name}_plan_ms"], row[f"{name}_h2d_ms"] = ms, 0.0
                row[f"{name}_ms"], out = _device_ms(lambda: (parts_attention if isinstance(
                    batch, StepParts) else unified_attention)(q, k, v, kc, vc, batch, scale), device)
            row[f"{name}_step_ms"], row[f"{name}_bucket"] = row[f"{name}_plan_ms"] + row[f"{name}_ms"], "+".join(
                map(str, batch.buckets if isinstance(batch, StepParts) else [batch.bucket]))
            row[f"{name}_vs_peer_err"] = _rel_err(out, peer_out)
            row.update({} if ref is None else {f"{name}_err": _rel_err(out, ref)})
            del batch, out
        rows.append(row)
        del q, k, v, peer, peer_out, ref
        if i % 20 == 0:
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            if args.out:  # what is done so far, in case the run is cut short
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "trace_steps.partial.json").write_text(json.dumps(dict(rows=rows), default=str))
    return dict(trace=args.trace, start=args.start, steps=len(rows), block_size=bs, num_blocks=num_blocks,
                plan=args.plan, parts_plan=args.parts_plan, plan_routes=list(plan_routes), totals=totals(rows),
                rows=rows)


def totals(rows: list[dict]) -> dict:
    """Sums over the window: per method device ms, step ms, and steps where ours is slower than the peer."""
    out = {"peer_ms": sum(r["peer_ms"] for r in rows), "peer_host_ms": sum(r["peer_host_ms"] for r in rows)}
    padded = bool(rows) and "peer_exp_ms" in rows[0]
    if padded:  # vllm-gaudi padded to its own exp buckets
        out["peer_exp_ms"] = sum(r["peer_exp_ms"] for r in rows)
        out["peer_exp_max_vs_peer_err"] = max(r["peer_exp_vs_peer_err"] for r in rows)
    for name in [*ROUTES, *(n for n in PLAN_ROUTES if rows and f"{n}_ms" in rows[0])]:
        out[f"{name}_ms"] = sum(r[f"{name}_ms"] for r in rows)
        out[f"{name}_step_ms"] = sum(r[f"{name}_step_ms"] for r in rows)
        out[f"{name}_plan_ms"] = sum(r[f"{name}_plan_ms"] for r in rows)
        out[f"{name}_h2d_ms"] = sum(r[f"{name}_h2d_ms"] for r in rows)
        out[f"{name}_steps_slower_than_peer"] = sum(r[f"{name}_step_ms"] > r["peer_ms"] for r in rows)
        if padded:
            out[f"{name}_steps_slower_than_peer_exp"] = sum(r[f"{name}_step_ms"] > r["peer_exp_ms"] for r in rows)
        out[f"{name}_max_err"] = max((r.get(f"{name}_err", 0.0) for r in rows), default=0.0)
        out[f"{name}_max_vs_peer_err"] = max(r[f"{name}_vs_peer_err"] for r in rows)
    return out


def _route_names(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    if not names or set(names) - set(PLAN_ROUTES):
        raise argparse.ArgumentTypeError(f"--plan-routes takes some of {', '.join(PLAN_ROUTES)}, got {text!r}")
    return names


def main(argv=None) -> int:
    p = Parser(prog="benchmarks.trace_steps", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--start", type=int, default=300)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cuda")
    p.add_argument("--plan", default=None, help="a bucket plan for the trace's settings: adds the padded routes")
    p.add_argument("--plan-routes", type=_route_names, default=PLAN_ROUTES[:2],
                   help=f"with --plan: padded routes to run, comma-separated, of {','.join(PLAN_ROUTES)} (default: 2)")
    p.add_argument("--parts-plan", default=None, help="the gaudi_parts route's plan (grid graphs; default --plan)")
    p.add_argument("--out", type=output_dir, default="out/trace_steps")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = run(args)
    result["env"] = environment(torch.device(args.device))
    (out_dir / "trace_steps.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["totals"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
