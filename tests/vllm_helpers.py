"""Helpers of the real-vLLM tests: a tiny local model, and a scenario runner run as a subprocess.

vLLM spawns engine processes and keeps global state per process, so each
engine runs in a fresh `python tests/vllm_helpers.py run ...` (with or without
`VLLM_GAUDI_UNIFIED=1`); it writes the generated tokens and logprobs as JSON.

The model: a Llama with random weights made here with transformers (no
download) and saved as safetensors. Real random weights rather than vLLM's
`load_format="dummy"` (uniform in +-1e-3) because those make near-uniform
logits, where greedy choices hang on ties far below any attention error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_features  # noqa: E402

#: Scheduler settings of the scenario: a 64-token budget chunks every prompt longer than that
#: and mixes prompt chunks with decodes in the same step.
BLOCK_SIZE = 32
MAX_NUM_BATCHED_TOKENS = 64
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 512
VOCAB = 512
SHARED_PREFIX_LEN = 96  # three whole blocks
#: The models of the e2e comparison (`make_tiny_llama` arguments): MHA, GQA (4 query heads per KV head),
#: and the MHA weights with the first layer windowed to 48 positions (two KV cache groups).
MODELS = {"mha": dict(num_heads=4, num_kv_heads=4), "gqa": dict(num_heads=8, num_kv_heads=2),
          "swa": dict(num_heads=4, num_kv_heads=4, sliding_window=48)}


def token_maker(seed: int):
    """`toks(n)`: n random prompt ids from one seeded stream (ids from 3 up: clear of the special ones),
    so a scenario's prompts are the same on every run and engine."""
    import random

    rng = random.Random(seed)
    return lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]


def add_standin_flag(parser: argparse.ArgumentParser) -> None:
    """`--gaudi-standin`, the one flag every engine script takes to run vllm-gaudi's platform on the CPU."""
    parser.add_argument("--gaudi-standin", action="store_true",
                        help="run vllm-gaudi's platform on the CPU with tests/habana_standin.py (set VLLM_PLUGINS "
                             "and VLLM_GAUDI_UNIFIED for the unified runner)")


#: The plugins a CPU vLLM run may load when vllm-gaudi is installed too (see `keep_vllm_gaudi_out`).
CPU_VLLM_PLUGINS = "unified_attention"


def keep_vllm_gaudi_out(environ=os.environ) -> None:
    """Name this project's plugins in VLLM_PLUGINS when vllm-gaudi is installed without Gaudi software.

    vllm-gaudi's general plugins import `habana_frameworks` unconditionally, so once vllm-gaudi is
    installed (the Gaudi tests need it) every vLLM process on a machine without Gaudi software dies
    in `load_general_plugins` unless VLLM_PLUGINS leaves them out. A VLLM_PLUGINS already set is kept.
    """
    import importlib.util

    if importlib.util.find_spec("vllm_gaudi") is None or importlib.util.find_spec("habana_frameworks") is not None:
        return
    environ.setdefault("VLLM_PLUGINS", CPU_VLLM_PLUGINS)


