"""The benchmark suite: plan, copy, check, time, compare, write JSON/markdown/PNG.

For every scenario and block size: plan the step on the host (timed), copy the
batch to the device (timed), draw fresh random q/k/v and caches, check
`unified_attention` (every variant) against a float32 reference with the cache
slots no request may read poisoned with NaN, then time it next to the
baselines in the same process. Variants of our path:

* `eager`: plain calls (launch gaps included);
* `graph`: the eager call captured in a CUDA graph and replayed (HPU graphs'
  stand-in);
* `compiled`: `vllm_gaudi_unified.graphs.compiled_attention` (torch.compile per
  bucket), captured in a CUDA graph.

`--unique-routes kernel,torch` times the same step again with the unique path
forced through each route (method `route`): the Triton kernel
(`paths/unique_kernel.py`), or flash per block / the matmul tiles; what the
default routing picks is measured against the alternatives in one process.

`--fp8 SCENARIOS` times the same step again over an fp8 KV cache (method
`fp8`: the caches quantized with per-tensor scales; the unique path reads them
in its Triton kernel where there is one, the other paths dequantize the blocks
they gather), beside the bf16 cache.

Run from the repository root: `python -m benchmarks.suite --out DIR` (`--help`: every flag, what it needs).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import platform
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import baselines, report, scenarios as sc_mod
from vllm_gaudi_unified import graphs
from benchmarks.baselines import capture, host_ms, peak_bytes, sync, time_ms

from benchmarks.options import BASELINES, BF16_FLOPS, HBM_BYTES_PER_S, VARIANTS, build_parser, parse_args  # noqa: F401


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def _readable(lay: sc_mod.Layout, device) -> torch.Tensor:
    """[num_blocks, block_size] True for slots some request may read (context or its new tokens)."""
    bs = lay.block_size
    ok = torch.zeros(lay.num_blocks * bs, dtype=torch.bool)
    for blocks, q, c in zip(lay.owned, lay.scenario.query_lens, lay.scenario.context_lens):
        pos = np.arange(c + q)
        ok[torch.as_tensor(blocks[pos // bs] * bs + pos % bs)] = True
    return ok.view(lay.num_blocks, bs).to(device)


def run_case(sc, bs, args, device, dtype, rows, profiles):
    from vllm_gaudi_unified import plan_step
    from vllm_gaudi_unified.attention import unified_attention
    from vllm_gaudi_unified.tools.plan_flags import plan_options_from_args
    from vllm_gaudi_unified.batch import UnifiedBatch
    from vllm_gaudi_unified.graphs import compiled_attention

    hq, hkv, d = args.num_qo_heads, args.num_kv_heads, args.head_dim
    lay = sc_mod.layout(sc, bs, seed=args.seed)
    opts = plan_options_from_args(args)
    ql, cl = list(sc.query_lens), list(sc.context_lens)
    plan_t, plan = host_ms(lambda: plan_step(ql, cl, lay.block_table, bs, num_blocks=lay.num_blocks, options=opts))

    def to_device():
        b = UnifiedBatch.from_plan(plan, device)
        sync(device)
        return b

    h2d_t, batch = host_ms(to_device)
    g = torch.Generator(device=device).manual_seed(args.seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    t = sc.num_tokens
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    kc, vc = rand(lay.num_blocks, bs, hkv, d), rand(lay.num_blocks, bs, hkv, d)
    scale = d ** -0.5
    blocks = [torch.as_tensor(b, device=device) for b in lay.owned]
    fl = sc_mod.floors(sc, bs, hq, hkv, d, torch.finfo(dtype).bits // 8)
    floor_ms = max(fl["bytes"] / HBM_BYTES_PER_S, fl["flops"] / BF16_FLOPS) * 1e3
    base = dict(scenario=sc.name, options=str(opts), title=sc.title, block_size=bs, plan_ms=plan_t, h2d_ms=h2d_t,
                unique_layout=plan.unique_layout, phase=batch.phase, bucket=str(plan.bucket),
                work_needed=plan.work_needed.total, work_planned=plan.work_planned.total, floor_ms=floor_ms,
                flops=fl["flops"], bytes=fl["bytes"],
                target_ms=sc.target_ms if bs == 16 else None, triton_ms=sc.triton_ms if bs == 16 else None,
                num_blocks=lay.num_blocks, max_block_id=plan.max_block_id)
    ref = baselines.reference_fp32(q, k, v, kc, vc, ql, cl, blocks, scale)
    # Our variants: check on a cache whose unreadable slots are NaN/inf, then time on a finite one.
    dead = ~_readable(lay, device)
    fns = {"eager": lambda: unified_attention(q, k, v, kc, vc, batch, scale),
           "graph": lambda: unified_attention(q, k, v, kc, vc, batch, scale),
           "compiled": lambda: compiled_attention(q, k, v, kc, vc, batch, scale)}
    prof = [var for (name_bs, var) in profiles if name_bs == (sc.name, bs)]
    _check_and_time(fns, args.variants, dict(base, method="unified"), q, kc, vc, dead, ref, args, device, rows,
                    profile=prof, label=f"{sc.name}:bs{bs}")
    for route in _routes(args.unique_routes):
        with unique_route(route):
            _check_and_time(fns, args.variants, dict(base, method="route", unique_route=route), q, kc, vc, dead, ref,
                            args, device, rows)
    if _wants(args.fp8, sc.name):
        _fp8_case(args, sc, bs, q, k, v, kc, vc, batch, blocks, dead, base, scale, device, rows)
    if _wants(args.invariant, sc.name) and bs in args.baseline_block_sizes:
        # The invariant mode's cost column: the batch-invariant mode on the same tensors, checked the same way.
        inv_opts = replace(opts, batch_invariant=True)
        inv_plan_t, inv_plan = host_ms(lambda: plan_step(ql, cl, lay.block_table, bs, num_blocks=lay.num_blocks,
                                                         options=inv_opts), reps=1)
        inv_batch = UnifiedBatch.from_plan(inv_plan, device)
        inv_fn = lambda: unified_attention(q, k, v, kc, vc, inv_batch, scale)  # noqa: E731
        inv_base = dict(base, method="invariant", options=str(inv_opts), plan_ms=inv_plan_t,
                        work_planned=inv_plan.work_planned.total, bucket=str(inv_plan.bucket))
        _check_and_time({"eager": inv_fn, "graph": inv_fn}, [v_ for v_ in ("eager", "graph") if v_ in args.variants],
                        inv_base, q, kc, vc, dead, ref, args, device, rows)
        del inv_batch, inv_fn
    del dead
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    # Baselines, same tensors, same run.
    if bs not in args.baseline_block_sizes:
        return
    for name in args.baselines:
        row = dict(base, method=name, variant="graph" if device.type == "cuda" else "eager")
        try:
            if name == "sdpa_loop":
                fn = baselines.per_request_sdpa(q, k, v, kc, vc, ql, cl, blocks, scale)
            elif name == "padded_sdpa":
                fn = baselines.padded_sdpa(q, k, v, kc, vc, ql, cl, lay.block_table, scale)
            elif name == "flex":
                if device.type != "cuda":
                    row.update(ok=None, error="CUDA only here")
                    rows.append(row)
                    continue
                fn = baselines.flex_paged(q, k, v, kc, vc, ql, cl, lay.owned, scale)
            else:
                raise ValueError(f"unknown baseline {name!r}")
            if fn is None:
                row.update(ok=None, error="does not apply: " + ("padded K/V over 24 GB" if name == "padded_sdpa"
                                                                 else "a block has two owners"))
                rows.append(row)
                continue
            out = fn()
            row["rel_err"] = _rel_err(out, ref)
            row["ok"] = row["rel_err"] <= args.tol
            del out
            if row["ok"]:
                row["peak_mb"] = (peak_bytes(fn, device) or 0) / 2**20 if device.type == "cuda" else None
                if device.type == "cuda":
                    try:
                        replay, _ = capture(fn, device)
                        row["ms"] = time_ms(replay, device, reps=args.cpu_reps)
                    except Exception:  # noqa: BLE001 - graph capture refused: time eager calls
                        row["variant"] = "eager"
                        row["ms"] = time_ms(fn, device, reps=args.cpu_reps)
                else:
                    row["ms"] = time_ms(fn, device, reps=args.cpu_reps)
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _fp8_case(args, sc, bs, q, k, v, kc, vc, batch, blocks, dead, base, scale, device, rows) -> None:
    """The step over an fp8 copy of the caches (per-tensor scales: amax / the format's largest value),
    checked against the reference over the dequantized cache, every variant timed (method `fp8`)."""
    from vllm_gaudi_unified.attention import unified_attention
    from vllm_gaudi_unified.graphs import compiled_attention
    from vllm_gaudi_unified.paths.kv_quant import FP8_DTYPES, dequantize, quantize

    fp8 = FP8_DTYPES[args.fp8_dtype]
    ks, vs = (float(c.abs().amax()) / torch.finfo(fp8).max for c in (kc, vc))
    kq, vq = quantize(kc, fp8, ks), quantize(vc, fp8, vs)
    ref = baselines.reference_fp32(q, k, v, dequantize(kq, ks, q.dtype), dequantize(vq, vs, q.dtype),
                                   list(sc.query_lens), list(sc.context_lens), blocks, scale)
    fl = sc_mod.floors(sc, bs, args.num_qo_heads, args.num_kv_heads, args.head_dim, torch.finfo(q.dtype).bits // 8,
                       kv_elem_bytes=1)
    floor_ms = max(fl["bytes"] / HBM_BYTES_PER_S, fl["flops"] / BF16_FLOPS) * 1e3
    kw = dict(k_scale=ks, v_scale=vs)
    fns = {"eager": lambda: unified_attention(q, k, v, kq, vq, batch, scale, **kw),
           "graph": lambda: unified_attention(q, k, v, kq, vq, batch, scale, **kw),
           "compiled": lambda: compiled_attention(q, k, v, kq, vq, batch, scale, **kw)}
    _check_and_time(fns, args.variants, dict(base, method="fp8", kv_cache_dtype=args.fp8_dtype, floor_ms=floor_ms,
                                             bytes=fl["bytes"]), q, kq, vq, dead, ref, args, device, rows)
    del kq, vq, ref


#: `--unique-routes`: `kernel_unique_applies` as each route forces it (4. of `attention._run_paths`; the
#: kernel needs flash's conditions too: CUDA, a 16-bit query, no soft cap). `default`: the routing's own.
UNIQUE_ROUTES = {"kernel": lambda kc, vc: True, "torch": lambda kc, vc: False}


def _routes(spec: str) -> list[str]:
    routes = [r for r in spec.split(",") if r and r != "none"]
    unknown = sorted(set(routes) - set(UNIQUE_ROUTES))
    if unknown:
        raise SystemExit(f"unknown --unique-routes {unknown}; known: {sorted(UNIQUE_ROUTES)}")
    return routes


@contextlib.contextmanager
def unique_route(name: str):
    """The unique path forced through route `name` ('default': unchanged) while the block runs. Compiled
    buckets are cleared on the way out (`_check_and_time` does after each variant), so none keeps a route."""
    from vllm_gaudi_unified import attention

    saved = attention.kernel_unique_applies
    if name != "default":
        attention.kernel_unique_applies = UNIQUE_ROUTES[name]
    try:
        yield
    finally:
        attention.kernel_unique_applies = saved
        graphs.clear()


def _wants(spec: str, name: str) -> bool:
    """A comma-separated scenario list, 'all' or 'none'."""
    return spec == "all" or name in spec.split(",")


def _check_and_time(fns, variants, base, q, kc, vc, dead, ref, args, device, rows, profile=(), label="") -> None:
    """Per variant: check it on a cache whose unreadable slots are NaN/inf, time it on the finite cache,
    profile it if asked, then drop its graph before the next variant (graph pools of several variants
    together ran a chunked prefill out of memory). Appends one row per variant."""
    for var in variants:
        if var not in fns or (var != "eager" and device.type != "cuda"):
            continue
        row = dict(base, variant=var)
        rows.append(row)
        fn = None
        if kc.dtype.itemsize == 1:  # fp8: poison through the bytes (0x7f is NaN in both formats)
            kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
        kc_clean, vc_clean = kc[dead].clone(), vc[dead].clone()
        kc[dead], vc[dead] = (0x7F, 0x7F) if kc.dtype == torch.uint8 else (float("nan"), float("inf"))
        try:
            t0 = time.time()
            if var == "eager":
                fn, out = fns[var], fns[var]()
            else:
                fn, out = capture(fns[var], device)
                out.fill_(float("nan"))  # poison: the replay must write every element
                fn()
                sync(device)
            row["setup_s"] = time.time() - t0
            row["rel_err"] = _rel_err(out, ref)
            row["ok"] = row["rel_err"] <= args.tol
            del out
        except Exception as exc:  # noqa: BLE001 - a failing variant is reported, not fatal
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
        finally:
            kc[dead], vc[dead] = kc_clean, vc_clean
            del kc_clean, vc_clean
        try:
            if row.get("ok"):
                row["ms"] = time_ms(fn, device, reps=args.cpu_reps)
                if var == "eager" and device.type == "cuda":
                    row["peak_mb"] = (peak_bytes(fn, device) or 0) / 2**20
                if var in profile:
                    _profile(fn, device, f"{label}:{var}", rows)
        except Exception as exc:  # noqa: BLE001
            row.update(ms=None, error=f"timing: {type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
        del fn
        graphs.clear()
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


def _profile(fn, device, label, rows):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            fn()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=70)
    rows.append(dict(method="profile", scenario=label, table=table))
    print(f"== profile {label}\n{table}", flush=True)


def _run_isolated(args, chosen, block_sizes, out_dir, start, env) -> list[dict]:
    """Each case in a child process (at most `--case-timeout` s); rows merged in order and written after
    every case, so a run stopped early keeps what it measured. Children's output goes to `cases.log`."""
    import subprocess
    import tempfile

    from benchmarks.options import to_argv

    rows, scratch = [], Path(tempfile.mkdtemp(prefix="bench-cases-"))
    log = Path(out_dir) / "cases.log"
    for bs in block_sizes:
        for sc in chosen:
            left = args.time_budget - (time.time() - start)
            if left < 20:
                rows.append(dict(scenario=sc.name, block_size=bs, method="skipped", error="time budget"))
                continue
            sub = scratch / f"{sc.name}_{bs}"
            argv = to_argv(args, scenarios=sc.name, block_sizes=bs, out=str(sub), isolate=False,
                           variants=args.variants, baselines=args.baselines or "none",
                           baseline_block_sizes=args.baseline_block_sizes)
            t0 = time.time()
            try:
                # At most 1e6 s: a larger timeout (the 1e9 defaults) overflows poll() with OverflowError.
                proc = subprocess.run([sys.executable, "-m", "benchmarks.suite", *argv], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      timeout=min(args.case_timeout, left, 1e6))
                output, code = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as exc:
                output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                code = "timeout"
            with log.open("a") as f:
                f.write(f"\n===== {sc.name} bs{bs} ({time.time() - t0:.0f} s, exit {code})\n{output}")
            print("\n".join(line for line in output.splitlines() if line.startswith("[")), flush=True)
            try:
                got = json.loads((sub / "results.json").read_text())["rows"]
            except (OSError, ValueError):
                got = []
            rows += got
            if not got or code not in (0, 1):  # 1: a variant failed its check, already in the rows
                rows.append(dict(scenario=sc.name, block_size=bs, method="unified", variant="-", ok=False,
                                 error=f"child exited {code}: {output[-300:]}"))
            report.write_all(out_dir, env, vars(args), rows)
    return rows


def environment(device: torch.device) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(), device_type=device.type,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(device=p.name, sms=p.multi_processor_count, memory_gb=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["device"] = platform.processor() or platform.machine()
    return env


def main(argv=None, args=None) -> int:
    args = args or parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype)
    args.variants = [v for v in args.variants.split(",") if v]
    _routes(args.unique_routes)  # an unknown route stops here, before any device work
    args.baselines = [] if args.baselines in ("", "none") else args.baselines.split(",")
    args.baseline_block_sizes = [int(x) for x in args.baseline_block_sizes.split(",") if x]
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    all_sc = sc_mod.scenarios(args.scale, args.seed)
    wanted = None if args.scenarios == "all" else set(args.scenarios.split(","))
    chosen = [s for s in all_sc if wanted is None or s.name in wanted]
    if wanted and len(chosen) != len(wanted):
        raise SystemExit(f"unknown scenario in {sorted(wanted)}; known: {[s.name for s in all_sc]}")
    profiles = []
    for spec in filter(None, args.profile.split(",")):
        name, bs, var = spec.split(":")
        profiles.append(((name, int(bs)), var))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    print(json.dumps(env), flush=True)
    rows: list[dict] = []
    start = time.time()
    for bs in block_sizes if not args.isolate else []:
        for sc in chosen:
            if time.time() - start > args.time_budget:
                rows.append(dict(scenario=sc.name, block_size=bs, method="skipped", error="time budget"))
                continue
            t0 = time.time()
            run_case(sc, bs, args, device, dtype, rows, profiles)
            print(report.progress_line(rows, sc.name, bs, time.time() - t0), flush=True)
            report.write_all(out_dir, env, vars(args), rows)
            graphs.clear()  # compiled buckets and captured graphs hold memory pools
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.isolate:
        rows = _run_isolated(args, chosen, block_sizes, out_dir, start, env)
    report.write_all(out_dir, env, vars(args), rows, plot=True)
    print(report.markdown(env, rows), flush=True)
    failed = [r for r in rows if r.get("method") in ("unified", "route") and r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
