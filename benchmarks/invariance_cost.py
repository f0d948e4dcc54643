"""Cost of the batch-invariant mode: the suite's scenarios timed in the default and the invariant mode.

    python -m benchmarks.invariance_cost [--scale 0.0625] [--device cpu|cuda] [--route cuda|gaudi]
                                         [--scenarios NAME ...] [--out results.json]

Scenarios: the suite's (`benchmarks/scenarios.py: scenarios`; issue 7's shapes: 32 query heads, 8 KV
heads, head size 128, bf16, block size 16), speculative verify steps (`verify_scenarios`: 64 x (1 + 3)
over 3k, ragged drafts), and an MLA decode (`mla_decode_64x4k`: 64 decodes over 4k at DeepSeek-V3's
latent shapes, 128 heads, latent 512 + rope 64, block 128, through `mla.mla_attention`). Prints a
markdown table with one column per mode, the ratio and each mode's peak memory (CUDA: bytes one eager
call allocates beyond its inputs).

`--route gaudi` is what a Gaudi runs, as in every other benchmark here: the CUDA-only kernels off
(`paths/fused.gaudi_route()`, `VLLM_GAUDI_UNIFIED_GAUDI_ROUTE=1`: no flash varlen, no Triton), the
fused SDPA calls kept (torch SDPA and cuDNN with statistics standing in for FusedSDPA), in both modes.
On CUDA both modes are also timed as CUDA graph replays (one graph per step). A mode that runs out of
memory is recorded as such and the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from dataclasses import replace

import torch

from benchmarks import scenarios as sc_mod
from benchmarks.timing import capture, peak_bytes, time_ms
from vllm_gaudi_unified import PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.mla import mla_attention
from vllm_gaudi_unified.paths import fused

#: The MLA decode's shapes (DeepSeek-V3: 128 heads, latent 512 + rope 64; scale (128 + 64) ** -0.5).
MLA_HEADS, MLA_LATENT, MLA_ROPE, MLA_BLOCK = 128, 512, 64, 128


def all_scenarios(scale: float) -> list:
    """The suite's scenarios, the verify steps, and the MLA decode (a `Scenario` named `mla_*`)."""
    s = lambda n: max(1, int(round(n * scale)))  # noqa: E731
    mla = sc_mod.Scenario("mla_decode_64x4k", "MLA decode 64 x 4k", (1,) * s(64), (s(4096) - 1,) * s(64))
    return sc_mod.scenarios(scale) + sc_mod.verify_scenarios(scale) + [mla]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="shrink request counts and lengths (CPU: 0.0625)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--route", choices=("cuda", "gaudi"), default="cuda",
                   help="cuda: the fused kernels where they apply; gaudi: what a Gaudi runs (CUDA-only kernels off)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (the MLA decode: 128)")
    p.add_argument("--invariant-rows", type=int, default=None, help="PlanOptions.invariant_rows (default: its own)")
    p.add_argument("--scenarios", nargs="*", default=None, help="names to run (default: all)")
    p.add_argument("--commit", default="", help="recorded in each row (the checkout measured)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    default = PlanOptions()
    invariant = replace(default, batch_invariant=True)
    if args.invariant_rows:
        invariant = replace(invariant, invariant_rows=args.invariant_rows)
    rows = []
    route = fused.gaudi_route() if args.route == "gaudi" else contextlib.nullcontext()
    with route:
        for sc in all_scenarios(args.scale):
            if args.scenarios and sc.name not in args.scenarios:
                continue
            row = dict(scenario=sc.name, device=str(device), route=args.route, dtype=args.dtype, scale=args.scale,
                       invariant_rows=invariant.invariant_rows, commit=args.commit,
                       date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       torch=torch.__version__)
            if device.type == "cuda":
                row["gpu"] = torch.cuda.get_device_name(device)
            _run_scenario(sc, args, device, dtype, default, invariant, row)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # after every scenario: a run stopped early keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    _print_table(rows, device.type == "cuda")
    return 0


def _step(sc, args, device, dtype):
    """The scenario's inputs: (query rows, block size, call(batch) -> output)."""
    mla = sc.name.startswith("mla_")
    bs = MLA_BLOCK if mla else args.block_size
    lay = sc_mod.layout(sc, bs)
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    t = sc.num_tokens
    if mla:
        width = MLA_LATENT + MLA_ROPE
        q, latent, cache = rand(t, MLA_HEADS, width), rand(t, width), rand(lay.num_blocks, bs, width)
        scale = (128 + MLA_ROPE) ** -0.5
        return lay, bs, lambda b: mla_attention(q, latent, cache, b, scale, MLA_LATENT)
    hq, hkv, d = 32, 8, 128
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    kc, vc = rand(lay.num_blocks, bs, hkv, d), rand(lay.num_blocks, bs, hkv, d)
    return lay, bs, lambda b: unified_attention(q, k, v, kc, vc, b, d ** -0.5)


def _run_scenario(sc, args, device, dtype, default, invariant, row) -> None:
    lay, bs, call = _step(sc, args, device, dtype)
    outs = {}
    for mode, opts in (("default", default), ("invariant", invariant)):
        batch = fn = None
        try:
            batch = build_unified_batch(list(sc.query_lens), list(sc.context_lens), lay.block_table, bs,
                                        num_blocks=lay.num_blocks, options=opts, device=device)
            fn = lambda b=batch: call(b)  # noqa: E731
            outs[mode] = fn()
            row[f"{mode}_work"] = batch.work_planned.total
            if device.type == "cuda":
                row[f"{mode}_peak_mb"] = peak_bytes(fn, device) / 2**20
            row[f"{mode}_ms"] = time_ms(fn, device, reps=5 if device.type == "cpu" else 50)
            if device.type == "cuda":
                replay, _ = capture(fn, device)
                row[f"{mode}_graph_ms"] = time_ms(replay, device)
                del replay
        except torch.OutOfMemoryError as e:
            row[f"{mode}_error"] = "out of memory: " + str(e).splitlines()[0]
        finally:
            batch = fn = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for key in ("ms", "graph_ms", "peak_mb"):
        if f"default_{key}" in row and f"invariant_{key}" in row and row[f"default_{key}"]:
            row[f"{key}_ratio"] = row[f"invariant_{key}"] / row[f"default_{key}"]
    if len(outs) == 2:
        row["max_abs_diff"] = float((outs["default"].float() - outs["invariant"].float()).abs().max())


def _print_table(rows, graph: bool) -> None:
    f = lambda r, k, fmt="{:.3f}": fmt.format(r[k]) if k in r else "–"  # noqa: E731
    head = "| scenario | default ms | invariant ms | ratio |"
    if graph:
        head += " default graph ms | invariant graph ms | ratio | default peak MiB | invariant peak MiB | ratio |"
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        line = f"| {r['scenario']} | {f(r, 'default_ms')} | {f(r, 'invariant_ms')} | {f(r, 'ms_ratio', '{:.2f}')} |"
        if graph:
            line += (f" {f(r, 'default_graph_ms')} | {f(r, 'invariant_graph_ms')} | {f(r, 'graph_ms_ratio', '{:.2f}')} |"
                     f" {f(r, 'default_peak_mb', '{:.0f}')} | {f(r, 'invariant_peak_mb', '{:.0f}')} |"
                     f" {f(r, 'peak_mb_ratio', '{:.2f}')} |")
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
