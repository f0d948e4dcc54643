"""MLA models (DeepSeek-V2/V3/R1, Kimi K2) on vLLM's CPU platform through unified attention.

How vLLM runs an MLA layer (`vllm/model_executor/layers/attention/mla_attention.py`):
`MLAAttention.forward` writes each new token's latent (`kv_c_normed`, `k_pe`)
into the layer's cache `[num_blocks, block_size, kv_lora_rank + rope]` through
the impl's `do_kv_cache_update`, then `forward_impl` sends the metadata's
first `num_decode_tokens` tokens through the absorbed path (queries times
`W_UK_T`, the impl's `forward_mqa` attending to the latent, the output times
`W_UV`) and the rest, the prefill tokens, through the impl's `forward_mha`
(queries not absorbed, output already per head in value space).

Here the step is planned once (the unified builder) and split where the plan's
prompt route starts (`mla_prompts.expanded_first`): its rows, when they are the
step's last tokens, are the prefill tokens and `forward_mha` runs them in the
expanded form (`mla_prompts.mla_prompt_rows`: context and new latents through
`kv_b_proj`, one fused call); every other token is a decode token and
`forward_mqa` is one `mla.mla_attention` call over the step's plan with the
prompt route left out. The builder asks vLLM to order each step's requests
decodes first (`reorder_batch_threshold` = 1, as vLLM's MLA builders do:
decodes, then chunks over context, then new prompts), so the prompt route is
a suffix in the common steps; when it is not (a short draft over a shared
prefix between prompts: it stays on the shared tiles), the whole step runs
latent, which is correct, only slower for its prompts (why expanded for
prompts: `mla_prompts.py`). `forward_mqa` is handed the cache but not the
new tokens' latents: the impl keeps them from the cache write the layer makes
just before.

The impl reuses vLLM's `CPUMLAImpl` for everything but the attention: its
set-up (which skips the GPU prefill kernels) and its cache write.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.v1.attention.backend import AttentionLayer, CommonAttentionMetadata, MultipleOf
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

from vllm_gaudi_unified.attention import BucketRows, check_inputs
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.mla import latent_views, mla_attention
from vllm_gaudi_unified.mla_prompts import expanded_first, mla_prompt_rows
from vllm_gaudi_unified.vllm_plugin.backend import GaudiUnifiedMetadata, GaudiUnifiedMetadataBuilder

logger = get_logger("vllm.gaudi_unified.mla")  # under "vllm": vLLM's log settings

#: The name vLLM's registry knows the MLA backend by.
MLA_BACKEND_NAME = "GAUDI_UNIFIED_MLA"


def register_mla_backend() -> None:
    """Add `MLA_BACKEND_NAME` to vLLM's `AttentionBackendEnum` (idempotent), as `backend.register_backend`."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register_backend

    if MLA_BACKEND_NAME not in AttentionBackendEnum.__members__:
        vllm_register_backend(MLA_BACKEND_NAME, f"{__name__}.{GaudiUnifiedMLABackend.__qualname__}")


@dataclass
class GaudiUnifiedMLAMetadata(GaudiUnifiedMetadata):
    """A planned step in the fields `MLAAttention.forward_impl` reads: the prompt route's rows (a suffix) are
    its prefill tokens, the others its decode tokens."""

    num_actual_tokens: int = 0
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    decode: object = None  #: the batch when there are decode tokens (forward_impl only checks it is set)
    prefill: object = None  #: the batch when there are prefill tokens


class GaudiUnifiedMLAMetadataBuilder(GaudiUnifiedMetadataBuilder):
    """The unified builder (plan, bucket, trace once per step), its metadata in MLA's field names."""

    #: vLLM orders each step's requests decodes first, prompts last (`reorder_batch_to_split_decodes_and_prefills`)
    reorder_batch_threshold: int | None = 1

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GaudiUnifiedMLAMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        t, batch = md.num_tokens, md.batch
        first = expanded_first(batch)
        first = t if first is None else first
        ends = common_attn_metadata.query_start_loc_cpu[1:batch.num_requests + 1].numpy()
        decodes = int(np.searchsorted(ends, first, side="right"))  # requests wholly before the prefill tokens
        return GaudiUnifiedMLAMetadata(batch=batch, slot_mapping=md.slot_mapping, num_tokens=t, rows=md.rows,
                                       num_actual_tokens=t, num_decodes=decodes, num_decode_tokens=first,
                                       num_prefills=batch.num_requests - decodes,
                                       decode=batch if first else None, prefill=batch if first < t else None)


