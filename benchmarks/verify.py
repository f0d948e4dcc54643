"""Speculative verify steps on both routes, beside the peers and beside a decode step.

    python -m benchmarks.verify --out DIR [--cases NAMES] [--routes cuda,gaudi] [--time-budget S] [--no-peers] [--mla]

Per scenario of `scenarios.verify_scenarios` (block size 128, bf16), on the same tensors in one process:

* ours, CUDA default: the verify step planned with `PlanOptions(unique_tokens=1 + k)` (the speculative
  config's rows per request; the ragged step's longest request), the unique units through the Triton
  kernel; eager calls captured in a CUDA graph;
* ours, Gaudi route (`paths.fused.gaudi_route`: torch ops an HPU graph holds), eager calls captured, and
  for the scenarios `--compile` names compiled per bucket (`graphs.compiled_attention`) and captured;
* the same two for a plain decode step over the same contexts (one new token per request);
* vLLM's Triton unified attention (`benchmarks/triton_peer.py`, its archived kernel);
* vllm-gaudi as it runs verify: batch expansion, every draft a decode row with its own copy of the
  block table, through its `flat_pa` (`benchmarks/gaudi_peer.py`); and its prompt form (the requests
  with drafts as one padded prompt batch with context, through SDPA with a bias);
* the HBM floor (each live cache slot once, at the device's peak read bandwidth, `speed.device_peaks`).

Every output is checked against the float32 reference (ours and the peers with the cache slots no request
may read holding NaN/inf). `--mla`: DeepSeek-V3's latent attention (128 heads, latent 512 + rope 64),
128 x (2 and 3 over 4k) (MTP's 1 + 1 and 1 + 2) against the 1-token decode step, both routes. Rows go to
DIR/verify.json after each case.
"""
from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from benchmarks import baselines, gaudi_peer, scenarios as sc_mod, speed, triton_peer
from benchmarks.speed import _floor_ms, unique_knobs
from vllm_gaudi_unified.files import output_dir, write_text
from vllm_gaudi_unified.tools.cli import Parser
from benchmarks.baselines import _readable, _rel_err, capture, environment, sync, time_ms
from vllm_gaudi_unified import PlanOptions, graphs, plan_step
from vllm_gaudi_unified.attention import unified_attention
from vllm_gaudi_unified.batch import UnifiedBatch
from vllm_gaudi_unified.paths import fused

BS = 128


def _plan_us(ql, cl, table, options, reps=50) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan_step(ql, cl, table, BS, options=options)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _measure(row, fn, ref, device, poison=None):
    """Check `fn` (graph-captured; output poisoned first; `poison`: (cache, cache, dead slots) to fill with
    NaN/inf while checking), then time its replay."""
    replay, out = capture(fn, device)
    if poison is not None:
        kc, vc, dead = poison
        saved = kc[dead].clone(), vc[dead].clone()
        kc[dead], vc[dead] = float("nan"), float("inf")
    try:
        out.fill_(float("nan"))
        replay()
        sync(device)
        row["rel_err"] = _rel_err(out[: ref.shape[0]], ref)
    finally:
        if poison is not None:
            kc[dead], vc[dead] = saved
    row["ok"] = row["rel_err"] <= 1e-2
    if np.isfinite(row["rel_err"]):  # timed with its error beside it (the table marks a miss of 1e-2)
        row["ms"] = time_ms(replay, device)


