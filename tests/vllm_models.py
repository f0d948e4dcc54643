"""Tiny random-weight models with the attention features of the models most run on Gaudi, made offline.

Each carries one of the attention kinds that put several kinds of layers into one step, with a
dense MLP:

- `gemma2`: interleaved sliding-window (16) / full layers, attention logit soft-cap 50, final soft-cap 30;
- `gemma3`: interleaved sliding-window (16) / full layers, q/k norms, no soft-cap (Gemma 3 has none);
- `gptoss_like`: vLLM's Granite (the `granite_swa` variant): per-head attention sinks on every layer and
  alternating sliding-window (16) / full layers: gpt-oss's attention without its MoE;
- `llama4_like`: Llama 4 text layers, chunked local attention (chunks of 32) on three layers of four
  and one global NoPE layer, dense MLPs (no MoE layer: `interleave_moe_layer_step` 0).

`make_moe_model` saves the MoE models (`MOE_MODELS`, full attention, every MLP a mixture of experts):
`mixtral` (8 experts, 2 per token) and `qwen3_moe` (Qwen3-MoE: q/k norms, 16 small experts, 4 per token).

`local=False` makes the same weights with every layer full attention (the window or the chunking
removed), to show that they change the result. Shapes as `vllm_helpers.make_tiny_llama`: vocabulary
512, hidden 256, 4 query heads over 2 KV heads of 64, 4 layers.
"""
from __future__ import annotations

import json
import os

from vllm_helpers import MAX_MODEL_LEN, VOCAB

WINDOW = 16
CHUNK = 32
LAYERS = 4
MODELS = ("gemma2", "gemma3", "gptoss_like", "llama4_like")
MOE_MODELS = ("mixtral", "qwen3_moe")


def _common(tie: bool) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=MAX_MODEL_LEN,
                initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie)


