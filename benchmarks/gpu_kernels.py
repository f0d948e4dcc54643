"""Which GPU kernels one step of a scenario runs, and how long each takes (issue 23, CUDA route).

    python -m benchmarks.gpu_kernels --out DIR [--scenarios shared_prefix,...] [--block-sizes 128]
        [--variants "name=shared_rows:64;..."]

Per scenario, block size and variant (`speed14`'s variant syntax, unique-kernel knobs included): the
step planned at those options, compiled for its bucket, then `--reps` calls of the compiled function
under `torch.profiler` (CUDA activity). Printed and written to DIR/gpu_kernels.json: the kernels of
one call (name, count, total us), their sum, and the replayed CUDA graph's time beside it: a step
far above its kernels' sum is launch-bound, one near it is kernel-bound. No checking here (speed14
checks every variant against the reference).
"""
from __future__ import annotations

import argparse
import gc
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import scenarios as sc_mod
from benchmarks.speed14 import D, _variants, case_tensors, unique_knobs
from benchmarks.timing import capture, time_ms
from vllm_gaudi_unified import graphs
from vllm_gaudi_unified.batch import UnifiedBatch
from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.tools.cli import Parser
from vllm_gaudi_unified.graphs import compiled_attention
from vllm_gaudi_unified.plan import PlanOptions, plan_step


def kernels(fn, reps: int) -> list[tuple[str, int, float]]:
    """(kernel name, calls per step, us per step) of `fn`'s CUDA kernels, the longest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[ev.name] += 1
    rows = [(name, count[name] // reps, total[name] / reps) for name in total]
    return sorted(rows, key=lambda r: -r[2])


def one(sc, bs: int, name: str, over: dict, reps: int, device) -> dict:
    lay, q, k, v, kc, vc = case_tensors(sc, bs, device)
    over = dict(over)
    with unique_knobs(over):
        opts = replace(PlanOptions(), **over)
        plan = plan_step(list(sc.query_lens), list(sc.context_lens), lay.block_table, bs, num_blocks=lay.num_blocks,
                         options=opts)
        batch = UnifiedBatch.from_plan(plan, device)
        fn = lambda: compiled_attention(q, k, v, kc, vc, batch, D ** -0.5)  # noqa: E731
        fn()
        replay, _ = capture(fn, device)
        graph_ms = time_ms(replay, device)
        rows = kernels(fn, reps)
    graphs.clear()
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return dict(scenario=sc.name, block_size=bs, variant=name, bucket=str(plan.bucket), options=str(plan.options),
                graph_ms=graph_ms, kernel_us=sum(r[2] for r in rows), launches=sum(r[1] for r in rows),
                kernels=[dict(name=n[:160], calls=c, us=u) for n, c, u in rows])


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=output_dir, default="out/gpu_kernels")
    p.add_argument("--scenarios", default="shared_prefix,parallel_sampling,decode_ragged,decode_256x2k")
    p.add_argument("--block-sizes", default="128")
    p.add_argument("--variants", default="")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=12, help="kernels printed per case")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = args.scenarios.split(",")
    results = []
    for sc in [s for s in sc_mod.scenarios() if s.name in wanted]:
        for bs in (int(x) for x in args.block_sizes.split(",")):
            for name, over in _variants(args.variants).items():
                try:
                    r = one(sc, bs, name, over, args.reps, device)
                except Exception as exc:  # noqa: BLE001
                    r = dict(scenario=sc.name, block_size=bs, variant=name, error=f"{type(exc).__name__}: {exc}"[:400])
                    print(r, flush=True)
                    results.append(r)
                    continue
                results.append(r)
                print(f"== {sc.name} bs{bs} {name}: graph {r['graph_ms']:.3f} ms, kernels {r['kernel_us']:.1f} us "
                      f"in {r['launches']} launches, bucket {r['bucket']}", flush=True)
                for kr in r["kernels"][:args.top]:
                    print(f"   {kr['us']:9.1f} us  x{kr['calls']:<3d} {kr['name'][:110]}", flush=True)
                (out / "gpu_kernels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
