"""The batch-invariant mode: what it costs on a device, and what it does inside vLLM.

    python -m benchmarks.invariance cost [--route cuda|gaudi] [--scale 0.0625] [--device cpu|cuda]
                                         [--invariant-chunk N]
                                         [--scenarios NAME ...] [--out results.json]
    python -m benchmarks.invariance vllm [--configs NAME ...] [--out results.json]

`cost`: the suite's scenarios (`benchmarks/scenarios.py`: 32 query heads, 8 KV heads, head size 128, bf16,
block size 16) timed in the default and the invariant mode, with the same layouts and timing as
`benchmarks/speed.py`; prints a markdown table with one column per mode, the ratio and each mode's peak
memory (CUDA: bytes one eager call allocates beyond its inputs). `--route gaudi` turns every CUDA-only
kernel off in both modes: what a Gaudi runs, as in every other benchmark here (`paths/fused.gaudi_route()`,
`VLLM_GAUDI_UNIFIED_GAUDI_ROUTE=1`: no flash varlen, no Triton; the fused SDPA calls kept, torch SDPA and
cuDNN with statistics standing in for FusedSDPA). Besides the suite's scenarios: speculative verify steps
(`scenarios.verify_scenarios`: 64 x (1 + k) over 3k, ragged drafts, other head shapes; both modes planned
with `PlanOptions.unique_tokens` = the step's most new tokens, as a server with k drafts plans) and MLA decodes
(`mla_decode_64x4k`: 64 decodes over 4k at DeepSeek-V3's latent shapes, 128 heads, latent 512 + rope 64, block
128, through `mla.mla_attention`; `mla_decode_4x32k`: 4 over 32k, where the default splits each token's keys to
fill the SMs). On CUDA both modes are also timed as CUDA graph replays (one graph per step). A mode
that runs out of memory is recorded as such and the run goes on.

`vllm`: the cascade-attention experiment with real vLLM on the CPU, one prompt alone and in a batch of 16.
The prompt has a 256-token prefix (eight blocks of 32; the size from which vLLM's GPU backends use cascade
attention) that 15 other prompts share. Each run is a fresh engine (so the target's own blocks are never
cached from an earlier run) that first generates one warm-up prompt holding the prefix, so the prefix
comes from the prefix cache in both runs; then either the target alone or the 16 prompts together (the
target in the middle), greedy, 16 tokens, 5 logprobs each. Engines (`CONFIGS`): vLLM's own CPU attention,
this plugin in its default mode, this plugin in batch-invariant mode (`VLLM_GAUDI_UNIFIED_BATCH_INVARIANT=1`),
and vLLM's CPU attention without its split-KV decode (`VLLM_CPU_ATTN_SPLIT_KV=0`); `--configs` also knows
`plugin_vllm_flag` (the plugin under vLLM's own `VLLM_BATCH_INVARIANT=1`) and `vllm_cpu_attn_vllm_flag`
(vLLM's CPU attention under it). `--spec K`: the same with vLLM's ngram speculative decoding (`K` drafts a
step, lookup 2-4 tokens) on top of prefix caching; the prompts are then made of repeated short patterns
(`spec_prompts`), and each run reports vLLM's spec-decode counters (drafts proposed and accepted), so a run
that speculated is told from one that did not.
Besides, `linear_rows_check` tests whether the linear layers' GEMM (vLLM's CPU oneDNN path, fp32) gives a
row the same bits alone and among 16 rows. Reported per engine: whether the target's tokens agree, whether
its logprobs are bitwise identical, the largest logprob difference between alone and batched, and the
first generated position where they differ (docs/batch_invariance.md).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import scenarios as sc_mod
from benchmarks.baselines import capture, peak_bytes, time_ms
from vllm_gaudi_unified import PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.files import atomic_write, output_path, write_text
from vllm_gaudi_unified.tools.cli import Parser
from vllm_gaudi_unified.mla import mla_attention
from vllm_gaudi_unified.paths import fused

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "vllm_cpu_attn": {},
    "plugin_default": {"VLLM_GAUDI_UNIFIED": "1", "VLLM_GAUDI_UNIFIED_BATCH_INVARIANT": "0"},
    "plugin_invariant": {"VLLM_GAUDI_UNIFIED": "1", "VLLM_GAUDI_UNIFIED_BATCH_INVARIANT": "1"},
    # vLLM's CPU attention without its split-KV decode (flash-decoding across threads when few requests run).
    "vllm_cpu_attn_no_split": {"VLLM_CPU_ATTN_SPLIT_KV": "0"},
}
#: Not run by default: vLLM's own batch-invariant switch fails on the CPU build (its kernels are Triton's).
EXTRA_CONFIGS = {"plugin_vllm_flag": {"VLLM_GAUDI_UNIFIED": "1", "VLLM_BATCH_INVARIANT": "1"},
                 "vllm_cpu_attn_vllm_flag": {"VLLM_BATCH_INVARIANT": "1"}}
PREFIX_LEN = 256


#: The MLA decode's shapes (DeepSeek-V3: 128 heads, latent 512 + rope 64; scale (128 + 64) ** -0.5).
MLA_HEADS, MLA_LATENT, MLA_ROPE, MLA_BLOCK = 128, 512, 64, 128


def all_scenarios(scale: float) -> list:
    """The suite's scenarios, the verify steps, and the MLA decodes (`Scenario`s named `mla_*`)."""
    s = lambda n: max(1, int(round(n * scale)))  # noqa: E731
    mla = [sc_mod.Scenario("mla_decode_64x4k", "MLA decode 64 x 4k", (1,) * s(64), (s(4096) - 1,) * s(64)),
           sc_mod.Scenario("mla_decode_4x32k", "MLA decode 4 x 32k", (1,) * s(4), (s(32768) - 1,) * s(4))]
    return sc_mod.scenarios(scale) + sc_mod.verify_scenarios(scale) + mla


