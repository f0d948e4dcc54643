"""The device runner: scenarios of `benchmarks/scenarios.py` on both routes, beside the peers, in one process.

    python -m benchmarks.speed --out DIR [--scenarios all] [--block-sizes 16,128] [--methods ours,peer,triton]
                               [--routes cuda,gaudi] [--variants ...] [--rounds N] [--device cpu|cuda] [--scale S]

Per scenario and block size, on the same tensors (the scenario's heads, random from `--seed`):

* `ours`, one row per option set: `default`, the CUDA route (every CUDA kernel where it applies), and
  `gaudi`, the Gaudi route (`paths.fused.gaudi_route`: every CUDA-only kernel off, what an HPU runs), then
  those `--variants` adds; compiled per bucket and replayed as a CUDA graph (`--form graph`: eager calls
  captured; on the CPU plain calls);
* `peer`: vllm-gaudi's algorithm as it runs (`benchmarks/gaudi_peer.py`), a replayed CUDA graph of its eager
  ops and compiled (`--peer-variants`);
* `triton`: vLLM's Triton unified attention (`benchmarks/triton_peer.py`, from the archive `pack` makes);
* `sdpa_loop`, `padded_sdpa`, `flex`: plain torch baselines (`benchmarks/baselines.py`);
* the HBM / FLOP floor of the step (`floor_ms`).

Every row is checked against the float32 reference before it is timed: the cache slots no request may read
hold NaN/inf, a graph's output is poisoned before the checking replay; a row past `--tol` is not timed, and
a failed row of ours makes the exit status 1. Peak MB: device memory one call allocates beyond its inputs.
Writes DIR/speed.json after every case: the environment (device, versions, date, commit), the settings
and the rows; `python -m benchmarks.report` makes docs/benchmarks.md's tables from such files.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import re
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import baselines, gaudi_peer, scenarios as sc_mod, triton_peer
from benchmarks.baselines import _readable, environment, measure
from vllm_gaudi_unified import attention, graphs
from vllm_gaudi_unified.bucket_plans.device_options import device_kind, options_for_device
from vllm_gaudi_unified.files import output_dir, write_text
from vllm_gaudi_unified.flags import POSITIVE, SEED, comma_ints_in, float_in, parse_comma_ints
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.plan.arrays import MAX_BLOCK_SIZE
from vllm_gaudi_unified.tools.cli import Parser

#: (HBM bytes/s at peak, dense bf16 matmul FLOP/s measured) of the devices the floors are priced on; a device
#: not named here is priced as an H100 SXM (0.64 ms floor for decode 256 x 2k there).
DEVICE_PEAKS = {"H100": (3.35e12, 800e12), "H200": (4.8e12, 780e12)}


def device_peaks(device) -> tuple[float, float]:
    """The floors' (HBM, FLOP) rates for a torch device, found by its name ("NVIDIA H200", ...)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in DEVICE_PEAKS.items() if k in name.split()), DEVICE_PEAKS["H100"])
METHODS = ("ours", "peer", "triton", "sdpa_loop", "padded_sdpa", "flex")
ROUTES = {"cuda": ("default", {}), "gaudi": ("gaudi", {"gaudi": True})}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Variant keys read as flags (0 / 1) and as text; every other key is an integer.
FLAG_KEYS = ("fused_kernels", "gaudi", "device_table", "prompt_flash", "step_bias", "batch_invariant")
TEXT_KEYS = ("unique_layout", "prompt_route", "kv_cache", "unique_route")
#: `unique_route:NAME`: `attention.kernel_unique_applies` as the route forces it (the kernel still needs flash's
#: conditions: CUDA, a 16-bit query, no soft cap).
UNIQUE_ROUTES = {"kernel": lambda kc, vc: True, "torch": lambda kc, vc: False}
#: Variant keys that set module constants of the paths (the unique kernel's; `prompt_split:0` / `:1` the prompt
#: route's one call with the full bias / its split form) for that variant alone: key -> (module of
#: `vllm_gaudi_unified.paths`, constant).
UNIQUE_KNOBS = {"uk_split": ("unique", "KERNEL_SPLIT_KEYS"), "uk_max": ("unique", "KERNEL_MAX_SPLITS"),
                "uk_keys": ("unique", "KERNEL_KEYS"), "uk_warps": ("unique", "KERNEL_WARPS"),
                "uk_stages": ("unique", "KERNEL_STAGES"), "uk_progs": ("unique", "KERNEL_MIN_PROGRAMS"),
                "uk_minsplit": ("unique", "KERNEL_MIN_SPLIT_KEYS"), "uk_shrows": ("unique", "KERNEL_SHARED_MAX_ROWS"),
                "uk_rank": ("unique", "RANK_SORT_MAX_SLOTS"), "uk_scan": ("unique", "SCAN_ORDER_MAX_WORK"), "prompt_split": ("prompts", "SPLIT_CONTEXT")}


