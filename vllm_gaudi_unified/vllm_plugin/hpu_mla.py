"""MLA models (DeepSeek-V2/V3/R1, Kimi K2) inside vllm-gaudi, through unified attention in latent space.

How vllm-gaudi runs an MLA layer (`vllm_gaudi/attention/oot_mla.py`): its
`HPUMLAAttention.forward_impl(q, kv_c_normed, k_pe, kv_cache, attn_metadata)`
joins each new token's latent (`kv_c_normed`, `k_pe`: `[T, L + R]`), writes it
through the impl's `latent_cache_k(latent, kv_cache[0], slot_mapping)`, then by
`attn_metadata.is_prompt` sends the step either to the impl's `forward_mha`
(prompts: expanded per-head K/V) or, with the query absorbed through `W_UK_T`,
to `forward_mqa(q_nope_absorbed, q_pe, kv_cache, attn_metadata)` and the
output through `W_UV` (`_v_up_proj`). Its cache is the 4-tuple
`(latent_cache, None, None, None)`, `latent_cache` `[(num_blocks + 1) *
block_size, L + R]` (`HPUMLAAttentionBackend.get_kv_cache_shape`; the extra
block takes the padding rows' writes).

Here the unified metadata says `is_prompt = False` (`UnifiedHpuMetadata`), so
the whole step, prompts and chunks included, takes the absorbed branch, and
`forward_mqa` is one `mla.mla_attention` call over the step's plan, with the
cache viewed (never copied) as `[num_blocks + 1, block_size, L + R]`. It is
handed the cache but not the new tokens' latents: the impl's `latent_cache_k`
(vllm-gaudi's cache write) keeps the latent it has just written.

The impl is vllm-gaudi's `HPUMLAImpl` (set-up, feature refusals, the model
runner's view of it) with `forward_mqa` replaced and `forward_mha` unused.

Prompts stay latent here, unlike the CPU path (`mla_backend.py`: the prompt
route's rows expanded, `mla_prompts.py`, faster for prompts: `mla.py`):
vllm-gaudi's `forward_impl` picks one branch per step by `is_prompt` and has
no split of a step's rows between the two forms, and `is_prompt` is read
beyond the layer (`_configure_lora`, vllm-gaudi's runner), so only a step of
prompts alone could go expanded, through a `forward_mha` of its calling
convention: not done.
"""
from __future__ import annotations

import inspect
from typing import ClassVar

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm_gaudi.attention.backends.hpu_attn import HPUMLAAttentionBackend, HPUMLAImpl
from vllm_gaudi.extension.utils import VLLMKVCache

from vllm_gaudi_unified.mla import mla_attention
from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata

#: The name vLLM's registry knows the Gaudi MLA backend by.
HPU_MLA_BACKEND_NAME = "GAUDI_UNIFIED_HPU_MLA"


def register_hpu_mla_backend() -> None:
    """Add `HPU_MLA_BACKEND_NAME` to vLLM's `AttentionBackendEnum` (idempotent); see `backend.register_backend`."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register_backend

    if HPU_MLA_BACKEND_NAME not in AttentionBackendEnum.__members__:
        vllm_register_backend(HPU_MLA_BACKEND_NAME, f"{__name__}.{UnifiedHpuMLABackend.__qualname__}")


class UnifiedHpuMLABackend(HPUMLAAttentionBackend):
    """vllm-gaudi's MLA cache layout (`[(num_blocks + 1) * block_size, L + R]`, no value cache), block copy and
    swap; the unified MLA backend's declarations."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    # vllm-gaudi's runner names an unquantized cache by its dtype, vLLM's config by "auto". No fp8: vllm-gaudi
    # quantizes MLA latents through INC only (fp8_inc with its own matmuls), which is not wired here.
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", "float32"]

    @staticmethod
    def get_name() -> str:
        return HPU_MLA_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["UnifiedHpuMLAImpl"]:
        return UnifiedHpuMLAImpl

    @staticmethod
    def get_metadata_cls() -> type[UnifiedHpuMetadata]:
        return UnifiedHpuMetadata

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]  # as the unified HPU backend (vllm-gaudi's default 128 is one)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The latent: kv_lora_rank + rope dims (DeepSeek: 512 + 64), as the CPU path's MLA backend.
        return list(range(32, 1025, 16))

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


