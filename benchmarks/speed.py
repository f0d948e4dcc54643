"""Device speed on both routes: our default against the same-rules peer (vllm-gaudi's algorithms), per scenario.

    python -m benchmarks.speed --out DIR [--block-sizes 16,128] [--scenarios all] [--variants ...] [--rounds N]

Per scenario and block size, on the same tensors in one process: unified attention at the
default options (and, with `--variants`, other option sets), compiled per bucket and
replayed as a CUDA graph; the same-rules peer (`benchmarks/gaudi_peer.py`) as a replayed
CUDA graph of its eager ops and compiled; the HBM / FLOP floor. Every variant is checked
against the float32 reference first (ours on a cache whose unreadable slots hold NaN/inf,
graph outputs poisoned before the checking replay). Peak MB: device memory one
(un-captured) call allocates beyond its inputs. Rows go to DIR/speed.json after every case; `python -m benchmarks.report` tabulates them
(docs/benchmarks.md).
`--variants 'gaudi=gaudi:1'` adds the Gaudi route (`paths.fused.gaudi_route`: every CUDA-only kernel off).
"""
from __future__ import annotations

import contextlib
import gc
import json
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks import baselines, gaudi_peer, scenarios as sc_mod
from benchmarks.options import BF16_FLOPS, HBM_BYTES_PER_S
from benchmarks.baselines import _readable, _rel_err, capture, environment, peak_bytes, sync, time_ms
from vllm_gaudi_unified import attention, graphs
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.bucket_plans.device_options import device_kind, options_for_device
from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.tools.cli import Parser


def _variants(spec: str) -> dict:
    """name -> PlanOptions overrides of the default ('default': none). Keys that are not options:
    `gaudi:1` runs the variant on the Gaudi route (`paths.fused.gaudi_route`: no flash varlen, no
    Triton), `device_table:1` starts from the device's measured options (`device_options.py`),
    `prompt_flash:1` / `prompt_flash:0` the prompt route through flash varlen always / never (default: for
    ragged prompts, `StepPlan.prompt_ragged`), `step_bias:0` makes the prompt route's mask
    in each call instead of once per step (`UnifiedBatch.with_prompt_bias`, untimed, as the peer's
    `attn_bias`; both runners make it once per step)."""
    out = {"default": {}}
    for item in filter(None, spec.split(";")):
        name, _, kv = item.partition("=")
        out[name] = {k: (v if k in ("unique_layout", "prompt_route") else bool(int(v))
                         if k in ("fused_kernels", "gaudi", "device_table", "prompt_flash", "step_bias") else int(v))
                     for k, v in (p.split(":") for p in kv.split(",") if p)}
    return out


#: Variant keys that set module constants of the paths (the unique kernel's; `prompt_split:0` / `:1` the prompt
#: route's one call with the full bias / its split form, whatever the grid's size) for that variant alone: key -> (module of
#: `vllm_gaudi_unified.paths`, constant).
UNIQUE_KNOBS = {"uk_split": ("unique", "KERNEL_SPLIT_KEYS"), "uk_max": ("unique", "KERNEL_MAX_SPLITS"),
                "uk_keys": ("unique", "KERNEL_KEYS"), "uk_warps": ("unique", "KERNEL_WARPS"),
                "uk_stages": ("unique", "KERNEL_STAGES"), "uk_progs": ("unique", "KERNEL_MIN_PROGRAMS"),
                "uk_minsplit": ("unique", "KERNEL_MIN_SPLIT_KEYS"), "uk_shrows": ("unique", "KERNEL_SHARED_MAX_ROWS"),
                "uk_rank": ("unique", "RANK_SORT_MAX_SLOTS"), "prompt_split": ("prompts", "SPLIT_CONTEXT")}


@contextlib.contextmanager
def unique_knobs(over: dict):
    """Within: the `UNIQUE_KNOBS` of `over` (popped from it) set on their modules."""
    import importlib

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


def _time_fn(fn, device, poison_check=None):
    """(ms, out) of a callable replayed as a CUDA graph."""
    replay, out = capture(fn, device)
    out.fill_(float("nan"))
    replay()
    sync(device)
    if poison_check is not None:
        poison_check(out)
    return replay, out


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


