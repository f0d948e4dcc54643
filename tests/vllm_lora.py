"""Tiny random LoRA adapters for the tiny Llama of `vllm_helpers`, written offline, and one engine run with them.

`peft` is not installed, so an adapter is written as peft saves one: `adapter_config.json` (LORA, rank 8,
alpha 16, on every attention and MLP projection) and `adapter_model.safetensors` with
`base_model.model.model.layers.N.<module>.lora_A.weight` `[rank, in]` and `lora_B.weight` `[out, rank]`.
lora_B is random (peft starts it at zero, which would make the adapter a no-op), so the adapter changes
the tokens.

    python tests/vllm_lora.py MODEL ADAPTER_A ADAPTER_B OUT [--gaudi-standin] [--prompt-logprobs]

runs `lora_requests()` through one engine (the 64-token budget chunks the long prompts; requests with
adapter A, adapter B and none share steps) and writes tokens and top-2 logprobs per case to OUT.

Three adapter slots for two adapters: vLLM 0.32's CPU LoRA ops (`lora/ops/torch_ops`, `bgmv_*`) index the
stacked weights with the token's slot, and "no adapter" is slot -1, which Python indexing turns into the
last slot. With every slot holding an adapter, vLLM's CPU reference applies the last one to the requests
without an adapter whenever they share a step with LoRA requests (seen here: two slots, the requests
without an adapter generated adapter b's tokens); a free last slot holds zeros.
"""
from __future__ import annotations

import contextlib
import json
import os

RANK = 8
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def make_adapter(path: str, model: str, seed: int, scale: float = 0.1) -> str:
    """A random rank-8 LoRA adapter for the LlamaForCausalLM at `model`, saved to `path`; returns `path`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    head = config.hidden_size // config.num_attention_heads
    shapes = {"q_proj": (config.hidden_size, config.num_attention_heads * head),
              "k_proj": (config.hidden_size, config.num_key_value_heads * head),
              "v_proj": (config.hidden_size, config.num_key_value_heads * head),
              "o_proj": (config.num_attention_heads * head, config.hidden_size),
              "gate_proj": (config.hidden_size, config.intermediate_size),
              "up_proj": (config.hidden_size, config.intermediate_size),
              "down_proj": (config.intermediate_size, config.hidden_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for block, names in MODULES.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * scale
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model, "r": RANK,
                   "lora_alpha": 2 * RANK, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                   "target_modules": [n for names in MODULES.values() for n in names]}, f)
    return path


def lora_requests(prompt_logprobs: bool = False) -> list[dict]:
    """Four prompts (3 to 150 tokens: the long ones arrive in several 64-token chunks), each with adapter
    "a", adapter "b" and none (`adapter` None), all submitted together; and prefixes of the 70-token prompt
    (`PREFIXES` tokens, one token each), whose first token's logprob is a prompt logprob of the 70-token
    prompt. `prompt_logprobs`: the 70-token requests ask for them (vLLM 0.32's CPU runner cannot compute
    them under LoRA: see the test)."""
    import random

    from vllm_helpers import VOCAB

    rng = random.Random(99)
    prompts = {f"p{n}": [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 20, 70, 150)}
    out = [dict(name=f"{p}_{a or 'none'}", prompt=toks, adapter=a, max_tokens=12,
                prompt_logprobs=prompt_logprobs and p == "p70")
           for p, toks in prompts.items() for a in (None, "a", "b")]
    return out + [dict(name=f"p70pre{k}_{a or 'none'}", prompt=prompts["p70"][:k], adapter=a, max_tokens=1,
                       prompt_logprobs=False) for k in PREFIXES for a in (None, "a", "b")]


PREFIXES = (9, 40, 66)


def run(model: str, adapters: dict[str, str], out: str, gaudi_standin: bool = False,
        prompt_logprobs: bool = False) -> None:
    import vllm_helpers as H

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device = H.gaudi_standin_context("float32") if gaudi_standin else contextlib.nullcontext()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    requests = lora_requests(prompt_logprobs)
    with device:
        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
                  max_model_len=H.MAX_MODEL_LEN, block_size=H.BLOCK_SIZE, max_num_seqs=H.MAX_NUM_SEQS,
                  max_num_batched_tokens=H.MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True,
                  enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20,
                  enable_lora=True, max_loras=3, max_lora_rank=RANK, max_cpu_loras=3)
        params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, detokenize=False, ignore_eos=True,
                                 prompt_logprobs=1 if r["prompt_logprobs"] else None) for r in requests]
        lora = [None if r["adapter"] is None else LoRARequest(r["adapter"], ids[r["adapter"]], adapters[r["adapter"]])
                for r in requests]
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, lora_request=lora,
                            use_tqdm=False)
    results = {r["name"]: {"samples": [{"tokens": list(c.token_ids),
                                        "logprobs": [H._logprob_dict(e) for e in c.logprobs]} for c in o.outputs],
                           "prompt_logprobs": None if o.prompt_logprobs is None else
                           [None if e is None else H._logprob_dict(e) for e in o.prompt_logprobs]}
               for r, o in zip(requests, outs)}
    with open(out, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    import sys

    if "--gaudi-standin" not in sys.argv:
        import vllm_helpers

        vllm_helpers.keep_vllm_gaudi_out()
    run(sys.argv[1], {"a": sys.argv[2], "b": sys.argv[3]}, sys.argv[4], "--gaudi-standin" in sys.argv,
        "--prompt-logprobs" in sys.argv)
