"""Where a decode step's time goes on vLLM's CPU platform: the plugin against vLLM's own CPU attention.

One engine in this process (`LLM`, VLLM_ENABLE_V1_MULTIPROCESSING=0) on `serving_cpu`'s tiny GQA Llama
and settings (8 requests of 128 prompt tokens decoding together, block 128, eager, float32). Every
decode-only step (each request one token) is timed whole (`LLMEngine.step`) and in parts, by wrapping
the functions that make it up with `perf_counter` accumulators (inclusive times, a few us of wrapper
cost each): vLLM's input preparation and metadata building, the model forward and, inside it, each
attention layer's backend `forward` (for the plugin also its cache write, checks, layout and kernel),
and sampling. `--torch-profile` adds a `torch.profiler` table of the aten ops of the timed steps.
`--staggered` times a server's steady state instead: a request joins as one finishes, so most steps
run a prompt beside the decodes (what `vllm bench serve` at concurrency 8 gives).

Run each backend in its own process (vLLM keeps global state per process), on one core:

    VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 python -m benchmarks.decode_profile --backend vllm
    VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=1 python -m benchmarks.decode_profile --backend plugin
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from vllm_gaudi_unified.files import output_path, write_text
from vllm_gaudi_unified.tools.cli import Parser

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, BLOCK_SIZE, CONCURRENCY = 128, 128, 8

TIMES: dict[str, float] = defaultdict(float)  # name -> seconds inside it, over the timed decode steps
CALLS: dict[str, int] = defaultdict(int)
TIMING = [False]


def timed(owner, attr: str, name: str) -> None:
    """Replace `owner.attr` by a wrapper adding its wall time to TIMES[name] while TIMING."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not TIMING[0]:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
            CALLS[name] += 1

    setattr(owner, attr, wrapper)