class LatentWrite(VLLMKVCache):
    """vllm-gaudi's cache write (`index_copy_` of the new latents at their slots), keeping the latents written
    for the layer's `forward_mqa`, which is handed only the cache."""

    latent: torch.Tensor | None = None

    def forward(self, input, cache, slot_mapping, *args, **kwargs):
        self.latent = input
        return super().forward(input, cache, slot_mapping, *args, **kwargs)


class UnifiedHpuMLAImpl(HPUMLAImpl):
    """vllm-gaudi's `HPUMLAImpl` whose absorbed branch is unified attention over the whole step."""

    def __init__(self, *args, **kwargs) -> None:
        arguments = inspect.signature(HPUMLAImpl.__init__).bind(self, *args, **kwargs)
        arguments.apply_defaults()
        a = arguments.arguments
        unsupported = [what for what, present in (
            (f"kv_cache_dtype {a['kv_cache_dtype']!r} (MLA: {', '.join(UnifiedHpuMLABackend.supported_kv_cache_dtypes)})",
             a["kv_cache_dtype"] not in UnifiedHpuMLABackend.supported_kv_cache_dtypes),
            ("attention sinks in an MLA layer", a["sinks"] is not None),
            ("KV cache sharing between layers", a["kv_sharing_target_layer_name"] is not None),
        ) if present]
        if unsupported:
            raise NotImplementedError("The unified MLA backend on Gaudi does not support " + ", ".join(unsupported))
        super().__init__(*args, **kwargs)
        self.latent_cache_k = LatentWrite()

    def forward_mha(self, q, latent_vec_k, k_cache, attn_metadata) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__}.forward_mha reached with metadata of type "
                           f"{type(attn_metadata).__name__} (is_prompt={getattr(attn_metadata, 'is_prompt', None)}): "
                           "the unified runner's metadata sends every token through forward_mqa; vllm-gaudi's own "
                           "runner or prompt path built this step")

    def forward_mqa(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache, attn_metadata: UnifiedHpuMetadata
                    ) -> torch.Tensor:
        """q_nope `[T, H, L]` (absorbed through W_UK), q_pe `[T, H, R]`, k_cache vllm-gaudi's `(latent_cache,
        None, None, None)` holding the step's new latents already -> `[T, H, L]` latent outputs."""
        if not isinstance(attn_metadata, UnifiedHpuMetadata):
            raise TypeError(f"attn_metadata of type {type(attn_metadata).__name__}: the unified MLA impl runs only "
                            "the steps the unified model runner plans (UnifiedHpuModelRunner)")
        latent, self.latent_cache_k.latent = self.latent_cache_k.latent, None
        if latent is None:
            raise RuntimeError("forward_mqa without the step's latents: the layer did not write them through "
                               "impl.latent_cache_k first (vllm-gaudi's HPUMLAAttention.forward_impl does)")
        cache = k_cache[0] if isinstance(k_cache, (tuple, list)) else k_cache
        md = attn_metadata
        rows = md.slot_mapping.shape[0]
        if q_nope.shape[0] != rows or latent.shape[0] != rows:
            raise ValueError(f"query rows {q_nope.shape[0]} / latent rows {latent.shape[0]} != planned rows {rows} "
                             "(slot_mapping): the runner's model inputs and its plan disagree")
        query = torch.cat([q_nope, q_pe], dim=-1)
        if query.dtype != cache.dtype:
            query, latent = query.to(cache.dtype), latent.to(cache.dtype)
        # vllm-gaudi's [(num_blocks + 1) * block_size, L + R] as the core's [num_blocks + 1, block_size, L + R]:
        # view() raises rather than copy.
        blocks = cache.view(-1, md.batch.block_size, cache.shape[-1])
        out = mla_attention(query, latent, blocks, md.batch, self.scale, self.kv_lora_rank)
        return out.to(q_nope.dtype)