def _variants(spec: str, routes=("cuda",)) -> dict:
    """name -> PlanOptions overrides: the `routes`' option sets, then those of `spec` ('name=key:value,...;...').
    Keys that are not options: `gaudi:1` the Gaudi route; `device_table:1` starts from the device's measured
    options (`device_options.py`); `prompt_flash:1` / `:0` the prompt route through flash varlen always / never
    (default: for ragged prompts); `step_bias:0` makes the prompt route's mask in each call instead of once per
    step; `kv_cache:fp8_e4m3` / `fp8_e5m2` the step over an fp8 copy of the caches (per-tensor scales, checked
    against the reference over the dequantized cache); `unique_route:kernel` / `torch` the unique path forced
    through its Triton kernel / torch; the kernel constants of `UNIQUE_KNOBS`."""
    out = dict(ROUTES[r] for r in routes)
    for item in filter(None, spec.split(";")):
        name, _, kv = item.partition("=")
        out[name] = {k: (v if k in TEXT_KEYS else bool(int(v)) if k in FLAG_KEYS else int(v))
                     for k, v in (p.split(":") for p in kv.split(",") if p)}
    return out


@contextlib.contextmanager
def unique_knobs(over: dict):
    """Within: the `UNIQUE_KNOBS` of `over` (popped from it) set on their modules."""
    saved = []
    for key in [k for k in over if k in UNIQUE_KNOBS]:
        module, name = UNIQUE_KNOBS[key]
        module = importlib.import_module(f"vllm_gaudi_unified.paths.{module}")
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, over.pop(key))
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def variant(over: dict, device):
    """Within: the variant `over` in force (route, prompt form, unique route, kernel constants); yields its
    PlanOptions, whether the prompt mask is made once per step, and its KV cache format (None: the model's).
    What a user gets is the start: the default options, the same on every device."""
    over = dict(over)
    gaudi, table, step_bias = over.pop("gaudi", False), over.pop("device_table", False), over.pop("step_bias", True)
    kv_cache, route = over.pop("kv_cache", None), over.pop("unique_route", None)
    saved = attention.PROMPT_FLASH, attention.kernel_unique_applies
    attention.PROMPT_FLASH = over.pop("prompt_flash", None)
    if route is not None:
        attention.kernel_unique_applies = UNIQUE_ROUTES[route]
    kind = device_kind(device.type, torch.cuda.get_device_name(device)) if table else ""
    try:
        with unique_knobs(over), fused.gaudi_route() if gaudi else contextlib.nullcontext():
            from vllm_gaudi_unified import PlanOptions

            yield replace(options_for_device(kind, PlanOptions()), **over), step_bias, kv_cache
    finally:
        attention.PROMPT_FLASH, attention.kernel_unique_applies = saved
        graphs.clear()  # compiled buckets keep the route they were made under


def trace_cases(spec: str, top: int) -> list:
    """(Scenario, Layout) of the `top` steps with the most dense-design work of a recorded trace
    (`PATH:auto`) or of the listed steps (`PATH:i,j`)."""
    from benchmarks.trace_work import dense_work
    from vllm_gaudi_unified import plan_step
    from vllm_gaudi_unified.bucket_plans.trace import read_trace

    path, _, which = spec.rpartition(":")
    trace = read_trace(path)
    out = []
    if which == "auto":
        work = [dense_work(plan_step(s.query_lens, s.context_lens, s.block_table(), s.block_size)).total
                for s in trace.steps]
        which = ",".join(str(i) for i in np.argsort(work, kind="stable")[::-1][:top])
    for i in (int(x) for x in which.split(",")):
        st = trace.steps[i]
        name = f"{Path(path).name.split('_')[1]}#{i}"
        sc = sc_mod.Scenario(name, f"trace {Path(path).name.split('.jsonl')[0]} step {i}",
                             tuple(int(x) for x in st.query_lens), tuple(int(x) for x in st.context_lens))
        owned = [np.asarray(ids, np.int64) for ids in st.block_ids]
        lay = sc_mod.Layout(sc, st.block_size, st.block_table(), max(int(o.max()) for o in owned) + 1, owned)
        out.append((sc, lay))
    return out