class GaudiUnifiedMLABackend(MLACommonBackend):
    """What the unified MLA backend supports; vLLM selects it for `use_mla=True` (`platform.py`)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return MLA_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["GaudiUnifiedMLAImpl"]:
        return GaudiUnifiedMLAImpl

    @staticmethod
    def get_builder_cls() -> type[GaudiUnifiedMLAMetadataBuilder]:
        return GaudiUnifiedMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]  # vLLM's CPU platform sets 16 for MLA models

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The latent: kv_lora_rank + rope dims (DeepSeek: 512 + 64). The paths take any; whole 16-element
        # rows keep the HPU's matmul engine on full tiles.
        return list(range(32, 1025, 16))

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the planner reads the host query lengths (as the unified backend)


class GaudiUnifiedMLAImpl(CPUMLAImpl):
    """vLLM's CPU MLA impl (set-up, cache write) with `forward_mqa` = unified attention over the step's latent
    rows and `forward_mha` = its prompt rows in the expanded form."""

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """vLLM's CPU cache write; the step's new latents are kept for `forward_mqa` (the layer calls this
        right before it, and `forward_mqa` is handed only the cache)."""
        self._new_kv_c, self._new_k_pe = kv_c_normed, k_pe
        super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: GaudiUnifiedMLAMetadata, layer: AttentionLayer
                    ) -> tuple[torch.Tensor, None]:
        """q `[num_decode_tokens, H, L + R]` (or its (absorbed nope, rope) halves), the cache `[num_blocks,
        block_size, L + R]` holding the step's new latents already -> `[num_decode_tokens, H, L]` latent
        outputs (no LSE: no DCP). The prompt route runs here too unless `forward_mha` has its rows."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        md = attn_metadata
        t, rows, mqa = md.num_tokens, md.batch.bucket.query_len, q.shape[0]
        latent = self._new_latent(self._new_kv_c[:t], self._new_k_pe[:t], kv_c_and_k_pe_cache)
        pad = md.rows or BucketRows()
        q, latent = pad("mla_query", q, rows), pad("mla_latent", latent, rows)  # prefill rows' queries: zeros
        if not md.checked:  # once per step, as the unified impl
            key, value = latent_views(latent, self.kv_lora_rank)
            key_cache, value_cache = latent_views(kv_c_and_k_pe_cache, self.kv_lora_rank)
            check_inputs(q, key, value, key_cache, value_cache, md.batch, self.scale, None, None)
            md.checked = True
        out = mla_attention(q, latent, kv_c_and_k_pe_cache, md.batch, self.scale, self.kv_lora_rank, checked=True,
                            prompt_route=mqa == t)
        return out[:mqa], None

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: GaudiUnifiedMLAMetadata,
                    k_scale: torch.Tensor, output: torch.Tensor, output_scale: torch.Tensor | None = None) -> None:
        """The prefill tokens (the prompt route's rows, the step's last): q `[n, H, P + R]` not absorbed, their
        latents -> `output` `[n, H * V]`, in the expanded form (`mla_prompts.mla_prompt_rows`)."""
        if output_scale is not None:
            raise NotImplementedError("unified MLA: fused output quantization of the prefill rows is not supported")
        md = attn_metadata
        latent = self._new_latent(kv_c_normed, k_pe, kv_c_and_k_pe_cache)
        rows = mla_prompt_rows(q, latent, kv_c_and_k_pe_cache, md.batch, self.scale, self.kv_lora_rank,
                               lambda c: self.kv_b_proj(c)[0], first=md.num_decode_tokens)
        output.view(rows.shape).copy_(rows)
        logger.info_once("unified MLA: prompt rows in the expanded form (kv_b_proj, one fused call), decodes latent")

    @staticmethod
    def _new_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The new tokens' latents `[n, L + R]` as the cache stores them."""
        return torch.cat([kv_c, k_pe.flatten(1)], dim=-1).to(cache.dtype)