def _floor_ms(lay, hq, hkv, d) -> float:
    """HBM / FLOP floor of any step: every cache slot some request reads once (a shared block once),
    q/k/v/out once; score + value FLOPs of the needed pairs."""
    sc, bs = lay.scenario, lay.block_size
    slots = set()
    pairs = 0
    for blocks, q, c in zip(lay.owned, sc.query_lens, sc.context_lens):
        pos = np.arange(c)
        slots.update((blocks[pos // bs] * bs + pos % bs).tolist())
        pairs += q * c + q * (q + 1) // 2
    nbytes = 2 * len(slots) * hkv * d * 2 + sc.num_tokens * (2 * hq + 2 * hkv) * d * 2
    return max(nbytes / HBM_BYTES_PER_S, 4 * pairs * hq * d / BF16_FLOPS) * 1e3


#: The attention shapes of these benchmarks (a Llama-3-8B layer: 32 query heads, 8 KV heads, head size 128), bf16.
HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16


def case_tensors(sc, bs: int, device, lay=None):
    """A scenario's inputs at block size `bs`, the same in every benchmark that times it: (its layout,
    q, k, v `[tokens, heads, D]`, key and value caches `[blocks, bs, HKV, D]`), random from seed 0."""
    lay = lay or sc_mod.layout(sc, bs, seed=0)
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device=device, dtype=DTYPE)  # noqa: E731
    t = sc.num_tokens
    q, k, v = rand(t, HQ, D), rand(t, HKV, D), rand(t, HKV, D)
    return lay, q, k, v, rand(lay.num_blocks, bs, HKV, D), rand(lay.num_blocks, bs, HKV, D)


def run_case(sc, bs, args, device, rows, lay=None):
    from vllm_gaudi_unified import PlanOptions, plan_step
    from vllm_gaudi_unified.attention import unified_attention
    from vllm_gaudi_unified.batch import UnifiedBatch
    from vllm_gaudi_unified.graphs import compiled_attention

    hq, hkv, d = HQ, HKV, D
    lay, q, k, v, kc, vc = case_tensors(sc, bs, device, lay)
    ql, cl = list(sc.query_lens), list(sc.context_lens)
    scale = d ** -0.5
    blocks = [torch.as_tensor(b, device=device) for b in lay.owned]
    floor_ms = _floor_ms(lay, hq, hkv, d)
    base = dict(scenario=sc.name, title=sc.title, block_size=bs, floor_ms=floor_ms, triton_ms=None)
    ref = baselines.reference_fp32(q, k, v, kc, vc, ql, cl, blocks, scale)
    dead = ~_readable(lay, device)
    for name, over in (_variants(args.variants).items() if "ours" in args.methods else ()):
        if time.time() - args.start > args.time_budget:
            break
        row = dict(base, method="ours", variant=name, options=over, variant_over=dict(over))
        rows.append(row)
        route = knobs = contextlib.nullcontext()
        try:
            # What a user gets: the default options (the same on every device), then the variant's.
            over = dict(over)
            gaudi, table_ = over.pop("gaudi", False), over.pop("device_table", False)
            step_bias = over.pop("step_bias", True)
            attention.PROMPT_FLASH = over.pop("prompt_flash", None)
            kind = device_kind(device.type, torch.cuda.get_device_name(device)) if table_ else ""
            knobs = unique_knobs(over)
            knobs.__enter__()
            opts = replace(options_for_device(kind, PlanOptions()), **over)
            route = fused.gaudi_route() if gaudi else contextlib.nullcontext()
            route.__enter__()
            row["options"] = str(opts)
            if name == "dense":  # the dense design (benchmarks/trace_work.py) as a plan for the same device code
                from benchmarks.trace_work import dense_plan

                plan = dense_plan(ql, cl, lay.block_table, bs, lay.num_blocks)
            else:
                plan = plan_step(ql, cl, lay.block_table, bs, num_blocks=lay.num_blocks, options=opts)
                t0 = time.perf_counter()
                for _ in range(5):
                    plan_step(ql, cl, lay.block_table, bs, num_blocks=lay.num_blocks, options=opts)
                row["plan_ms"] = (time.perf_counter() - t0) / 5 * 1e3
            batch = UnifiedBatch.from_plan(plan, device)
            if step_bias:
                batch = batch.with_prompt_bias(q.dtype)
            row.update(bucket=str(plan.bucket), unique_layout=plan.unique_layout)
            fn = (lambda: compiled_attention(q, k, v, kc, vc, batch, scale)) if args.compile else \
                (lambda: unified_attention(q, k, v, kc, vc, batch, scale))
            t0 = time.time()
            fn()
            row["compile_s"] = time.time() - t0
            row["peak_mb"] = peak_bytes(fn, device) / 2**20
            clean_k, clean_v = kc[dead].clone(), vc[dead].clone()
            kc[dead], vc[dead] = float("nan"), float("inf")
            try:
                replay, out = _time_fn(fn, device)
                row["rel_err"] = _rel_err(out, ref)
            finally:
                kc[dead], vc[dead] = clean_k, clean_v
            row["ok"] = row["rel_err"] <= 1e-2
            if row["ok"]:
                row["ms"] = time_ms(replay, device)
            del replay, out
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
            traceback.print_exc()
        finally:
            route.__exit__(None, None, None)
            knobs.__exit__(None, None, None)
            attention.PROMPT_FLASH = None
        graphs.clear()
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[{sc.name} bs{bs} ours/{name}] {row.get('ms', '-')} ms err {row.get('rel_err', '-')}", flush=True)
    if "peer" not in args.methods:
        return
    try:
        peer = gaudi_peer.build(q, k, v, kc, vc, ql, cl, lay.owned, scale)
    except Exception as exc:  # noqa: BLE001
        rows.append(dict(base, method="peer", variant="-", ok=False, error=f"{type(exc).__name__}: {exc}"[:400]))
        traceback.print_exc()
        return
    for var in args.peer_variants.split(","):
        row = dict(base, method="peer", variant=var)
        rows.append(row)
        try:
            fn = peer if var == "graph" else torch.compile(peer, dynamic=False)
            fn()
            row["peak_mb"] = peak_bytes(fn, device) / 2**20
            replay, out = _time_fn(fn, device)
            row["rel_err"] = _rel_err(out, ref)
            row["ok"] = row["rel_err"] <= 1e-2
            if row["ok"]:
                row["ms"] = time_ms(replay, device)
            del replay, out
        except Exception as exc:  # noqa: BLE001
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:400])
            traceback.print_exc()
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[{sc.name} bs{bs} peer/{var}] {row.get('ms', '-')} ms err {row.get('rel_err', '-')}", flush=True)


