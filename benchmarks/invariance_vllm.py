"""The cascade-attention experiment with real vLLM on the CPU: one prompt, alone and in a batch of 16.

    python -m benchmarks.invariance_vllm [--out results.json]

The prompt has a 256-token prefix (eight blocks of 32; the size from which
vLLM's GPU backends use cascade attention) that 15 other prompts share. Each
run is a fresh engine (so the target's own blocks are never cached from an
earlier run) that first generates one warm-up prompt holding the prefix, so
the prefix comes from the prefix cache in both runs; then either the target
alone or the 16 prompts together (the target in the middle), greedy, 16
tokens, 5 logprobs each. Engines (`CONFIGS`): vLLM's own CPU attention, this
plugin in its default mode, this plugin in batch-invariant mode
(`VLLM_GAUDI_UNIFIED_BATCH_INVARIANT=1`), and vLLM's CPU attention without its
split-KV decode (`VLLM_CPU_ATTN_SPLIT_KV=0`); `--configs` also knows
`plugin_vllm_flag` (the plugin under vLLM's own `VLLM_BATCH_INVARIANT=1`) and
`vllm_cpu_attn_vllm_flag` (vLLM's CPU attention under it). Besides, `linear_rows_check` tests whether the
linear layers' GEMM (vLLM's CPU oneDNN path, fp32) gives a row the same bits
alone and among 16 rows.

`--spec K`: the same with vLLM's ngram speculative decoding (`K` drafts a
step, lookup 2-4 tokens) on top of prefix caching; the prompts are then made
of repeated short patterns (`spec_prompts`: the shared prefix one of them, so
the proposer finds matches from the first decode on), and each run reports
vLLM's spec-decode counters (drafts proposed and accepted), so a run that
speculated is told from one that did not.

Reported per engine: whether the target's tokens agree, whether its logprobs
are bitwise identical, the largest logprob difference between alone and
batched, and the first generated position where they differ. Results:
docs/batch_invariance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS) + list(EXTRA_CONFIGS),
                   help="which engines to run (default: %(default)s)")
    p.add_argument("--spec", type=int, default=0, help="ngram speculative decoding with this many drafts (0: off)")
    p.add_argument("--no-linear-check", action="store_true", help="skip linear_rows_check")
    p.add_argument("--engine", nargs=3, metavar=("MODEL", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
                proc = subprocess.run([sys.executable, "-m", "benchmarks.invariance_vllm", "--spec", str(args.spec),
                                       "--engine", model, mode, out], env=env, cwd=ROOT, capture_output=True, text=True)
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
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
