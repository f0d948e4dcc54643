"""A tiny random hybrid model (attention beside Mamba2 layers) generated with one engine, for the hybrid tests.

`python tests/vllm_hybrid_helpers.py make-granite PATH` saves a random-weight `GraniteMoeHybridForCausalLM`
(Granite-4.0-h's architecture: Mamba2, attention, Mamba2; float32, 64-token Mamba chunks);
`make-qwen3-next PATH` a random-weight `Qwen3NextForCausalLM` (GatedDeltaNet, attention; bfloat16);
`python tests/vllm_hybrid_helpers.py run --model PATH --out OUT [--dtype D] [--long] [--no-prefix-caching]
[--gaudi-standin]` generates
`hybrid_prompts()` with one engine (chunked prefill, 64-token budget, prefix caching, which vLLM runs in its
Mamba 'align' mode), in the `vllm_helpers.run_scenario` result format; vLLM aligns the block size asked for
(`--block-size`) to the hybrid (an attention page holds a Mamba state).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import vllm_helpers
import vllm_model_helpers

VOCAB = vllm_model_helpers.VOCAB
CHUNK = 64  #: the Mamba2 layers' chunk size


def make_tiny_granite_hybrid(path: str, hidden: int = 128, seed: int = 0) -> str:
    """Save a random-weight GraniteMoeHybridForCausalLM (float32; layers Mamba2, attention, Mamba2; a dense
    shared MLP, no experts)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden, shared_intermediate_size=2 * hidden,
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=0, mamba_n_heads=8, mamba_d_head=32,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=CHUNK,
        max_position_embeddings=vllm_helpers.MAX_MODEL_LEN, position_embedding_type="nope", initializer_range=0.05,
        torch_dtype="float32", architectures=["GraniteMoeHybridForCausalLM"], bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    GraniteMoeHybridForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_qwen3_next(path: str, seed: int = 0) -> str:
    """Save a random-weight Qwen3NextForCausalLM (bfloat16: vLLM 0.32's CPU GatedDeltaNet runs in bf16 only;
    a GatedDeltaNet layer, then an attention layer; 4 experts; head dims 64)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=vllm_helpers.MAX_MODEL_LEN,
        initializer_range=0.05, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
        architectures=["Qwen3NextForCausalLM"])
    torch.manual_seed(seed)
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def hybrid_prompts(past_block: bool = False) -> list[list[dict]]:
    """Wave 1: ragged prompts, one longer than the budget (chunked, across Mamba chunks and blocks); wave 2: a
    prompt sharing wave 1's first 160 tokens (prefix-cache hit: the Mamba state restored at a block boundary).
    `past_block`: two more waves past 256 tokens (vllm-gaudi's hybrid block size): a 300-token prompt beside a short
    one, then a prompt sharing its first 288 tokens (a hit on the state cached at token 256)."""
    toks = vllm_helpers.token_maker(6)

    long = toks(200)
    wave1 = [dict(name="one", prompt=toks(1), max_tokens=10),
             dict(name="p17", prompt=toks(17), max_tokens=12, prompt_logprobs=True),
             dict(name="long200", prompt=long, max_tokens=10, prompt_logprobs=True),
             dict(name="p45", prompt=toks(45), max_tokens=8)]
    wave2 = [dict(name="prefix_hit", prompt=long[:160] + toks(30), max_tokens=10, prompt_logprobs=True),
             dict(name="p9", prompt=toks(9), max_tokens=12)]
    if not past_block:
        return [wave1, wave2]
    long300 = toks(300)
    wave3 = [dict(name="long300", prompt=long300, max_tokens=8, prompt_logprobs=True),
             dict(name="p70", prompt=toks(70), max_tokens=6)]
    wave4 = [dict(name="hit300", prompt=long300[:288] + toks(20), max_tokens=8, prompt_logprobs=True)]
    return [wave1, wave2, wave3, wave4]


def run_hybrid(model: str, out: str, gaudi_standin: bool = False, block_size: int | None = None,
               dtype: str = "float32", past_block: bool = False, prefix_caching: bool = True) -> None:
    """`hybrid_prompts(past_block)` with one engine in this process; `block_size`: the one asked for (vLLM aligns
    it for the hybrid: the attention page must hold a Mamba state)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    device = vllm_helpers.gaudi_standin_context(dtype) if gaudi_standin else contextlib.nullcontext()
    extra = dict(dtype=dtype, enable_prefix_caching=prefix_caching)
    if block_size is not None:
        extra["block_size"] = block_size
    with device:
        vllm_model_helpers._run_mla(model, out, 0, extra, waves=hybrid_prompts(past_block))


def main(argv=None) -> int:
    vllm_helpers.keep_vllm_gaudi_out()
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("make-granite").add_argument("path")
    sub.add_parser("make-qwen3-next").add_argument("path")
    run = sub.add_parser("run", help="generate the hybrid scenario with one engine")
    run.add_argument("--model", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--dtype", default="float32")
    run.add_argument("--block-size", type=int, default=None, help="the block size asked for (default: vLLM's)")
    run.add_argument("--long", action="store_true", help="two more waves past 256 tokens (hybrid_prompts)")
    run.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    vllm_helpers.add_standin_flag(run)
    args = parser.parse_args(argv)
    if args.cmd == "make-granite":
        make_tiny_granite_hybrid(args.path)
    elif args.cmd == "make-qwen3-next":
        make_tiny_qwen3_next(args.path)
    else:
        run_hybrid(args.model, args.out, args.gaudi_standin, args.block_size, args.dtype, args.long,
                   args.prefix_caching)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