def prompts():
    rng = random.Random(7)
    toks = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    prefix = toks(PREFIX_LEN)
    warm = prefix + toks(4)
    batch = [prefix + toks(rng.randrange(5, 40)) for _ in range(16)]
    return warm, batch, 7  # the target is batch[7]


def spec_prompts():
    """`prompts` for speculative decoding: the same layout (a 256-token prefix the 16 prompts share, a
    warm-up prompt holding it, the target batch[7]) made of repeated short patterns, so that the ngram
    proposer finds matches in every prompt."""
    rng = random.Random(11)

    def pattern(n):
        p = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 9))]
        return (p * (n // len(p) + 1))[:n]

    prefix = pattern(PREFIX_LEN)
    return prefix + pattern(4), [prefix + pattern(rng.randrange(5, 40)) for _ in range(16)], 7


def engine(model: str, mode: str, out: str, spec: int = 0) -> None:
    """One fresh engine (this process): warm-up, then 'alone' or 'batch'; `spec` > 0: ngram speculative
    decoding with that many drafts a step."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    spec_config = None if not spec else {"method": "ngram", "num_speculative_tokens": spec, "prompt_lookup_min": 2,
                                         "prompt_lookup_max": 4}
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0, max_model_len=512,
              block_size=32, max_num_seqs=16, max_num_batched_tokens=2048, enable_prefix_caching=True,
              kv_cache_memory_bytes=64 << 20, speculative_config=spec_config, disable_log_stats=not spec)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, detokenize=False, ignore_eos=True)
    warm, batch, target = spec_prompts() if spec else prompts()
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    before = spec_counters(llm) if spec else {}
    todo = [batch[target]] if mode == "alone" else batch
    outs = llm.generate([{"prompt_token_ids": p} for p in todo], params, use_tqdm=False)
    o = outs[0 if mode == "alone" else target].outputs[0]
    result = {"tokens": list(o.token_ids),
              "logprobs": [{str(t): float(lp.logprob) for t, lp in e.items()} for e in o.logprobs]}
    if spec:  # this run's, the warm-up's left out
        result["spec_decode"] = {k: v - before[k] for k, v in spec_counters(llm).items()}
    with open(out, "w") as f:
        json.dump(result, f)


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters of this engine so far: drafts, draft tokens, accepted tokens."""
    from vllm.v1.metrics.reader import Counter

    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    out = dict.fromkeys(names, 0)
    for m in llm.get_metrics():
        key = m.name.removeprefix("vllm:spec_decode_")
        if isinstance(m, Counter) and key in out:
            out[key] += m.value
    return out


def linear_rows_check() -> dict:
    """Row 0 of x[:1] @ W.T vs row 0 of x[:16] @ W.T (bitwise), for this model's linear shapes
    (K, N), through vLLM's CPU GEMM (oneDNN, as `dispatch_cpu_unquantized_gemm` sets it up for fp32)
    and through torch.nn.functional.linear."""
    import torch
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    out = {}
    for k, n in ((256, 768), (256, 256), (256, 1024), (512, 256), (256, 512)):  # qkv, o, gate_up, down, lm_head
        w = torch.randn(n, k, generator=gen) * 0.05
        x = torch.randn(16, k, generator=gen)
        handler = ops.create_onednn_mm(w.t(), 32)
        one, many = ops.onednn_mm(handler, x[:1].contiguous(), None), ops.onednn_mm(handler, x, None)
        out[f"{k}x{n}"] = {"onednn_same_bits": bool(torch.equal(one[0], many[0])),
                           "torch_linear_same_bits": bool(torch.equal(torch.nn.functional.linear(x[:1], w)[0],
                                                                      torch.nn.functional.linear(x, w)[0]))}
    return out


def compare(alone: dict, batched: dict) -> dict:
    same_tokens = alone["tokens"] == batched["tokens"]
    diffs, identical, first = [], True, None
    for pos, (a, b) in enumerate(zip(alone["logprobs"], batched["logprobs"])):
        same_here = a == b  # same top tokens, bitwise equal values
        for tok in set(a) & set(b):
            diffs.append(abs(a[tok] - b[tok]))
        if not same_here and first is None:
            first = pos
        identical &= same_here
    return dict(same_tokens=same_tokens, identical_logprobs=identical and same_tokens,
                max_abs_logprob_diff=max(diffs) if diffs else None, first_differing_position=first,
                compared=len(diffs))


def cost(args) -> int:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    default = PlanOptions()
    invariant = replace(default, batch_invariant=True)
    if args.invariant_rows:
        invariant = replace(invariant, invariant_rows=args.invariant_rows)
    if args.invariant_chunk:
        invariant = replace(invariant, invariant_chunk=args.invariant_chunk)
    rows = []
    route = fused.gaudi_route() if args.route == "gaudi" else contextlib.nullcontext()
    with route:
        for sc in all_scenarios(args.scale):
            if args.scenarios and sc.name not in args.scenarios:
                continue
            row = dict(scenario=sc.name, device=str(device), route=args.route, dtype=args.dtype, scale=args.scale,
                       invariant_rows=invariant.invariant_rows, invariant_chunk=invariant.invariant_chunk,
                       commit=args.commit,
                       date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       torch=torch.__version__)
            if device.type == "cuda":
                row["gpu"] = torch.cuda.get_device_name(device)
            _run_scenario(sc, args, device, dtype, default, invariant, row)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # after every scenario: a run stopped early keeps what it measured
                with atomic_write(args.out) as f:
                    json.dump(rows, f, indent=1)
    _print_table(rows, device.type == "cuda")
    return 0


def vllm_experiment(args) -> int:
    if args.engine:
        engine(*args.engine, spec=args.spec)
        return 0
    from tests.vllm_helpers import keep_vllm_gaudi_out, make_tiny_llama  # run from the repository root

    keep_vllm_gaudi_out()  # (engines inherit it: vllm-gaudi's plugins need Gaudi software)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(str(Path(tmp) / "model"))
        for name in args.configs:
            runs = {}
            for mode in ("alone", "batch"):
                out = str(Path(tmp) / f"{name}_{mode}.json")
                env = {k: v for k, v in os.environ.items()
                       if not k.startswith("VLLM_GAUDI_UNIFIED") and k != "VLLM_BATCH_INVARIANT"}
                env.update({**CONFIGS, **EXTRA_CONFIGS}[name])
                proc = subprocess.run([sys.executable, "-m", "benchmarks.invariance", "vllm", "--spec", str(args.spec),
                                       "--engine", model, mode, out], env=env, cwd=ROOT, capture_output=True,
                                      text=True)
                if proc.returncode != 0:
                    print(f"{name} {mode}: engine failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
                    error = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["?"]
                    results[name] = {"error": f"{mode} engine failed: {error[0][:300]}"}
                    break
                runs[mode] = json.loads(Path(out).read_text())
            if len(runs) < 2:
                continue
            results[name] = compare(runs["alone"], runs["batch"])
            if args.spec:
                results[name]["spec_decode"] = {mode: runs[mode]["spec_decode"] for mode in runs}
            print(name, json.dumps(results[name]), flush=True)
    if not args.no_linear_check:
        results["linear_rows_check"] = linear_rows_check()
        print("linear_rows_check", json.dumps(results["linear_rows_check"]), flush=True)
    if args.out:
        write_text(args.out, json.dumps(results, indent=1))
    return 0


def _step(sc, args, device, dtype):
    """The scenario's inputs: (layout, block size, call(batch) -> output)."""
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
    hq, hkv, d = sc.heads
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    kc, vc = rand(lay.num_blocks, bs, hkv, d), rand(lay.num_blocks, bs, hkv, d)
    return lay, bs, lambda b: unified_attention(q, k, v, kc, vc, b, d ** -0.5)


def _run_scenario(sc, args, device, dtype, default, invariant, row) -> None:
    lay, bs, call = _step(sc, args, device, dtype)
    outs = {}
    if sc in sc_mod.verify_scenarios(args.scale):  # a spec-decoding server's options: 1 + k tokens per unit
        row["unique_tokens"] = max(sc.query_lens)
        default, invariant = (replace(o, unique_tokens=row["unique_tokens"]) for o in (default, invariant))
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


def main(argv=None) -> int:
    top = Parser(prog="benchmarks.invariance", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cost", help="the suite's scenarios in the default and the invariant mode")
    p.add_argument("--scale", type=float, default=1.0, help="shrink request counts and lengths (CPU: 0.0625)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--route", choices=("cuda", "gaudi"), default="cuda",
                   help="cuda: the fused kernels where they apply; gaudi: what a Gaudi runs (CUDA-only kernels off)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (the MLA decode: 128)")
    p.add_argument("--invariant-rows", type=int, default=None, help="PlanOptions.invariant_rows (default: its own)")
    p.add_argument("--invariant-chunk", type=int, default=None,
                   help="PlanOptions.invariant_chunk: the torch route's tiles per product (default: its own)")
    p.add_argument("--scenarios", nargs="*", default=None, help="names to run (default: all)")
    p.add_argument("--commit", default="", help="recorded in each row (the checkout measured)")
    p.add_argument("--out", type=output_path, default=None, help="write the rows as JSON here")
    p = sub.add_parser("vllm", help="one prompt alone and in a batch of 16, in real vLLM on the CPU")
    p.add_argument("--out", type=output_path, default=None, help="write the results as JSON here")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS) + list(EXTRA_CONFIGS),
                   help="which engines to run (default: %(default)s)")
    p.add_argument("--spec", type=int, default=0, help="ngram speculative decoding with this many drafts (0: off)")
    p.add_argument("--no-linear-check", action="store_true", help="skip linear_rows_check")
    p.add_argument("--engine", nargs=3, metavar=("MODEL", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = top.parse_args(argv)
    return cost(args) if args.command == "cost" else vllm_experiment(args)


if __name__ == "__main__":
    raise SystemExit(main())
