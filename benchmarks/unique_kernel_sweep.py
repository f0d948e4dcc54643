"""The unique path's Triton kernel (paths/unique_kernel.py) on the GPU: its constants, and the routes.

    python -m benchmarks.unique_kernel_sweep --out DIR [--scenarios decode_256x2k,decode_64x8k]
        [--block-sizes 16,128] [--sweep]

Per decode scenario and block size, on the same random q/k/v and bf16 caches, a step timed as a
replayed CUDA graph (`unified_attention`, default plan options) over:

* the bf16 cache by its default route (`route=default`: the routing's own choice) and through the kernel
  (`route=kernel`);
* fp8 e4m3 and e5m2 copies (per-tensor scales) by the default route (the kernel) and by the route
  without it (`route=dequantize`: flash or the tiles over `read_blocks`' dequantized gathers);
* e4m3 with per-(slot, KV head) scales as vllm-gaudi stores them (`scales=per_slot_head`);
* with `--sweep`, e4m3 through the kernel at every (keys per step, warps, keys per split).

Each is checked against the float32 reference over the (dequantized) cache before it is timed.
Rows go to DIR/unique_kernel_sweep.json after every case.
"""
from __future__ import annotations

import itertools
import json
import traceback
from pathlib import Path

import torch

from benchmarks import baselines, scenarios as sc_mod
from benchmarks.suite import _rel_err, environment, unique_route
from benchmarks.timing import capture, time_ms
from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.paths import unique
from vllm_gaudi_unified.paths.kv_quant import FP8_DTYPES, dequantize, quantize
from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.tools.cli import Parser

#: Run 1 (2026-11-23) swept keys 32/64/128 x warps 4/8 x split keys 256/512/2048: 128, 4, 2048 won everywhere.
SWEEP = {"KERNEL_KEYS": (128, 256), "KERNEL_WARPS": (4, 8), "KERNEL_SPLIT_KEYS": (2048, 8192),
         "KERNEL_STAGES": (2, 3, 4)}


#: This script's route names -> `suite.unique_route`'s ('dequantize': an fp8 cache without the kernel).
ROUTES = {"default": "default", "kernel": "kernel", "dequantize": "torch"}


def run(args) -> list[dict]:
    device = torch.device("cuda")
    hq, hkv, d = 32, 8, 128
    rows, out_path = [], Path(args.out) / "unique_kernel_sweep.json"
    defaults = {k: getattr(unique, k) for k in SWEEP}
    for sc in sc_mod.scenarios():
        if sc.name not in args.scenarios.split(","):
            continue
        for bs in map(int, args.block_sizes.split(",")):
            lay = sc_mod.layout(sc, bs)
            ql, cl = list(sc.query_lens), list(sc.context_lens)
            batch = build_unified_batch(ql, cl, lay.block_table, bs, num_blocks=lay.num_blocks, device=device)
            g = torch.Generator(device=device).manual_seed(0)
            rand = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
            t = sc.num_tokens
            q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
            kc, vc = rand(lay.num_blocks, bs, hkv, d), rand(lay.num_blocks, bs, hkv, d)
            blocks = [torch.as_tensor(b, device=device) for b in lay.owned]
            cases = [("bf16", "none", route, {}) for route in ("default", "kernel")]
            cases += [(f, "tensor", route, {}) for f in ("fp8_e4m3", "fp8_e5m2") for route in ("default", "dequantize")]
            cases += [("fp8_e4m3", "per_slot_head", "default", {})]
            if args.sweep:
                cases += [("fp8_e4m3", "tensor", "kernel", dict(zip(SWEEP, c)))
                          for c in itertools.product(*SWEEP.values())]
            caches = {}
            for cache_dtype, scales, route, consts in cases:
                row = dict(scenario=sc.name, block_size=bs, cache=cache_dtype, scales=scales, route=route,
                           phase=batch.phase, unique_layout=batch.unique_layout,
                           **{k.lower(): v for k, v in consts.items()})
                rows.append(row)
                try:
                    key = (cache_dtype, scales)
                    if key not in caches:
                        caches.clear()
                        caches[key] = _caches(cache_dtype, scales, kc, vc, q, k, v, ql, cl, blocks, d)
                    kq, vq, kw, ref = caches[key]
                    for name, value in defaults.items():
                        setattr(unique, name, consts.get(name, value))
                    fn = lambda: unified_attention(q, k, v, kq, vq, batch, d ** -0.5, **kw)  # noqa: E731
                    with unique_route(ROUTES[route]):
                        replay, out = capture(fn, device)
                    out.fill_(float("nan"))
                    replay()
                    row["rel_err"] = _rel_err(out, ref)
                    row["ok"] = row["rel_err"] <= 2e-2
                    if row["ok"]:
                        row["ms"] = time_ms(replay, device)
                    del replay, out
                except Exception as exc:  # noqa: BLE001 - a failing case is reported, not fatal
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
                    traceback.print_exc()
                finally:
                    for name, value in defaults.items():
                        setattr(unique, name, value)
                print(json.dumps(row), flush=True)
                out_path.write_text(json.dumps({"env": environment(device), "rows": rows}, indent=1))
            del caches, kc, vc
            torch.cuda.empty_cache()
    return rows


def _caches(cache_dtype, scales, kc, vc, q, k, v, ql, cl, blocks, d):
    """(key cache, value cache, scale kwargs, float32 reference over the dequantized caches)."""
    if cache_dtype == "bf16":
        return kc, vc, {}, baselines.reference_fp32(q, k, v, kc, vc, ql, cl, blocks, d ** -0.5)
    fp8 = FP8_DTYPES[cache_dtype]
    top = torch.finfo(fp8).max
    if scales == "tensor":
        ks, vs = (float(c.abs().amax()) / top for c in (kc, vc))
    else:  # vllm-gaudi's dynamic scales: one per (slot, KV head)
        ks, vs = (c.float().abs().amax(-1, keepdim=True).clamp(min=1e-6) / top for c in (kc, vc))
    kq, vq = quantize(kc, fp8, ks), quantize(vc, fp8, vs)
    ref = baselines.reference_fp32(q, k, v, dequantize(kq, ks, q.dtype), dequantize(vq, vs, q.dtype), ql, cl,
                                   blocks, d ** -0.5)
    return kq, vq, dict(k_scale=ks, v_scale=vs), ref


def main(argv=None) -> None:
    p = Parser(prog="benchmarks.unique_kernel_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=output_dir, default="out/unique_kernel", help="folder for unique_kernel_sweep.json")
    p.add_argument("--scenarios", default="decode_256x2k,decode_64x8k", help="comma-separated scenario names")
    p.add_argument("--block-sizes", default="16,128", help="comma-separated KV cache block sizes")
    p.add_argument("--sweep", action="store_true", help="also time the kernel at every constant in SWEEP")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print("\n".join(table(run(args))))


def table(rows) -> list[str]:
    """One line per row: case, route, constants, ms, relative error."""
    out = ["scenario bs cache scales route keys warps split_keys stages ms rel_err"]
    for r in rows:
        case = " ".join(str(r.get(k, "-")) for k in ("scenario", "block_size", "cache", "scales", "route",
                                                    "kernel_keys", "kernel_warps", "kernel_split_keys",
                                                    "kernel_stages"))
        out.append(case + (f" {r['ms']:.3f} {r['rel_err']:.4f}" if r.get("ms")
                           else f" failed: {r.get('error', r.get('rel_err'))}"))
    return out


if __name__ == "__main__":
    main()