def instrument(backend: str) -> None:
    """The wrappers of both sides; a plugin function is wrapped where its callers look it up."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for attr, name in (("execute_model", "runner.execute_model"), ("_update_states", "runner._update_states"),
                       ("_prepare_inputs", "runner._prepare_inputs"),
                       ("_build_attention_metadata", "runner._build_attention_metadata"),
                       ("_model_forward", "runner._model_forward"), ("sample_tokens", "runner.sample_tokens")):
        timed(GPUModelRunner, attr, name)
    if backend == "vllm":
        from vllm.v1.attention.backends import cpu_attn

        timed(cpu_attn.CPUAttentionMetadataBuilder, "build", "attn.builder.build")
        timed(cpu_attn.CPUAttentionBackendImpl, "forward", "attn.forward")
        timed(cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update", "attn.kv_cache_update")
        timed(cpu_attn.ops, "cpu_attention_with_kv_cache", "attn.forward/kernel")
        return
    from vllm_gaudi_unified import attention
    from vllm_gaudi_unified.paths import decodes
    from vllm_gaudi_unified.vllm_plugin import backend as be

    timed(be.GaudiUnifiedMetadataBuilder, "build", "attn.builder.build")
    timed(be, "step_lengths", "attn.builder.build/step_lengths")
    timed(be, "build_unified_batch", "attn.builder.build/build_unified_batch")
    timed(be.GaudiUnifiedAttentionImpl, "forward", "attn.forward")
    timed(be, "write_kv", "attn.forward/write_kv")
    timed(be, "check_inputs", "attn.forward/check_inputs")
    timed(be, "attend_step", "attn.forward/attend_step")
    timed(attention, "dense_decodes_apply", "attn.forward/attend_step/dense_decodes_apply")
    timed(attention, "dense_decodes_attention", "attn.forward/attend_step/dense_decodes")
    timed(decodes, "decode_layout", "attn.forward/attend_step/decode_layout")


def main(argv=None) -> int:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["vllm", "plugin"], required=True)
    ap.add_argument("--batches", type=int, default=6, help="timed batches of 8 requests")
    ap.add_argument("--output-len", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny GQA Llama, made now)")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N", help="aten op table, N rows")
    ap.add_argument("--json", type=output_path, default=None, help="write the numbers here")
    ap.add_argument("--staggered", action="store_true",
                    help="a server's steady state: a new request joins as soon as one finishes, the first 8 "
                         "finishing at different steps, so most steps hold a prompt beside decodes; every "
                         "step is timed, the table is per step of any kind")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.backend == "plugin":
        os.environ["VLLM_GAUDI_UNIFIED"] = "1"
    else:
        os.environ.pop("VLLM_GAUDI_UNIFIED", None)
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_helpers import MODELS, keep_vllm_gaudi_out, make_tiny_llama

    keep_vllm_gaudi_out()
    model = args.model or make_tiny_llama(os.path.join(tempfile.mkdtemp(prefix="decode_profile_"), "model"),
                                          **MODELS["gqa"])
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
              max_model_len=PROMPT_LEN + args.output_len + BLOCK_SIZE, block_size=BLOCK_SIZE,
              max_num_seqs=CONCURRENCY, max_num_batched_tokens=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 << 20)
    instrument(args.backend)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    step_ms = []
    prof = contextlib.nullcontext()
    if args.torch_profile:
        import torch

        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    kinds = []  # per timed step: "decode" (decodes only) or "mixed" (a first token came out: a prompt ran)
    for b in range(1 if args.staggered else args.batches + 1):  # batch 0 warms up
        for i in range(CONCURRENCY):
            engine.add_request(f"{b}_{i}", {"prompt_token_ids": rng.integers(3, 500, PROMPT_LEN).tolist()}, params)
        engine.step()  # the prompts (one step: 8 x 128 tokens fit the token budget)
        while engine.has_unfinished_requests():
            TIMING[0] = b > 0
            t0 = time.perf_counter()
            if b == 1 and args.torch_profile and step_ms == []:
                prof.__enter__()
            outs = engine.step()
            t1 = time.perf_counter()
            TIMING[0] = False
            if b > 0:
                step_ms.append(1e3 * (t1 - t0))
                kinds.append("decode")
        if b == 1 and args.torch_profile:
            prof.__exit__(None, None, None)
    if args.staggered:
        todo, running, seen = args.batches * CONCURRENCY, set(), set()
        added = 0
        TIMING[0] = True
        if args.torch_profile:  # the whole staggered run (the loop above ran only the warm-up batch)
            prof.__enter__()
        while added < todo or running:
            while added < todo and len(running) < CONCURRENCY:
                first = added < CONCURRENCY  # the first ones finish at different steps; the stagger then stays
                p = SamplingParams(max_tokens=(added + 1) * args.output_len // CONCURRENCY if first
                                   else args.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
                rid = f"s{added}"
                engine.add_request(rid, {"prompt_token_ids": rng.integers(3, 500, PROMPT_LEN).tolist()}, p)
                running.add(rid)
                added += 1
            t0 = time.perf_counter()
            outs = engine.step()
            step_ms.append(1e3 * (time.perf_counter() - t0))
            new = [o.request_id for o in outs if o.request_id not in seen and o.outputs[0].token_ids]
            seen.update(new)
            kinds.append("mixed" if new else "decode")
            running -= {o.request_id for o in outs if o.finished}
        TIMING[0] = False
        if args.torch_profile:
            prof.__exit__(None, None, None)
    n = len(step_ms)
    TIMES["engine.step"] = sum(step_ms) / 1e3
    CALLS["engine.step"] = n
    by_kind = {k: [t for t, kk in zip(step_ms, kinds) if kk == k] for k in ("decode", "mixed")}
    print(f"{args.backend}: {n} steps, step p50 {np.median(step_ms):.3f} ms, mean {np.mean(step_ms):.3f} ms, "
          + ", ".join(f"{len(v)} {k} steps (p50 {np.median(v):.3f}, mean {np.mean(v):.3f} ms)"
                      for k, v in by_kind.items() if v) + f"; load average {os.getloadavg()[0]:.2f}")
    print("| part (inclusive) | ms per step | calls per step |")
    print("|---|---|---|")
    for name in sorted(TIMES):
        print(f"| {name} | {1e3 * TIMES[name] / n:.3f} | {CALLS[name] / n:g} |")
    if args.torch_profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.torch_profile))
    if args.json:
        write_text(args.json, json.dumps({
            "backend": args.backend, "staggered": args.staggered, "steps": n, "step_ms": step_ms,
            "step_kinds": kinds,
            "parts_ms_per_step": {k: 1e3 * v / n for k, v in TIMES.items()},
            "calls_per_step": {k: v / n for k, v in CALLS.items()}, "load_average": os.getloadavg(),
            "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
