"""Where a step's device time goes: the kernels of ours (compiled per bucket) and of the peer, per call.

    python -m benchmarks.kernel_profile --cases chunked_2x2k_6k:128,parallel_sampling:128 \
        [--variant gaudi:1,shared_rows:16] [--peer] [--top 12]

For each case: the same tensors as `benchmarks/speed14.py`, ours at the variant's options (compiled,
called eagerly so the profiler names each kernel) and, with `--peer`, vllm-gaudi's ops compiled;
`torch.profiler` over 10 calls, kernels grouped by name, device microseconds per call, largest
first. For reading where a gap comes from; the times to cite are speed14's (replayed graphs).
"""
from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace

import torch

from benchmarks import gaudi_peer, scenarios as sc_mod
from benchmarks.gpu_kernels import kernels
from benchmarks.speed14 import D, _variants, case_tensors, unique_knobs


def _kernels(fn, calls: int = 10) -> list[tuple[str, int, float]]:
    """`gpu_kernels.kernels` of `fn` over `calls` calls, after three to warm it up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return kernels(fn, calls)


def _print(label: str, rows, top: int) -> None:
    total = sum(r[2] for r in rows)
    launches = sum(r[1] for r in rows)
    print(f"== {label}: {total:.1f} us per call, {launches:.0f} kernels", flush=True)
    for name, n, us in rows[:top]:
        print(f"   {us:8.1f} us  x{n:4.1f}  {name[:110]}", flush=True)


def main(argv=None) -> int:
    from vllm_gaudi_unified import PlanOptions, plan_step
    from vllm_gaudi_unified.batch import UnifiedBatch
    from vllm_gaudi_unified.graphs import clear, compiled_attention
    from vllm_gaudi_unified.paths import fused

    p = argparse.ArgumentParser(prog="benchmarks.kernel_profile", description=__doc__.splitlines()[0])
    p.add_argument("--cases", required=True, help="scenario:block_size,...")
    p.add_argument("--variant", default="gaudi:1", help="options as in speed14's --variants (one set)")
    p.add_argument("--peer", action="store_true")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    over = _variants("v=" + args.variant)["v"]
    gaudi = over.pop("gaudi", False)
    step_bias = over.pop("step_bias", True)  # the prompt mask made once per step, untimed (speed14's)
    # module constants of the paths, for the whole run: the context manager is kept (an unreferenced one is
    # collected at once, and its exit put the constants back: the knobs never applied before)
    knobs = unique_knobs(over)
    knobs.__enter__()
    device = torch.device("cuda")
    by_name = {s.name: s for s in sc_mod.scenarios()}
    for case in args.cases.split(","):
        name, _, bs = case.partition(":")
        sc, bs = by_name[name], int(bs)
        lay, q, k, v, kc, vc = case_tensors(sc, bs, device)
        scale = D ** -0.5
        opts = replace(PlanOptions(), **over)
        route = fused.gaudi_route() if gaudi else contextlib.nullcontext()
        with route:
            plan = plan_step(list(sc.query_lens), list(sc.context_lens), lay.block_table, bs,
                             num_blocks=lay.num_blocks, options=opts)
            batch = UnifiedBatch.from_plan(plan, device)
            if step_bias:
                batch = batch.with_prompt_bias(q.dtype)
            _print(f"{name} bs{bs} ours {args.variant} bucket {plan.bucket}",
                   _kernels(lambda: compiled_attention(q, k, v, kc, vc, batch, scale)), args.top)
        clear()
        torch._dynamo.reset()
        if args.peer:
            peer = gaudi_peer.build(q, k, v, kc, vc, list(sc.query_lens), list(sc.context_lens), lay.owned, scale)
            _print(f"{name} bs{bs} peer compiled", _kernels(torch.compile(peer, dynamic=False)), args.top)
            torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