def _floor_ms(lay, hq, hkv, d, peaks=DEVICE_PEAKS["H100"]) -> float:
    """HBM / FLOP floor of any step at `peaks` (`device_peaks`): every cache slot some request reads once (a
    shared block once), q/k/v/out once; score + value FLOPs of the needed pairs."""
    sc, bs = lay.scenario, lay.block_size
    slots = set()
    pairs = 0
    for blocks, q, c in zip(lay.owned, sc.query_lens, sc.context_lens):
        pos = np.arange(c)
        slots.update((blocks[pos // bs] * bs + pos % bs).tolist())
        pairs += q * c + q * (q + 1) // 2
    nbytes = 2 * len(slots) * hkv * d * 2 + sc.num_tokens * (2 * hq + 2 * hkv) * d * 2
    hbm, flops = peaks
    return max(nbytes / hbm, 4 * pairs * hq * d / flops) * 1e3


def case_tensors(sc, bs: int, device, lay=None, dtype=torch.bfloat16, seed: int = 0):
    """A scenario's inputs at block size `bs`, the same in every benchmark that times it: (its layout,
    q, k, v `[tokens, heads, D]`, key and value caches `[blocks, bs, Hkv, D]`), the new tokens' K/V written
    into their cache slots (as vLLM does before attention; the peers read them there)."""
    lay = lay or sc_mod.layout(sc, bs, seed=seed)
    hq, hkv, d = sc.heads
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    t = sc.num_tokens
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    kc, vc = rand(lay.num_blocks, bs, hkv, d), rand(lay.num_blocks, bs, hkv, d)
    triton_peer.write_new_kv(k, v, kc, vc, list(sc.query_lens), list(sc.context_lens), lay.owned)
    return lay, q, k, v, kc, vc


def _record(rows, row, work) -> None:
    """`work(row)` with any error in the row (a failing method is reported, not fatal); memory freed after."""
    rows.append(row)
    try:
        work(row)
    except Exception as exc:  # noqa: BLE001
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
        traceback.print_exc()
    torch._dynamo.reset()
    gc.collect()
    if row["device"] == "cuda":
        torch.cuda.empty_cache()
    print(f"[{row['scenario']} bs{row['block_size']} {row['method']}/{row.get('variant')}] {row.get('ms', '-')} ms "
          f"err {row.get('rel_err', '-')}", flush=True)


def run_case(sc, bs, args, device, rows, lay=None) -> None:
    from vllm_gaudi_unified import plan_step
    from vllm_gaudi_unified.batch import UnifiedBatch
    from vllm_gaudi_unified.paths.kv_quant import FP8_DTYPES, dequantize, quantize

    dtype = DTYPES[args.dtype]
    lay, q, k, v, kc, vc = case_tensors(sc, bs, device, lay, dtype, args.seed)
    ql, cl = list(sc.query_lens), list(sc.context_lens)
    hq, hkv, d = sc.heads
    scale = d ** -0.5
    blocks = [torch.as_tensor(b, device=device) for b in lay.owned]
    base = dict(scenario=sc.name, title=sc.title, block_size=bs,
                floor_ms=_floor_ms(lay, hq, hkv, d, device_peaks(device)),
                device=device.type)
    ref = baselines.reference_fp32(q, k, v, kc, vc, ql, cl, blocks, scale)
    dead = ~_readable(lay, device)
    cuda = device.type == "cuda"

    def ours(row, over):
        with variant(over, device) as (opts, step_bias, kv_cache):
            row["options"] = str(opts)
            if row["variant"] == "dense":  # the dense design (benchmarks/trace_work.py) as a plan
                from benchmarks.trace_work import dense_plan

                plan = dense_plan(ql, cl, lay.block_table, bs, lay.num_blocks)
            else:
                plan = plan_step(ql, cl, lay.block_table, bs, num_blocks=lay.num_blocks, options=opts)
                t0 = time.perf_counter()
                for _ in range(5):
                    plan_step(ql, cl, lay.block_table, bs, num_blocks=lay.num_blocks, options=opts)
                row["plan_ms"] = (time.perf_counter() - t0) / 5 * 1e3
            row.update(bucket=str(plan.bucket), unique_layout=plan.unique_layout)
            batch = UnifiedBatch.from_plan(plan, device)
            if step_bias:
                batch = batch.with_prompt_bias(q.dtype)
            keys, values, kw, want = kc, vc, {}, ref
            if kv_cache:  # an fp8 copy of the caches, per-tensor scales: amax / the format's largest value
                fp8 = FP8_DTYPES[kv_cache]
                ks, vs = (float(c.abs().amax()) / torch.finfo(fp8).max for c in (kc, vc))
                keys, values, kw = quantize(kc, fp8, ks), quantize(vc, fp8, vs), dict(k_scale=ks, v_scale=vs)
                want = baselines.reference_fp32(q, k, v, dequantize(keys, ks, q.dtype), dequantize(values, vs, q.dtype),
                                                ql, cl, blocks, scale)
            attend = graphs.compiled_attention if args.form == "compiled" and cuda else attention.unified_attention
            measure(row, lambda: attend(q, k, v, keys, values, batch, scale, **kw), want, device, args.tol,
                    args.cpu_reps, args.form, (keys, values, dead))

    if "ours" in args.methods:
        for name, over in _variants(args.variants, args.routes).items():
            _record(rows, dict(base, method="ours", variant=name, variant_over=dict(over)), lambda r: ours(r, over))
    if "peer" in args.methods:
        for form in args.peer_variants.split(",") if cuda else ["eager"]:
            def peer(row, form=form):
                fn = gaudi_peer.build(q, k, v, kc, vc, ql, cl, lay.owned, scale)
                measure(row, fn if form != "compiled" else torch.compile(fn, dynamic=False), ref, device, args.tol,
                        args.cpu_reps)
            _record(rows, dict(base, method="peer", variant=form), peer)
    for name in [m for m in args.methods if m not in ("ours", "peer")]:
        def other(row, name=name):
            if name in ("triton", "flex") and not cuda:
                return row.update(ok=None, error="CUDA only")
            if name == "triton":
                fn, info = triton_peer.build(args.peer_triton, q, kc, vc, ql, cl, lay.block_table, scale)
                row.update(info)
            else:
                fn = {"sdpa_loop": lambda: baselines.per_request_sdpa(q, k, v, kc, vc, ql, cl, blocks, scale),
                      "padded_sdpa": lambda: baselines.padded_sdpa(q, k, v, kc, vc, ql, cl, lay.block_table, scale),
                      "flex": lambda: baselines.flex_paged(q, k, v, kc, vc, ql, cl, lay.owned, scale)}[name]()
                if fn is None:
                    return row.update(ok=None, error="does not apply: " + (
                        "padded K/V over 24 GB" if name == "padded_sdpa" else "a block has two owners"))
            try:
                measure(row, fn, ref, device, args.tol, args.cpu_reps)
            except RuntimeError:  # a baseline whose graph capture is refused: its eager calls
                if name == "triton" or not cuda:
                    raise
                row["variant"] = "eager"
                measure(row, fn, ref, device, args.tol, args.cpu_reps, form="eager")
        _record(rows, dict(base, method=name, variant="graph" if cuda else "eager"), other)


def build_parser() -> Parser:
    p = Parser(prog="python -m benchmarks.speed", description=__doc__.splitlines()[0] + " Run from the "
               "repository root of a source checkout (benchmarks/ is not part of the installed package); graphs, "
               "compiled forms, flex and Triton need CUDA (the CPU times eager calls).")
    p.add_argument("--out", type=output_dir, default="out/speed", help="folder for speed.json")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--scenarios", default="all", help="comma-separated names of benchmarks/scenarios.py (the verify "
                   "steps' too), or 'all' (its `scenarios()`)")
    p.add_argument("--block-sizes", type=comma_ints_in(1, MAX_BLOCK_SIZE, "block sizes"), default="16,128",
                   help="comma-separated KV cache block sizes")
    p.add_argument("--methods", default="ours,peer,triton", help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--routes", default="cuda,gaudi", help="our routes timed as option sets `default` (cuda) and "
                   "`gaudi`: comma-separated, or 'none'")
    p.add_argument("--variants", default="", help="more option sets: 'name=shared_rows:64,causal_tile:256;...' "
                   "(PlanOptions fields, and the keys `_variants` names: gaudi:1, kv_cache:fp8_e4m3, "
                   "unique_route:kernel, batch_invariant:1, ...; 'dense': the dense design's plan)")
    p.add_argument("--form", default="compiled", choices=("compiled", "graph", "eager"),
                   help="ours compiled per bucket or eager calls, both replayed as a CUDA graph; or eager calls")
    p.add_argument("--peer-variants", default="graph,compiled", help="vllm-gaudi's forms on CUDA")
    p.add_argument("--archive", default=None, help="vLLM's Triton kernel archive (triton_peer pack; default: "
                   "the one in .wt/peer/)")
    p.add_argument("--scale", type=float_in(1e-6, 1e3), default=1.0,
                   help="shrink request counts and lengths (CPU runs, tests)")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES), help="activations and KV cache")
    p.add_argument("--tol", type=float_in(0.0, 1e6), default=1e-2, help="largest accepted |out - ref| / |ref|")
    p.add_argument("--seed", type=SEED, default=0, help="seed of block tables and tensors")
    p.add_argument("--cpu-reps", type=POSITIVE, default=50, help="timed calls per measurement on CPU (CUDA: do_bench)")
    p.add_argument("--rounds", type=POSITIVE, default=1, help="time every case this many times, ours and the peers "
                   "in turn (each round compiles again); the tables take the median round")
    p.add_argument("--time-budget", type=float_in(0.0, 1e9), default=1e9, help="seconds; skip cases past this")
    p.add_argument("--trace", action="append", default=[], help="PATH:auto or PATH:i,j: also time these trace steps")
    p.add_argument("--top", type=POSITIVE, default=3, help="steps per trace for PATH:auto")
    return p


def parse_args(argv=None):
    """The runner's arguments, each checked before any work (a one-line error, exit 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"argument --device: {args.device!r} is not cpu, cuda or cuda:N")
    args.methods = [m for m in args.methods.split(",") if m]
    args.routes = [r for r in args.routes.split(",") if r and r != "none"]
    for flag, got, known in (("--methods", args.methods, METHODS), ("--routes", args.routes, ROUTES)):
        if not set(got) <= set(known):
            p.error(f"argument {flag}: {','.join(got)!r}: give names from {','.join(known)}")
    from dataclasses import fields

    from vllm_gaudi_unified import PlanOptions

    keys = {f.name for f in fields(PlanOptions)} | set(FLAG_KEYS) | set(TEXT_KEYS) | set(UNIQUE_KNOBS)
    try:
        for name, over in _variants(args.variants).items():
            if set(over) - keys:
                raise ValueError(f"{name}: unknown {sorted(set(over) - keys)}")
            if over.get("kv_cache", "fp8_e4m3") not in ("fp8_e4m3", "fp8_e5m2") or \
                    over.get("unique_route", "kernel") not in UNIQUE_ROUTES:
                raise ValueError(f"{name}: kv_cache is fp8_e4m3 or fp8_e5m2, unique_route kernel or torch")
    except ValueError as exc:
        p.error(f"argument --variants: {args.variants!r}: {exc}")
    known = {s.name: s for s in sc_mod.scenarios(args.scale, args.seed)
             + sc_mod.verify_scenarios(args.scale, args.seed)}
    names = [s.name for s in sc_mod.scenarios()] if args.scenarios == "all" else args.scenarios.split(",")
    if set(names) - set(known):
        p.error(f"argument --scenarios: unknown {sorted(set(names) - set(known))}; known: {','.join(known)}")
    args.chosen = [known[n] for n in names]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = environment(device)
    if "triton" in args.methods and device.type == "cuda":
        try:  # before any device work: a missing archive stops here
            args.peer_triton = triton_peer.load(args.archive)
        except (OSError, ValueError) as exc:
            sys.exit(f"python -m benchmarks.speed: error: {exc} (or leave triton out of --methods)")
        env["vllm_triton"] = dict(args.peer_triton.manifest, archive=args.peer_triton.archive)
    print(json.dumps(env), flush=True)
    out = Path(args.out) / "speed.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("chosen", "peer_triton")}
    start, rows = time.time(), []
    cases = [(sc, bs, None) for bs in parse_comma_ints(args.block_sizes) for sc in args.chosen]
    cases += [(sc, lay.block_size, lay) for spec in args.trace for sc, lay in trace_cases(spec, args.top)]
    for rnd in range(args.rounds):
        for sc, bs, lay in cases:
            first = len(rows)
            if time.time() - start > args.time_budget:
                rows.append(dict(scenario=sc.name, block_size=bs, method="skipped"))
            else:
                run_case(sc, bs, args, device, rows, lay)
            for r in rows[first:]:
                r["round"] = rnd
            write_text(out, json.dumps(dict(env=env, args=settings, rows=rows), indent=1, default=str))
    for r in rows:
        if r["method"] != "skipped":
            print(f"{r['scenario']:18s} bs{r['block_size']:<4d} {r['method']:11s} {r.get('variant', ''):10s} "
                  f"{r.get('ms') or float('nan'):8.3f} ms  floor {r.get('floor_ms', 0):.3f}  peak "
                  f"{r.get('peak_mb') or 0:8.0f} MB  err {r.get('rel_err', '-')}  {(r.get('error') or '')[:80]}")
    return int(any(r["method"] == "ours" and r.get("ok") is False for r in rows))


if __name__ == "__main__":
    sys.exit(main())
