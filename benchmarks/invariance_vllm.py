"""The cascade-attention experiment with real vLLM on the CPU: one prompt, alone and in a batch of 16.

    python -m benchmarks.invariance_vllm [--out results.json]

The prompt has a 96-token prefix (three blocks of 32) that 15 other prompts
share. Each run is a fresh engine (so the target's own blocks are never cached
from an earlier run) that first generates one warm-up prompt holding the
prefix, so the prefix comes from the prefix cache in both runs; then either
the target alone or the 16 prompts together (the target in the middle), greedy,
16 tokens, 5 logprobs each. Three engines: vLLM's own CPU attention, this
plugin in its default mode, and this plugin in batch-invariant mode
(`VLLM_GAUDI_UNIFIED_BATCH_INVARIANT=1`). Reported: whether the target's tokens
agree and the largest logprob difference between alone and batched.
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
}


def prompts():
    rng = random.Random(7)
    toks = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731
    prefix = toks(96)
    warm = prefix + toks(4)
    batch = [prefix + toks(rng.randrange(5, 40)) for _ in range(16)]
    return warm, batch, 7  # the target is batch[7]


def engine(model: str, mode: str, out: str) -> None:
    """One fresh engine (this process): warm-up, then 'alone' or 'batch'."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0, max_model_len=512,
              block_size=32, max_num_seqs=16, max_num_batched_tokens=2048, enable_prefix_caching=True,
              kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, detokenize=False, ignore_eos=True)
    warm, batch, target = prompts()
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    todo = [batch[target]] if mode == "alone" else batch
    outs = llm.generate([{"prompt_token_ids": p} for p in todo], params, use_tqdm=False)
    o = outs[0 if mode == "alone" else target].outputs[0]
    result = {"tokens": list(o.token_ids),
              "logprobs": [{str(t): float(lp.logprob) for t, lp in e.items()} for e in o.logprobs]}
    with open(out, "w") as f:
        json.dump(result, f)


def compare(alone: dict, batched: dict) -> dict:
    same_tokens = alone["tokens"] == batched["tokens"]
    diffs, identical = [], True
    for a, b in zip(alone["logprobs"], batched["logprobs"]):
        for tok in set(a) & set(b):
            diffs.append(abs(a[tok] - b[tok]))
            identical &= a[tok] == b[tok]
        identical &= set(a) == set(b)
    return dict(same_tokens=same_tokens, identical_logprobs=identical and same_tokens,
                max_abs_logprob_diff=max(diffs) if diffs else None, compared=len(diffs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), help="which engines to run")
    p.add_argument("--engine", nargs=3, metavar=("MODEL", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        engine(*args.engine)
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_helpers import make_tiny_llama

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(str(Path(tmp) / "model"))
        for name in args.configs:
            runs = {}
            for mode in ("alone", "batch"):
                out = str(Path(tmp) / f"{name}_{mode}.json")
                env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
                env.update(CONFIGS[name])
                subprocess.run([sys.executable, "-m", "benchmarks.invariance_vllm", "--engine", model, mode, out],
                               env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs[mode] = json.loads(Path(out).read_text())
            results[name] = compare(runs["alone"], runs["batch"])
            print(name, json.dumps(results[name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