def make_tiny_llama(path: str, num_heads: int = 4, num_kv_heads: int = 4, hidden: int = 256, layers: int = 2,
                    seed: int = 0, sliding_window: int | None = None) -> str:
    """Save a random-weight LlamaForCausalLM (float32) to `path`; returns `path`.

    `sliding_window`: the first layer attends to that many positions, the
    second to all (vLLM's Llama reads `layer_types`); vLLM then keeps two KV
    cache groups, each planned with its own window."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {}
    if sliding_window is not None:
        extra = dict(sliding_window=sliding_window,
                     layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1))
    config = LlamaConfig(**extra, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=MAX_MODEL_LEN, initializer_range=0.05, torch_dtype="float32",
                         architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def scenario_prompts() -> tuple[list[dict], list[dict]]:
    """Two waves of requests (token ids; 3..511 so that BOS/EOS ids are never in a prompt).

    Wave 1, submitted together: short and long prompts (chunked by the 64-token
    budget, so prefill chunks and decodes share steps), two prompts with a
    common 96-token prefix (shared cache blocks inside one step), and one
    request with n=3 (three sequences forked from one prompt).
    Wave 2, after wave 1 finished: prompts that hit the prefix cache (the shared
    prefix, and a whole earlier prompt), and n=2 on a cached prompt.
    """
    toks = token_maker(1234)

    prefix = toks(SHARED_PREFIX_LEN)
    long_prompt = toks(150)
    n_prompt = toks(70)
    wave1 = [
        dict(name="short", prompt=toks(7), max_tokens=24),
        dict(name="medium", prompt=toks(45), max_tokens=16, prompt_logprobs=True),
        dict(name="long_chunked", prompt=long_prompt, max_tokens=12, prompt_logprobs=True),
        dict(name="prefix_a", prompt=prefix + toks(10), max_tokens=12),
        dict(name="prefix_b", prompt=prefix + toks(21), max_tokens=12),
        dict(name="parallel_n3", prompt=n_prompt, max_tokens=10, n=3),
    ]
    wave2 = [
        dict(name="prefix_hit", prompt=prefix + toks(33), max_tokens=12),
        dict(name="repeat_long", prompt=long_prompt, max_tokens=8),
        dict(name="parallel_n2_cached", prompt=n_prompt + toks(5), max_tokens=8, n=2),
        dict(name="decode_only_tail", prompt=toks(3), max_tokens=30),
    ]
    return wave1, wave2


#: How many engine subprocesses `concurrently` runs at once (`UNIFIED_TEST_ENGINES`, default: two where the
#: machine has two cores). A tiny model's engine keeps about one core busy (Python: imports, scheduling,
#: small kernels), so two of them side by side take about the time of one on a two-core machine.
ENGINES_AT_ONCE = int(os.environ.get("UNIFIED_TEST_ENGINES") or min(2, os.cpu_count() or 1))


def concurrently(*jobs):
    """The results of `jobs` (callables that each run engine subprocesses and return what they read back), in
    order, run `ENGINES_AT_ONCE` at a time. Each engine is its own process: running them side by side
    changes no result. A job's exception is raised here, after the others finished."""
    from concurrent.futures import ThreadPoolExecutor

    if ENGINES_AT_ONCE <= 1 or len(jobs) == 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(min(ENGINES_AT_ONCE, len(jobs))) as pool:
        futures = [pool.submit(job) for job in jobs]
    return [f.result() for f in futures]


def _logprob_dict(entry) -> dict:
    return {str(tok): float(lp.logprob) for tok, lp in entry.items()}


def run_scenario(model: str, out: str, dtype: str = "float32", gaudi_standin: bool = False) -> None:
    """Generate both waves with one engine; write tokens, logprobs and timings to `out` (JSON): `import_s`
    (importing vLLM), `startup_s` (`LLM(...)`: model load, KV cache, warm-up), `generate_s` (both waves).

    The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): all of a
    wave's requests are queued before the first step, so both runs schedule the
    very same steps (with a separate engine process, requests can arrive while
    it already steps, and the batches, hence the random draws of n > 1, differ).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device_context = gaudi_standin_context(dtype) if gaudi_standin else contextlib.nullcontext()
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t0
    with device_context:
        _run_waves(LLM, SamplingParams, model, out, dtype, import_s)


def gaudi_standin_context(dtype: str):
    """vllm-gaudi's platform, worker and runner on the CPU (tests/habana_standin.py), before vLLM is
    imported; returns the context the engine must run in (the "hpu" device as the CPU)."""
    import importlib.util

    import habana_moe
    import habana_standin

    habana_standin.install(memory_bytes=128 << 20)  # vllm-gaudi sizes the KV cache from the "device" memory
    habana_standin.stub_vision_only_vllm_models()
    habana_moe.vllm_moe_ops_on_cpu()  # vLLM's MoE forward on the stand-in's CPU tensors
    if importlib.util.find_spec("torchvision") is not None:  # the multimodal venv: vision models load
        habana_standin.per_image_encoder_attention()
    if dtype == "float32":
        habana_standin.keep_float32()
    return habana_standin.hpu_device_as_cpu()


def _run_waves(LLM, SamplingParams, model: str, out: str, dtype: str, import_s: float) -> None:
    t0 = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, seed=0,
              max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True,
              enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20)
    startup = time.perf_counter() - t0
    results, gen_time = {}, 0.0
    for wave in scenario_prompts():
        # Greedy, except n > 1 (vLLM refuses greedy with n > 1): random sampling under the engine-wide seed,
        # which draws the same random numbers in both runs since both schedule the same steps.
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.8 if r.get("n", 1) > 1 else 0.0,
                                 logprobs=2, n=r.get("n", 1),
                                 prompt_logprobs=1 if r.get("prompt_logprobs") else None, detokenize=False,
                                 ignore_eos=True) for r in wave]
        t1 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in wave], params, use_tqdm=False)
        gen_time += time.perf_counter() - t1
        for r, o in zip(wave, outs):
            results[r["name"]] = {
                "samples": [{"tokens": list(c.token_ids), "logprobs": [_logprob_dict(e) for e in c.logprobs]}
                            for c in o.outputs],
                "prompt_logprobs": None if o.prompt_logprobs is None else
                [None if e is None else _logprob_dict(e) for e in o.prompt_logprobs],
            }
    with open(out, "w") as f:
        json.dump({"results": results, "import_s": import_s, "startup_s": startup, "generate_s": gen_time,
                   "vllm_kernel_libraries": cpu_features.loaded_vllm_libraries()}, f)


def compare_results(plugin: dict, ref: dict) -> dict:
    """Per case of two `run` results: whether the tokens are identical, and the largest |logprob
    difference| over the generated tokens' top logprobs and the prompt logprobs (tokens both report)."""
    out = {}
    for case, b in ref["results"].items():
        a = plugin["results"][case]
        same = [x["tokens"] == y["tokens"] for x, y in zip(a["samples"], b["samples"])]
        pairs = [(la, lb) for x, y in zip(a["samples"], b["samples"]) for la, lb in zip(x["logprobs"], y["logprobs"])]
        pairs += [(la, lb) for la, lb in zip(a["prompt_logprobs"] or [], b["prompt_logprobs"] or []) if lb is not None]
        diffs = [abs(la[t] - lb[t]) for la, lb in pairs for t in la.keys() & lb.keys()]
        out[case] = {"tokens_identical": len(same) == len(b["samples"]) and all(same),
                     "max_abs_logprob_diff": max(diffs), "logprobs_compared": len(diffs)}
    return out