#: vLLM 0.32's Triton unified attention on the H100, block size 16 / 128, measured beside ours on the same
#: tensors by `benchmarks/triton_peer.py` (docs/benchmarks.md, "Device speed").
TRITON_MS = {"decode_256x2k": (0.750, 0.796), "decode_64x8k": (0.736, 0.751), "decode_ragged": (1.702, 1.661),
             "prefill_4x2k": (1.931, 1.856), "chunked_2x2k_6k": (6.451, 6.157), "mixed": (1.383, 1.296),
             "shared_prefix": (0.265, 0.319), "parallel_sampling": (0.061, 0.061), "scattered": (0.750, 0.801)}
def median_rows(rows: list[dict]) -> dict:
    """(scenario, block size, method, variant) -> the row of median time among that key's rounds (`--rounds`:
    rows with `round` 0, 1, ...; its `rounds_ms` lists them all). A later run of the same key (a row whose
    round does not follow the one before: another run, or a later file) replaces the earlier ones."""
    runs: dict = {}
    for r in rows:
        if r.get("ms") is None:
            continue
        key = (r["scenario"], r["block_size"], r["method"], r.get("variant"))
        run = runs.get(key)
        if run is None or r.get("round", 0) <= run[-1].get("round", 0):
            run = runs[key] = []
        run.append(r)
    out = {}
    for key, run in runs.items():
        ranked = sorted(run, key=lambda r: r["ms"])
        out[key] = dict(ranked[(len(ranked) - 1) // 2], rounds_ms=[r["ms"] for r in run])
    return out


def main(argv=None) -> int:
    p = Parser(prog="benchmarks.speed", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=output_dir, default="out/speed")
    p.add_argument("--scenarios", default="all")
    p.add_argument("--block-sizes", default="16,128")
    p.add_argument("--variants", default="", help="extra option sets: 'name=shared_rows:64,causal_tile:256;...' "
                   "(also gaudi:1, device_table:1, prompt_flash:1, and the unique kernel's constants: UNIQUE_KNOBS)")
    p.add_argument("--methods", default="ours,peer")
    p.add_argument("--peer-variants", default="graph,compiled")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="ours as a graph of eager calls")
    p.add_argument("--time-budget", type=float, default=1e9)
    p.add_argument("--rounds", type=int, default=1, help="time every case this many times, ours and the peer "
                   "in turn (each round compiles again); tables take the median round")
    p.add_argument("--trace", action="append", default=[], help="PATH:auto or PATH:i,j: also time these trace steps")
    p.add_argument("--top", type=int, default=3, help="steps per trace for PATH:auto")
    args = p.parse_args(argv)
    args.start = time.time()
    device = torch.device("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    print(json.dumps(env), flush=True)
    chosen = [s for s in sc_mod.scenarios() if args.scenarios == "all" or s.name in args.scenarios.split(",")]
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    rows: list[dict] = []
    for rnd in range(args.rounds):
        for bs in [int(x) for x in args.block_sizes.split(",")]:
            for sc in chosen:
                if time.time() - args.start > args.time_budget:
                    rows.append(dict(scenario=sc.name, block_size=bs, method="skipped", round=rnd))
                    continue
                first = len(rows)
                try:
                    run_case(sc, bs, args, device, rows)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                for r in rows[first:]:
                    r["round"] = rnd
                (out_dir / "speed.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1, default=str))
    for spec in args.trace:
        for sc, lay in trace_cases(spec, args.top):
            if time.time() - args.start > args.time_budget:
                rows.append(dict(scenario=sc.name, block_size=lay.block_size, method="skipped"))
                continue
            try:
                run_case(sc, lay.block_size, args, device, rows, lay=lay)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            (out_dir / "speed.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1, default=str))
    for r in rows:
        if r.get("method") != "skipped":
            print(f"{r['scenario']:18s} bs{r['block_size']:<4d} {r['method']:5s} {r.get('variant',''):10s} "
                  f"{r.get('ms') or float('nan'):8.3f} ms  floor {r.get('floor_ms', 0):.3f}  peak "
                  f"{r.get('peak_mb') or 0:8.0f} MB  err {r.get('rel_err', '-')}  {r.get('error', '')[:80]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