def _layer_types(local: bool) -> list[str]:
    return ["sliding_attention", "full_attention"] * (LAYERS // 2) if local else ["full_attention"] * LAYERS


def make_model(name: str, path: str, local: bool = True, seed: int = 0) -> str:
    """Save model `name` (one of `MODELS`) to `path` (float32 safetensors); returns `path`."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    if name == "gemma2":
        config = T.Gemma2Config(**_common(True), sliding_window=WINDOW, attn_logit_softcapping=50.0,
                                final_logit_softcapping=30.0, query_pre_attn_scalar=64, layer_types=_layer_types(local))
        model = T.Gemma2ForCausalLM(config)
    elif name == "gemma3":
        config = T.Gemma3TextConfig(**_common(True), sliding_window=WINDOW, query_pre_attn_scalar=64,
                                    layer_types=_layer_types(local))
        model = T.Gemma3ForCausalLM(config)
    elif name == "gptoss_like":
        common = _common(False)
        common.pop("head_dim")
        config = T.GraniteConfig(**common)
        model = T.GraniteForCausalLM(config)
    elif name == "llama4_like":
        # no_rope_layers: 1 = RoPE + chunked local attention, 0 = NoPE global layer (vLLM's llama4.py).
        config = T.Llama4TextConfig(**_common(False), intermediate_size_mlp=512,
                                    attention_chunk_size=CHUNK if local else None, no_rope_layers=[1, 1, 1, 0],
                                    interleave_moe_layer_step=0, moe_layers=[], num_local_experts=1, use_qk_norm=True)
        model = T.Llama4ForCausalLM(config)
    else:
        raise ValueError(f"model {name!r}: not one of {MODELS}")
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    if name == "gptoss_like":
        _add_sinks_and_windows(path, local, seed)
    return path


def make_moe_model(name: str, path: str, seed: int = 0) -> str:
    """Save MoE model `name` (one of `MOE_MODELS`) to `path` (float32 safetensors); returns `path`."""
    import torch
    import transformers as T

    common = _common(False)
    torch.manual_seed(seed)
    if name == "mixtral":
        model = T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2))
    elif name == "qwen3_moe":
        common["intermediate_size"] = 128
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**common, num_experts=16, num_experts_per_tok=4,
                                                       moe_intermediate_size=128, norm_topk_prob=True))
    else:
        raise ValueError(f"model {name!r}: not one of {MOE_MODELS}")
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def _add_sinks_and_windows(path: str, local: bool, seed: int) -> None:
    """vLLM's Granite reads `layer_types` + `sliding_window` and a sink per head (`self_attn.sinks`) from
    the checkpoint (`granite_layer_attn_params`); transformers' Granite has neither, so they are added."""
    import torch
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(layer_types=_layer_types(local), sliding_window=WINDOW, attention_sinks=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(LAYERS):
        weights[f"model.layers.{i}.self_attn.sinks"] = torch.randn(4, generator=g) * 2
    save_file(weights, file, metadata={"format": "pt"})


def run_embeddings(model: str, out: str, gaudi_standin: bool = False) -> None:
    """Embed `EMBED_PROMPTS` with one engine (`runner="pooling"`: the tiny Llama's last-token hidden
    state, normalized, vLLM's default pooler for a causal LM turned into an embedding model); write
    the vectors to `out` (JSON), with the engine's pooling config. In this process, as `run_scenario`."""
    import contextlib
    import random

    import vllm_helpers as H

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device = H.gaudi_standin_context("float32") if gaudi_standin else contextlib.nullcontext()
    from vllm import LLM

    _add_tokenizer(model)
    rng = random.Random(7)
    # Lengths around the 64-token budget and the 32-token blocks: some prompts arrive in several steps.
    prompts = [[rng.randrange(3, H.VOCAB) for _ in range(n)] for n in (5, 31, 32, 47, 64, 90, 150, 3)]
    with device:
        llm = LLM(model=model, runner="pooling", enforce_eager=True, dtype="float32",
                  seed=0, max_model_len=H.MAX_MODEL_LEN, block_size=H.BLOCK_SIZE, max_num_seqs=H.MAX_NUM_SEQS,
                  max_num_batched_tokens=H.MAX_NUM_BATCHED_TOKENS, kv_cache_memory_bytes=64 << 20)
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        pooler = llm.llm_engine.vllm_config.model_config.pooler_config
    with open(out, "w") as f:
        json.dump({"embeddings": [list(map(float, o.outputs.embedding)) for o in outs],
                   "pooler_config": str(pooler)}, f)


def run_scenario_async(model: str, out: str, async_scheduling: bool, gaudi_standin: bool = False) -> None:
    """`vllm_helpers.run_scenario` with async scheduling set on or off (vLLM 0.32's default is on); the
    result also says what the engine ran with (`async_scheduling`)."""
    import contextlib
    import time

    import vllm_helpers as H

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device = H.gaudi_standin_context("float32") if gaudi_standin else contextlib.nullcontext()
    from vllm import LLM, SamplingParams

    engines = []

    def make(*args, **kwargs):
        engines.append(LLM(*args, async_scheduling=async_scheduling, **kwargs))
        return engines[-1]

    with device:
        H._run_waves(make, SamplingParams, model, out, "float32", time.perf_counter())
    with open(out) as f:
        result = json.load(f)
    result["async_scheduling"] = bool(engines[0].llm_engine.vllm_config.scheduler_config.async_scheduling)
    with open(out, "w") as f:
        json.dump(result, f)


def _add_tokenizer(path: str) -> None:
    """A word-level tokenizer over the model's vocabulary (`t3` .. `t511`), saved next to it: vLLM's
    embedding entry point builds its scoring processor from a tokenizer (prompts are token ids here)."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import vllm_helpers as H

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, H.VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(path)


if __name__ == "__main__":
    import sys

    if "--gaudi-standin" not in sys.argv:
        import vllm_helpers

        vllm_helpers.keep_vllm_gaudi_out()
    # python tests/vllm_models.py embed MODEL OUT [--gaudi-standin]
    # python tests/vllm_models.py async-on|async-off MODEL OUT [--gaudi-standin]
    if sys.argv[1] == "embed":
        run_embeddings(sys.argv[2], sys.argv[3], "--gaudi-standin" in sys.argv)
    else:
        run_scenario_async(sys.argv[2], sys.argv[3], sys.argv[1] == "async-on", "--gaudi-standin" in sys.argv)