def same_tokens_worst_logprob(plugin: dict, ref: dict, cases: int) -> float:
    """Assert that the two results hold `cases` cases, each with identical tokens; the largest |logprob
    difference| over them."""
    report = compare_results(plugin, ref)
    assert len(report) == cases, sorted(report)
    for case, r in report.items():
        assert r["tokens_identical"], (case, r)
    return max(r["max_abs_logprob_diff"] for r in report.values())


def measure(workdir: str, models: list[str]) -> dict:
    """The e2e comparison of the tests, as numbers: for each model, one engine with vLLM's CPU attention
    and one with the plugin (fresh processes, one after the other), per case the max logprob
    difference and token identity, and each engine's start-up and generation times."""
    import subprocess

    report = {}
    for name in models:
        model = make_tiny_llama(os.path.join(workdir, name, "model"), **MODELS[name])
        runs = {}
        for engine, extra in (("vllm_cpu_attn", {}), ("plugin", {"VLLM_GAUDI_UNIFIED": "1"})):
            out = os.path.join(workdir, name, engine + ".json")
            env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
            env.update(extra)
            subprocess.run([sys.executable, os.path.abspath(__file__), "run", "--model", model, "--out", out],
                           env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            with open(out) as f:
                runs[engine] = json.load(f)
        report[name] = {"cases": compare_results(runs["plugin"], runs["vllm_cpu_attn"]),
                        "import_s": {k: round(r["import_s"], 1) for k, r in runs.items()},
                        "startup_s": {k: round(r["startup_s"], 1) for k, r in runs.items()},
                        "generate_s": {k: round(r["generate_s"], 1) for k, r in runs.items()}}
        print(name, json.dumps(report[name]), flush=True)
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cpu_features.force_from_env()  # before vLLM is imported (UNIFIED_TEST_CPU=avx2)
    if "--gaudi-standin" not in argv:
        keep_vllm_gaudi_out()
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="save a tiny random Llama")
    mk.add_argument("path", help="output directory")
    mk.add_argument("--num-heads", type=int, default=4, help="query heads")
    mk.add_argument("--num-kv-heads", type=int, default=4, help="KV heads (fewer than query heads: GQA)")
    mk.add_argument("--sliding-window", type=int, default=None, help="window of the first layer (default: none)")
    run = sub.add_parser("run", help="run the generation scenario with one vLLM engine")
    run.add_argument("--model", required=True, help="model directory")
    run.add_argument("--out", required=True, help="JSON result file")
    run.add_argument("--dtype", default="float32", help="model dtype (vllm-gaudi's platform makes float32 bfloat16)")
    add_standin_flag(run)
    ms = sub.add_parser("measure", help="plugin vs vLLM's CPU attention on the scenario: logprob differences, "
                                        "token identity, start-up and generation times (JSON)")
    ms.add_argument("--dir", required=True, help="work directory (models, engine results)")
    ms.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ms.add_argument("--out", default=None, help="write the report here (JSON)")
    args = parser.parse_args(argv)
    if args.cmd == "make-model":
        make_tiny_llama(args.path, args.num_heads, args.num_kv_heads, sliding_window=args.sliding_window)
    elif args.cmd == "run":
        run_scenario(args.model, args.out, args.dtype, args.gaudi_standin)
    else:
        report = measure(args.dir, args.models)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
