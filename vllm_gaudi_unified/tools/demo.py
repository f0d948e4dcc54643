"""`vllm-gaudi-unified demo`: a serving workload through plan -> run -> merge on the CPU.

A simulated vLLM v1 scheduler (requests arriving, chunked prefills, shared
system prompts, parallel sampling, decodes, requests finishing, block ids spread
by a free-list allocator) produces steps. Each step: random q/k/v for the new
tokens, `build_unified_batch`, `unified_attention` against a paged KV cache, a
check against the float64 dense reference. The new K/V are written into their
cache slots first, as vLLM does in every layer (a parallel sample may get a
prefix-cache hit on blocks its sibling computes in the same step), and later
steps read them back as context.
Unwritten cache slots hold NaN: reading one would show as a NaN error.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from vllm_gaudi_unified.flags import POSITIVE, SEED

DEFAULTS = dict(steps=40, seed=0, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, num_blocks=1024,
                num_qo_heads=8, num_kv_heads=2, head_dim=64)


@dataclass
class DemoConfig:
    steps: int
    seed: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    check: bool = True


def run_demo(cfg: DemoConfig, out=print) -> dict:
    """Run the workload; print one line per step; return a summary."""
    import torch

    from vllm_gaudi_unified import build_unified_batch, unified_attention
    from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
    from vllm_gaudi_unified.bucket_plans.workloads import WorkloadConfig
    from vllm_gaudi_unified.reference import reference_attention

    sched = SchedulerConfig(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=2048,
                            num_blocks=cfg.num_blocks)
    workload = WorkloadConfig(num_requests=10 * cfg.max_num_seqs, arrival_rate=1.5, prompt_median=120,
                              prompt_max=600, output_median=24, output_max=80, prefix_share=0.6,
                              prefix_lens=(64, 160), followup_share=0.2, parallel_share=0.15, parallel_n=3)
    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    scale = cfg.head_dim ** -0.5
    out(f"{'step':>4} {'reqs':>4} {'tokens':>6} {'phase':>5}  {'bucket':<38} {'shared':>6} {'unique':>6} "
        f"{'layout':<6} {'max err':>9} {'plan us':>8} {'attn ms':>8}")
    worst, phases, plan_us, attn_ms = 0.0, set(), [], []
    for i, step in enumerate(Simulator(sched, workload, cfg.seed).steps(cfg.steps)):
        table = step.block_table()
        t = int(step.query_lens.sum())
        q = torch.randn(t, cfg.num_qo_heads, cfg.head_dim, generator=g).to(dtype)
        k = torch.randn(t, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
        v = torch.randn(t, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
        # vLLM writes the step's new K/V before attention (a sibling may hit blocks computed this very step).
        _write_new_tokens(key_cache, value_cache, k, v, step, table)
        t0 = time.perf_counter()
        batch = build_unified_batch(step.query_lens, step.context_lens, table, cfg.block_size,
                                    num_blocks=cfg.num_blocks)
        t1 = time.perf_counter()
        result = unified_attention(q, k, v, key_cache, value_cache, batch, scale)
        t2 = time.perf_counter()
        err = float("nan")
        if cfg.check:
            ref = reference_attention(q, k, v, key_cache, value_cache, step.query_lens, step.context_lens, table,
                                      scale)
            err = (result.double() - ref).abs().max().item()
            worst = max(worst, err) if err == err else float("nan")
        phases.add(batch.phase)
        plan_us.append((t1 - t0) * 1e6)
        attn_ms.append((t2 - t1) * 1e3)
        s = batch.shape
        out(f"{i:>4} {len(step.query_lens):>4} {t:>6} {batch.phase:>5}  {str(batch.bucket):<38} "
            f"{s.num_shared_blocks:>6} {s.num_unique_blocks:>6} {batch.unique_layout:<6} {err:>9.2e} "
            f"{plan_us[-1]:>8.0f} {attn_ms[-1]:>8.2f}")
    summary = dict(steps=len(plan_us), phases=sorted(phases), max_error=worst,
                   plan_us_median=sorted(plan_us)[len(plan_us) // 2],
                   attention_ms_median=sorted(attn_ms)[len(attn_ms) // 2])
    out(f"\n{summary['steps']} steps, phases seen {', '.join(summary['phases'])}; max error vs float64 "
        f"reference {worst:.2e}; median planning {summary['plan_us_median']:.0f} us, median attention "
        f"{summary['attention_ms_median']:.2f} ms (CPU, {cfg.dtype})")
    return summary


def _write_new_tokens(key_cache, value_cache, k, v, step, table) -> None:
    """The cache write vLLM does for the new tokens (its slot mapping), vectorised."""
    import numpy as np

    bs = key_cache.shape[1]
    req = np.repeat(np.arange(len(step.query_lens)), step.query_lens)
    pos = step.context_lens[req] + (np.arange(req.size) - np.repeat(np.cumsum(step.query_lens) - step.query_lens,
                                                                     step.query_lens))
    blocks, slots = table[req, pos // bs], pos % bs
    key_cache[blocks, slots] = k
    value_cache[blocks, slots] = v


def _run(args) -> int:
    if args.num_qo_heads % args.num_kv_heads:
        raise ValueError(f"--num-qo-heads {args.num_qo_heads} must be a multiple of --num-kv-heads "
                         f"{args.num_kv_heads}")
    cfg = DemoConfig(**{k: getattr(args, k) for k in DEFAULTS}, dtype=args.dtype, check=not args.no_check)
    summary = run_demo(cfg)
    tol = 1e-4 if cfg.dtype == "float32" else 1e-2
    if cfg.check and not summary["max_error"] <= tol:
        print(f"FAILED: max error {summary['max_error']:.2e} above {tol:g}")
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run a simulated serving workload through unified attention on the CPU",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    helps = dict(steps="scheduler steps to run", seed="seed of the workload and of the random q/k/v",
                 block_size="KV cache block size", max_num_seqs="most requests in a step",
                 max_num_batched_tokens="token budget of a step", num_blocks="KV cache blocks",
                 num_qo_heads="query heads", num_kv_heads="KV heads", head_dim="head size")
    for name, default in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=SEED if name == "seed" else POSITIVE, default=default,
                       help=f"{helps[name]} (default: {default})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default="float32",
                   help="dtype of q/k/v and the cache (default: float32)")
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    p.set_defaults(func=_run)