def _ours(sc, ql, cl, lay, tensors, ref, dead, device, route, units, rows, kind, compile_=False, variant=None,
          profile=False):
    q, k, v, kc, vc = tensors
    scale = sc.heads[2] ** -0.5
    row = dict(scenario=sc.name, title=sc.title, method=f"ours_{kind}", route=route, unique_tokens=units,
               compiled=compile_, variant=variant)
    rows.append(row)
    opts = PlanOptions(unique_tokens=units)
    knobs = unique_knobs(speed._variants(f"v={variant}")["v"]) if variant else contextlib.nullcontext()
    try:
        with fused.gaudi_route() if route == "gaudi" else contextlib.nullcontext(), knobs:
            plan = plan_step(ql, cl, lay.block_table, BS, num_blocks=lay.num_blocks, options=opts)
            row.update(bucket=str(plan.bucket), unique_units=plan.unique_units,
                       plan_us=_plan_us(ql, cl, lay.block_table, opts))
            batch = UnifiedBatch.from_plan(plan, device)
            if compile_:
                fn = lambda: graphs.compiled_attention(q, k, v, kc, vc, batch, scale)  # noqa: E731
            else:
                fn = lambda: unified_attention(q, k, v, kc, vc, batch, scale)  # noqa: E731
            t0 = time.time()
            fn()
            sync(device)
            row["first_call_s"] = time.time() - t0
            _measure(row, fn, ref, device, (kc, vc, dead))
            if profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn()
                    sync(device)
                print(f"[{sc.name} {row['method']}/{route} profile]\n" + prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        traceback.print_exc()
    graphs.clear()
    torch._dynamo.reset()
    print(f"[{sc.name} {row['method']}/{route}{'/' + variant if variant else ''}] {row.get('ms', '-')} ms err {row.get('rel_err', '-')} "
          f"{row.get('bucket', '')}", flush=True)


def _peer(sc, name, build, ref, device, rows):
    row = dict(scenario=sc.name, title=sc.title, method=name)
    rows.append(row)
    try:
        fn = build()
        fn()
        sync(device)
        _measure(row, fn, ref, device)
    except Exception as exc:  # noqa: BLE001
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        traceback.print_exc()
    print(f"[{sc.name} {name}] {row.get('ms', '-')} ms err {row.get('rel_err', '-')}", flush=True)


def run_case(sc, device, rows, peers: bool, tri, compile_=False, variants=(), profile=False, route_names=("cuda", "gaudi")):
    lay, q, k, v, kc, vc = speed.case_tensors(sc, BS, device)  # the runner's tensors, new K/V in the cache
    ql, cl = list(sc.query_lens), list(sc.context_lens)
    hq, hkv, d = sc.heads
    scale = d ** -0.5
    units = max(ql)
    rows.append(dict(scenario=sc.name, title=sc.title, method="floor", ms=_floor_ms(lay, hq, hkv, d, speed.device_peaks(device)),
                     heads=list(sc.heads), tokens=sc.num_tokens, requests=sc.num_requests))
    blocks = [torch.as_tensor(b, device=device) for b in lay.owned]
    ref = baselines.reference_fp32(q, k, v, kc, vc, ql, cl, blocks, scale)
    dead = ~_readable(lay, device)
    routes = tuple((r, False) for r in route_names) + ((("gaudi", True),) if compile_ else ())
    for route, comp in routes:
        _ours(sc, ql, cl, lay, (q, k, v, kc, vc), ref, dead, device, route, units, rows, "verify", comp,
              profile=profile and not comp)
    for variant in variants:  # the CUDA route under other kernel constants (`speed.UNIQUE_KNOBS`)
        _ours(sc, ql, cl, lay, (q, k, v, kc, vc), ref, dead, device, "cuda", units, rows, "verify", variant=variant)
    # a decode step over the same contexts: each request's first new token alone
    starts = np.cumsum([0] + ql[:-1])
    qd = q[torch.as_tensor(starts, device=device)]
    kd, vd = k[torch.as_tensor(starts, device=device)], v[torch.as_tensor(starts, device=device)]
    ref_d = baselines.reference_fp32(qd, kd, vd, kc, vc, [1] * len(ql), cl, blocks, scale)
    for route, comp in routes:
        _ours(sc, [1] * len(ql), cl, lay, (qd, kd, vd, kc, vc), ref_d, dead, device, route, 1, rows, "decode", comp,
              profile=profile and not comp)
    if tri is not None:
        _peer(sc, "triton", lambda: triton_peer.build(tri, q, kc, vc, ql, cl, lay.block_table, scale)[0], ref, device,
              rows)
    if peers:
        _peer(sc, "vllm_gaudi_prompt", lambda: gaudi_peer.build(q, k, v, kc, vc, ql, cl, lay.owned, scale), ref,
              device, rows)
        # batch expansion: draft j of request r is a decode row over context c_r + j (its own block table copy)
        exp_c = [c + j for qn, c in zip(ql, cl) for j in range(qn)]
        exp_b = [b for qn, b in zip(ql, lay.owned) for _ in range(qn)]
        _peer(sc, "vllm_gaudi_expand", lambda: gaudi_peer.build(q, k, v, kc, vc, [1] * len(exp_c), exp_c, exp_b, scale),
              ref, device, rows)
    gc.collect()
    torch.cuda.empty_cache()


def mla_case(rows, device, tokens: int, n=128, ctx=4095) -> None:
    """DeepSeek-V3's latent attention: n requests of `tokens` new tokens over `ctx` cached ones, both routes."""
    from benchmarks import mla_decode as md
    from vllm_gaudi_unified.mla import mla_attention

    H, L, R = md.H, md.L, md.R
    g = torch.Generator(device=device).manual_seed(0)
    per = -(-(ctx + tokens) // BS)
    table = np.arange(1, 1 + n * per).reshape(n, per)
    cache = torch.randn(1 + n * per, BS, L + R, generator=g, device=device, dtype=torch.bfloat16)
    q = torch.randn(n * tokens, H, L + R, generator=g, device=device, dtype=torch.bfloat16)
    latent = torch.randn(n * tokens, L + R, generator=g, device=device, dtype=torch.bfloat16)
    ql, cl = [tokens] * n, [ctx] * n
    check = [0, n - 1]  # reference rows: the first and last request's tokens
    ref = []
    for r in check:
        kv = torch.cat([cache[torch.as_tensor(table[r], device=device)].flatten(0, 1)[:ctx],
                        latent[r * tokens:(r + 1) * tokens]]).float()
        s = q[r * tokens:(r + 1) * tokens].float() @ kv.T * md.SCALE  # [tokens, H, keys]
        keep = torch.arange(ctx + tokens, device=device)[None, :] <= ctx + torch.arange(tokens, device=device)[:, None]
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        ref.append(torch.softmax(s, -1) @ kv[:, :L])
    ref = torch.cat(ref)
    pick = torch.as_tensor([r * tokens + j for r in check for j in range(tokens)], device=device)
    for route in ("cuda", "gaudi"):
        row = dict(scenario=f"mla_{n}x{tokens}_4k", title=f"MLA DeepSeek-V3, {n} x ({tokens} over 4k)", method="ours",
                   route=route, tokens=tokens)
        rows.append(row)
        try:
            with fused.gaudi_route() if route == "gaudi" else contextlib.nullcontext():
                opts = PlanOptions(unique_tokens=tokens)
                plan = plan_step(ql, cl, table, BS, options=opts)
                row.update(bucket=str(plan.bucket), plan_us=_plan_us(ql, cl, table, opts))
                batch = UnifiedBatch.from_plan(plan, device)
                fn = lambda: mla_attention(q, latent, cache, batch, md.SCALE, L)  # noqa: E731
                out = fn()
                row["rel_err"] = (out[pick].float() - ref).norm().item() / ref.norm().item()
                row["ok"] = row["rel_err"] <= 1e-2
                if row["ok"]:
                    replay, _ = capture(fn, device)
                    row["ms"] = time_ms(replay, device)
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
            traceback.print_exc()
        print(f"[mla {n}x{tokens} {route}] {row.get('ms', '-')} ms err {row.get('rel_err', '-')}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = Parser(prog="benchmarks.verify", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=output_dir, default="out/verify", help="folder for verify.json")
    p.add_argument("--cases", default="all", help="comma-separated names of scenarios.verify_scenarios")
    p.add_argument("--time-budget", type=float, default=1e9, help="seconds; cases after it are skipped")
    p.add_argument("--no-peers", action="store_true", help="skip vllm-gaudi's two forms")
    p.add_argument("--no-triton", action="store_true", help="skip vLLM's Triton kernel")
    p.add_argument("--compile", default="", help="scenarios whose Gaudi route is also timed compiled per bucket")
    p.add_argument("--kernel-variants", default="", help="';'-separated speed knob sets (uk_progs:1024,uk_split:4096) "
                   "the CUDA route is timed again under")
    p.add_argument("--profile", default="", help="scenarios whose eager steps are profiled (top CUDA kernels)")
    p.add_argument("--routes", default="cuda,gaudi", help="comma-separated routes timed eager (cuda, gaudi)")
    p.add_argument("--mla", action="store_true", help="also MLA 128 x (2 and 3 over 4k) and its 1-token decode")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    tri = None if args.no_triton else triton_peer.load()
    env = environment(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.time()
    chosen = [s for s in sc_mod.verify_scenarios() if args.cases == "all" or s.name in args.cases.split(",")]

    def save():
        write_text(out / "verify.json", json.dumps(dict(env=env, rows=rows), indent=1, default=str))

    for sc in chosen:
        if time.time() - start > args.time_budget:
            rows.append(dict(scenario=sc.name, method="skipped"))
            continue
        try:
            run_case(sc, device, rows, not args.no_peers, tri, sc.name in args.compile.split(","),
                     [v for v in args.kernel_variants.split(";") if v], sc.name in args.profile.split(","),
                     tuple(r for r in args.routes.split(",") if r))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        save()
    if args.mla and time.time() - start <= args.time_budget:
        for tokens in (1, 2, 3):
            mla_case(rows, device, tokens)
        save()
    print(f"{out / 'verify.json'}: {len(rows)} rows (docs/benchmarks.md's verify table reads such files: "
          "python -m benchmarks.report)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
