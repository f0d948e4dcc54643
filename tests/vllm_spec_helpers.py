"""Speculative decoding and fp8 KV cache scenarios for the real-vLLM tests (run as a subprocess).

One engine per call of `python tests/vllm_spec_helpers.py run ...`, with or without
`VLLM_GAUDI_UNIFIED=1`; it writes the generated tokens, logprobs and vLLM's own
spec-decode counters (`LLM.get_metrics()`: drafts, draft tokens, accepted tokens,
accepted per draft position) as JSON. The models are `vllm_helpers.make_tiny_llama`'s.

The prompts repeat short token patterns, so that the ngram proposer finds
matches and proposes drafts from the first decode on, and a random-weight
model's greedy continuation (which soon loops) accepts some of them and rejects
others: both the accepted and the rolled-back drafts happen inside vLLM.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_helpers as H  # noqa: E402

#: The token budget leaves room for every running request's 1 + k tokens beside a prompt chunk.
MAX_NUM_BATCHED_TOKENS = 96
MAX_NUM_SEQS = 6
SHARED_PREFIX_LEN = 64  # two whole blocks


def make_draft_model(target: str, path: str, noise: float = 0.005, seed: int = 7) -> str:
    """A draft model for `method="draft_model"`: the target's weights with Gaussian noise of std `noise`
    added to every matrix, so the draft agrees with the target on most tokens but not all: some drafts
    are accepted, others rejected and rolled back. (An unrelated random draft is never accepted.)"""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    model.save_pretrained(path, safe_serialization=True)
    return path


def spec_prompts() -> list[dict]:
    """Requests submitted together: repeated patterns (ngram matches), a long prompt chunked by the budget
    (prompt chunks beside speculative decodes in one step), two prompts with a common 64-token prefix
    (shared cache blocks), and a short one."""
    toks = H.token_maker(4321)

    def pattern(period, n):
        p = toks(period)
        return (p * (n // period + 1))[:n]

    prefix = pattern(8, SHARED_PREFIX_LEN)
    return [
        dict(name="loop_short", prompt=pattern(4, 20), max_tokens=32),
        dict(name="loop_long_chunked", prompt=toks(60) + pattern(6, 240), max_tokens=24),
        dict(name="prefix_a", prompt=prefix + toks(9), max_tokens=24),
        dict(name="prefix_b", prompt=prefix + pattern(3, 17), max_tokens=24),
        dict(name="random", prompt=toks(11), max_tokens=28),
    ]


def _metrics(llm) -> dict:
    """vLLM's spec-decode counters of this engine (zeros when it does not speculate)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        key = m.name.removeprefix("vllm:spec_decode_")
        if isinstance(m, Counter) and key in out:
            out[key] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = list(m.values)
    out["acceptance_rate"] = out["num_accepted_tokens"] / out["num_draft_tokens"] if out["num_draft_tokens"] else None
    return out


def run(model: str, out: str, method: str | None, k: int, draft: str | None, kv_cache_dtype: str,
        gaudi_standin: bool = False) -> None:
    """Generate the scenario greedily with one engine (in this process, so every request is queued before
    the first step) and write tokens, logprobs, spec-decode metrics and timings to `out`. `gaudi_standin`:
    through vllm-gaudi's platform, worker and runner on the CPU (`vllm_helpers.gaudi_standin_context`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with H.gaudi_standin_context("float32") if gaudi_standin else contextlib.nullcontext():
        _run(model, out, method, k, draft, kv_cache_dtype)


def _run(model: str, out: str, method: str | None, k: int, draft: str | None, kv_cache_dtype: str) -> None:
    from vllm import LLM, SamplingParams

    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            spec.update(prompt_lookup_min=2, prompt_lookup_max=4)
        if draft is not None:
            spec["model"] = draft
    t0 = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
              max_model_len=H.MAX_MODEL_LEN, block_size=H.BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True,
              enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, speculative_config=spec,
              kv_cache_dtype=kv_cache_dtype, disable_log_stats=False)
    startup = time.perf_counter() - t0
    reqs = spec_prompts()
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, logprobs=2, detokenize=False,
                             ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in reqs], params, use_tqdm=False)
    gen = time.perf_counter() - t0
    results = {r["name"]: {"samples": [{"tokens": list(c.token_ids),
                                        "logprobs": [H._logprob_dict(e) for e in c.logprobs]} for c in o.outputs],
                           "prompt_logprobs": None} for r, o in zip(reqs, outs)}
    with open(out, "w") as f:
        json.dump({"results": results, "metrics": _metrics(llm), "startup_s": startup, "generate_s": gen,
                   "vllm_kernel_libraries": H.cpu_features.loaded_vllm_libraries()}, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one engine on the scenario")
    r.add_argument("--model", required=True, help="target model directory")
    r.add_argument("--out", required=True, help="JSON result file")
    r.add_argument("--method", default=None, help="speculative method (ngram, draft_model, ...); none: no drafts")
    r.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    r.add_argument("--draft", default=None, help="draft model directory (draft_model / eagle methods)")
    r.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, fp8_e4m3, fp8_e5m2)")
    H.add_standin_flag(r)
    args = parser.parse_args(argv)
    H.cpu_features.force_from_env()  # before vLLM is imported (UNIFIED_TEST_CPU=avx2)
    if not args.gaudi_standin:
        H.keep_vllm_gaudi_out()
    run(args.model, args.out, args.method, args.k, args.draft, args.kv_cache_dtype, args.gaudi_standin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
