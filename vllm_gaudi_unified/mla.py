"""MLA (multi-head latent attention: DeepSeek-V2/V3/R1, Kimi K2) through the unified pipeline: latent space, prompts expanded.

The cache holds one latent per token: `kv_lora_rank` values (the normalised
compressed KV, `c`) followed by `rope` dims (the rotated shared key, `k_pe`),
576 for DeepSeek. Attention per head h, with `W_UK_h` `[P, L]` and `W_UV_h`
`[V, L]` the up-projections of the model's `kv_b_proj`::

    score = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = (W_UK_h^T q_nope_h, q_pe_h) . (c, k_pe)
    out_h = W_UV_h sum_k p_k c_k

So with the query *absorbed* (`absorb_query`: `[T, H, L + R]`) every head
attends to the same latent: one KV head (MQA) whose keys are the whole latent
and whose values are its first `L` dims, and the output `[T, H, L]` leaves
latent space through `W_UV` (`expand_output`). That is what vLLM's MLA
backends do for decodes, and here too: the planner, the buckets and the three
paths stay as they are (a block is a block; only the head dims differ), the
cache is read in place (keys and values are views of it, no copy, no per-head
expansion of the context).

Which form for which rows: per (query, key) pair the latent form costs `H *
(2L + R)` products, the expanded form (per-head keys `P + R`, values `V`)
`H * (P + R + V)`, 3.4x fewer at DeepSeek's shapes, but the expanded form must
first up-project every latent it reads (`L * H * (P + V)` per token). A decode
reads each context token for one query row: latent wins by far (115x fewer
products per context token at DeepSeek's shapes), so decodes, and every token
off the prompt route, run here. A prompt's rows share its keys: the
up-projection is paid once per key for many rows, and the expanded head dims
(192 / 128, not 576 / 512) are ones fused kernels take. So the prompt route's
rows run expanded (`mla_prompts.py`; `mla_attention(..., prompt_route=False)`
leaves them out here) wherever the caller can split a step's rows by form:
vLLM's MLA layer on the CPU platform does (`vllm_plugin/mla_backend.py`), and
the unified impl in vllm-gaudi's layer, which picks one branch per step, does
on the steps whose bucket has a prompt route (`vllm_plugin/hpu_mla.py`). Measured on an H100: a 2048-token prompt, a 2048-token chunk over 4096
tokens of context, and 64 decodes beside a 2048-token prompt, latent against
expanded, through this code.
"""
from __future__ import annotations

import torch

from vllm_gaudi_unified.attention import attend_step, check_tensor, unified_attention
from vllm_gaudi_unified.paths.kv_quant import is_fp8
from vllm_gaudi_unified.plan.arrays import is_int


def latent_views(latent: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., L + R]` latents (new tokens `[T, L + R]` or a cache `[num_blocks, block_size, L + R]`) ->
    (keys, values) with one KV head, `[..., 1, L + R]` and `[..., 1, L]`: views of the same memory."""
    if latent.shape[-1] <= kv_lora_rank or kv_lora_rank < 1:
        raise ValueError(f"latent head dim {latent.shape[-1]} must exceed kv_lora_rank {kv_lora_rank} "
                         "(latent values then rope dims)")
    keys = latent.unsqueeze(-2)
    return keys, keys[..., :kv_lora_rank]


def mla_attention(query: torch.Tensor, latent: torch.Tensor, latent_cache: torch.Tensor, batch, scale: float,
                  kv_lora_rank: int, *, checked: bool = False, kv_scale=None, **kwargs) -> torch.Tensor:
    """Latent-space attention of a step: query `[T, H, L + R]` (absorbed, `absorb_query`), the new
    tokens' latents `[T, L + R]`, the cache `[num_blocks, block_size, L + R]` (new tokens already
    written or not: the planner reads positions below each context length only) -> `[T, H, L]`.

    `kv_scale`: an fp8 cache's scale (`stored = latent / kv_scale`; a float or a one-element tensor), the
    keys' and the values' alike (they are the same stored bytes); `latent` then as stored, dequantized.
    `checked`: the inputs were checked for this step already and q/latent have the bucket's rows
    (a server's layers after the first: `attention.attend_step`). Other keywords go to the core
    (`logits_soft_cap`, `sinks`; with `checked`, `prompt_route=False`: the prompt route's rows left to the
    expanded form, `mla_prompts.py`)."""
    try:
        key, value = latent_views(latent, kv_lora_rank)
        key_cache, value_cache = latent_views(latent_cache, kv_lora_rank)
        run = attend_step if checked else unified_attention
        return run(query, key, value, key_cache, value_cache, batch, scale, k_scale=kv_scale, v_scale=kv_scale,
                   **kwargs)
    except (AttributeError, TypeError, ValueError):  # the core names the latents' views (key, key_cache)
        bad = latent_error(query, latent, latent_cache, kv_lora_rank)  # (None: the error stands)
        if bad is None:
            raise
        raise bad from None


def latent_error(query, latent, latent_cache, kv_lora_rank) -> ValueError | None:
    """The error naming `mla_attention`'s own argument (a list, a numpy array, another device or dtype than
    the query's), or None: checked only once a call failed, so a server's layers pay nothing for it."""
    try:
        check_tensor("latent", latent, 2)
        check_tensor("latent_cache", latent_cache, 3)
        if not is_int(kv_lora_rank):
            raise ValueError(f"kv_lora_rank must be an int, got {kv_lora_rank!r}")
        if isinstance(query, torch.Tensor) and query.dtype.is_floating_point:  # (else the core's error names it)
            for name, x in (("latent", latent), ("latent_cache", latent_cache)):
                if x.device != query.device:
                    raise ValueError(f"{name} is on {x.device} but query is on {query.device}")
                if x.dtype != query.dtype and not (name == "latent_cache" and is_fp8(x.dtype)):
                    raise ValueError(f"{name} dtype {x.dtype} differs from the query's {query.dtype}")
    except ValueError as exc:
        return exc
    return None


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope `[T, H, P]`, q_pe `[T, H, R]`, W_UK `[H, P, L]` -> the latent query `[T, H, L + R]`."""
    return torch.cat([torch.einsum("thp,hpl->thl", q_nope, w_uk), q_pe], dim=-1)


def expand_output(out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Latent output `[T, H, L]`, W_UV `[H, L, V]` -> per-head output `[T, H, V]`."""
    return torch.einsum("thl,hlv->thv", out, w_uv)
