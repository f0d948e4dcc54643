"""Why the batch-invariant prompt steps cost 2.9x the default: the bad-value count's scan (CUDA).

    python -m benchmarks.invariance_scan [--commit REV] [--out results.json]

`paths/fused.clean_causal_values` counts, per row, the non-finite values among its causal keys with a
cumulative sum. Over dim 0 of a `[T, Hkv]` tensor torch runs that scan on CUDA as one thread per KV head
walking all T tokens in turn; over one flat vector it is one parallel (CUB) pass. This times both forms
(CUDA events, median of eager calls; `old_count` is the form the invariant prompts ran before) at T = 256
to 8192, one own call of a 2k prompt against one call over four prompts, and the invariant step of
prefill 4 x 2k with each form, with its top kernels from torch.profiler (docs/batch_invariance.md, Cost).
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from benchmarks import scenarios as sc_mod
from benchmarks.mla_decode import timed
from vllm_gaudi_unified import PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.files import write_text
from vllm_gaudi_unified.paths import fused

DEV = torch.device("cuda")


def old_count(v, seg_start, window):
    """`fused.clean_causal_values` as it was: the scan over dim 0 of `[T, Hkv]`."""
    t = v.shape[0]
    finite = torch.isfinite(v)
    bad = (~finite.all(-1)).to(torch.int32)
    total = torch.cat([bad.new_zeros(1, bad.shape[1]), torch.cumsum(bad, 0)])
    i = torch.arange(t, device=v.device)
    lo = seg_start[:t].to(i.dtype)
    if window is not None:
        lo = torch.maximum(lo, i - (window - 1))
    seen = total[i + 1] - total[lo]
    return torch.where(finite, v, torch.zeros((), dtype=v.dtype, device=v.device)), seen > 0


def ms(fn, reps: int = 30) -> float:
    """Median milliseconds of one eager call between CUDA events (`mla_decode.timed`)."""
    return timed(fn, iters=reps)


def top_kernels(fn, n: int = 8) -> list:
    """(kernel, calls, device ms) of one call, most time first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [(e.key[:90], e.count, round(e.device_time_total / 1e3, 4)) for e in evs[:n]]


def measure() -> dict:
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    g = torch.Generator(device=DEV).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=DEV, dtype=torch.bfloat16, generator=g)  # noqa: E731
    new_count = fused.clean_causal_values
    for t in (256, 2048, 4096, 8192):
        v, seg = rand(t, 8, 128), (torch.arange(t + 8, device=DEV) // 2048) * 2048
        a, b = old_count(v, seg, None), new_count(v, seg, None)
        res[f"clean_T{t}"] = {"old_ms": ms(lambda: old_count(v, seg, None)), "new_ms": ms(lambda: new_count(v, seg, None)),
                              "same": bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))}
        x = torch.zeros(t, 8, dtype=torch.int32, device=DEV)
        res[f"cumsum_dim0_T{t}_ms"] = ms(lambda: torch.cumsum(x, 0))
    q, k, v = rand(8192, 32, 128), rand(8192, 8, 128), rand(8192, 8, 128)
    one = lambda x: x[:2048].unsqueeze(0).transpose(1, 2)  # noqa: E731  (own_rows' token-major view)
    four = lambda x: x.view(4, 2048, *x.shape[1:]).transpose(1, 2)  # noqa: E731
    res["own_call_1x2k_ms"] = ms(lambda: fused.sdpa_lse(one(q), one(k), one(v), None, 128 ** -0.5, causal=True))
    res["call_4x2k_ms"] = ms(lambda: fused.sdpa_lse(four(q), four(k), four(v), None, 128 ** -0.5, causal=True))
    lay = sc_mod.layout(next(s for s in sc_mod.scenarios(1.0) if s.name == "prefill_4x2k"), 16)
    cache = rand(lay.num_blocks, 16, 8, 128)
    batch = build_unified_batch([2048] * 4, [0] * 4, lay.block_table, 16, num_blocks=lay.num_blocks,
                                options=PlanOptions(batch_invariant=True), device=DEV)
    step = lambda: unified_attention(q, k, v, cache, cache, batch, 128 ** -0.5)  # noqa: E731
    try:
        for name, count in (("old", old_count), ("new", new_count)):
            fused.clean_causal_values = count
            res[f"step_{name}_ms"], res[f"step_{name}_kernels"] = ms(step, 20), top_kernels(step)
    finally:
        fused.clean_causal_values = new_count
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.invariance_scan", description=__doc__.splitlines()[0])
    p.add_argument("--commit", default="", help="recorded in the results (the checkout measured)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    res = measure()
    res.update(commit=args.commit, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    print(json.dumps(res, indent=1))
    if args.out:
        write_text(args.out, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
