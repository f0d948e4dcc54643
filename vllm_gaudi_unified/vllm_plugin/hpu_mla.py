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

Here the unified metadata's `is_prompt` (`UnifiedHpuMetadata`) is True on
the steps whose bucket has a prompt route in its final form
(`mla_prompts.expanded_step`: `bucket.num_prompts > 0`, fused kernels on), so
the branch is a function of the bucket and one HPU graph per bucket holds; the
bucket key already records it (`num_prompts`). Such a step goes to the impl's
`forward_mha`, which is handed every row's query unabsorbed and splits the step
itself, as vLLM's MLA layer does on the CPU path (`mla_backend.py`): the prompt
route's rows run expanded (`mla_prompts.mla_prompt_rows`: context and new
latents through `kv_b_proj`, one fused call; faster for prompts: `mla.py`),
written over the other rows, which run latent: queries absorbed through the
layer's `W_UK_T`, one `mla.mla_attention(..., prompt_route=False)` call, the
layer's `_v_up_proj` (the layer's own weights and up-projection, looked up once
in the forward context: `forward_mha` is not handed the layer). A step of
prompts alone (`plan.prompts_only`) skips the latent part; in an HPU graph
the branch of the step it was captured for (warmup's) replays, and a graph of
a bucket with other paths' work keeps the latent part, masked work that a
step of prompts alone padded to it writes over. Every other step (decodes, short drafts
over a shared prefix, batch-invariant mode, fused kernels off) takes the
absorbed branch: `forward_mqa` is one `mla.mla_attention` call over the step's
plan. Either way the cache is viewed (never copied) as `[num_blocks + 1,
block_size, L + R]`. `forward_mqa` is handed the cache but not the new tokens'
latents: the impl's `latent_cache_k` (vllm-gaudi's cache write) keeps the
latent it has just written.

Where else `is_prompt` is read (vllm-gaudi 091bbadd), none of it on this
path: its runner's `_check_config` and `_use_graphs` (in
`_execute_model_generic`, which the unified runner replaces), its metadata
processor's biases (`UnifiedMetadataProcessor` passes unified metadata
through first), its model adapter's `mark_unbacked` of a `block_list` (the
unified runner hands a dict, with no `block_list`), its own attention impl
(the unified backends replace it), its Mamba mixer and Qwen3.5's
linear-attention layers (none in an MLA model). `_configure_lora`'s
`is_prompt` is an argument of the sampling code, not the metadata's.

The impl is vllm-gaudi's `HPUMLAImpl` (set-up, feature refusals, the model
runner's view of it) with `forward_mqa`, `forward_mha` and its cache write
(`LatentWrite`: an `fp8_inc` cache's latents stored as vllm-gaudi stores them,
read back by every form with the cache's one scale) replaced.
"""
from __future__ import annotations

import inspect
import weakref
from typing import ClassVar

import torch
from vllm.v1.attention.backend import MultipleOf
from vllm_gaudi.attention.backends.hpu_attn import HPUMLAAttentionBackend, HPUMLAImpl
from vllm_gaudi.extension.utils import VLLMKVCache

from vllm_gaudi_unified.attention import check_inputs
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.mla import latent_views, mla_attention
from vllm_gaudi_unified.mla_prompts import mla_prompt_rows
from vllm_gaudi_unified.paths.kv_quant import check_scale, is_fp8, quantize, read_blocks
from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata
from vllm_gaudi_unified.vllm_plugin.mla_backend import GaudiUnifiedMLABackend

logger = get_logger("vllm.gaudi_unified.mla")  # under "vllm": vLLM's log settings

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
    # vllm-gaudi's runner names an unquantized cache by its dtype, vLLM's config by "auto"; an fp8 latent cache
    # is e4m3 ("fp8_inc" is vllm-gaudi's name for it), one per-tensor scale (`LatentWrite`).
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3",
                                                 "fp8_inc"]

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
        return GaudiUnifiedMLABackend.get_supported_kernel_block_sizes()  # (vllm-gaudi's default 128 is one)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return GaudiUnifiedMLABackend.get_supported_head_sizes()  # the latent: kv_lora_rank + rope dims

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


class LatentWrite(VLLMKVCache):
    """vllm-gaudi's cache write (`index_copy_` of the new latents at their slots), keeping the latents written,
    as stored, for the layer's `forward_mqa`, which is handed only the cache.

    An fp8 cache (`fp8_inc`) stores `latent / SCALE` rounded to nearest and saturated at vllm-gaudi's `FP8_MAX`,
    as the HPU cast of its own `VLLMFP8KVCache` does (whose default scale, 1.0, it uses without INC; INC's
    calibrated scales are not used, as for the other attention layers: `hpu_backend.py`)."""

    latent: torch.Tensor | None = None
    #: the latent cache's one per-tensor scale (`stored = latent / SCALE`)
    SCALE: ClassVar[float] = 1.0

    def forward(self, input, cache, slot_mapping, *args, **kwargs):
        if not is_fp8(cache.dtype):
            self.latent = input
            return super().forward(input, cache, slot_mapping, *args, **kwargs)
        logger.info_once("unified MLA on Gaudi: fp8 latent cache (%s, scale %s)", cache.dtype, self.SCALE)
        stored = quantize_latent(input, cache.dtype)
        cache.view(torch.uint8).index_copy_(0, slot_mapping, stored.view(torch.uint8))  # (no fp8 index_copy_ on CPU)
        self.latent = as_stored(stored, input.dtype)
        return cache


def quantize_latent(latent: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """`latent` as `LatentWrite` stores it in an fp8 cache: `latent / SCALE`, rounded to nearest, saturated at
    vllm-gaudi's `FP8_MAX` (240 on Gaudi2, whose e4m3 has that range, else 448)."""
    from vllm_gaudi.extension.ops import FP8_MAX

    return quantize(latent, fp8_dtype, LatentWrite.SCALE, saturate_at=FP8_MAX)


def as_stored(latent: torch.Tensor, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The new latents as the cache holds them, in `dtype`: an fp8 latent (or one bound for an fp8 cache of
    `cache_dtype`) quantized as `LatentWrite` stores it and dequantized; the new tokens attend to each other as
    their later steps will read them."""
    if cache_dtype is not None and is_fp8(cache_dtype) and not is_fp8(latent.dtype):
        latent = quantize_latent(latent, cache_dtype)
    if is_fp8(latent.dtype):
        return read_blocks(latent, latent.shape[0], latent_scale(), dtype)
    return latent.to(dtype)


def latent_scale() -> float | None:
    """The `kv_scale` the core takes for the latent cache (None: 1.0, nothing to multiply)."""
    return None if LatentWrite.SCALE == 1.0 else LatentWrite.SCALE


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

    def forward_mha(self, q: torch.Tensor, latent_vec_k: torch.Tensor, k_cache, attn_metadata: UnifiedHpuMetadata
                    ) -> torch.Tensor:
        """A step whose bucket has a prompt route (`is_prompt`): q `[T, H, P + R]` not absorbed, the step's new
        latents `[T, L + R]` (written to the cache already), k_cache `(latent_cache, None, None, None)` ->
        `[T, H * V]`: the prompt route's rows expanded, the others latent (module docstring)."""
        md = self._check(attn_metadata, "forward_mha")
        self.latent_cache_k.latent = None  # handed here as latent_vec_k
        rows = md.slot_mapping.shape[0]
        heads, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        q = q.reshape(-1, heads, nope + rope)
        if q.shape[0] != rows or latent_vec_k.shape[0] != rows:
            raise ValueError(f"query rows {q.shape[0]} / latent rows {latent_vec_k.shape[0]} != planned rows {rows} "
                             "(slot_mapping): the runner's model inputs and its plan disagree")
        blocks = self._blocks(k_cache, md)
        # The new latents as the cache stores them (as their context will be read in later chunks).
        stored = as_stored(latent_vec_k, q.dtype, blocks.dtype)
        out = None
        if not md.batch.plan.prompts_only:  # decodes beside the prompts: latent, as forward_impl's other branch
            layer = self._layer()
            q_nope, q_pe = q.split([nope, rope], dim=-1)
            absorbed = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)
            latent = self._attend(absorbed, q_pe, stored, blocks, md, prompt_route=False)
            out = layer._v_up_proj(latent).view(rows, heads, self.v_head_dim)
        expanded = mla_prompt_rows(q, stored.to(self._compute_dtype(q, blocks)), blocks, md.batch, self.scale,
                                   self.kv_lora_rank, lambda c: self.kv_b_proj(c)[0],
                                   out=None if out is None else out.to(q.dtype), kv_scale=latent_scale())
        logger.info_once("unified MLA on Gaudi: prompt rows in the expanded form (kv_b_proj, one fused call), "
                         "decodes latent")
        return expanded.reshape(rows, heads * self.v_head_dim)

    def forward_mqa(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache, attn_metadata: UnifiedHpuMetadata
                    ) -> torch.Tensor:
        """q_nope `[T, H, L]` (absorbed through W_UK), q_pe `[T, H, R]`, k_cache vllm-gaudi's `(latent_cache,
        None, None, None)` holding the step's new latents already -> `[T, H, L]` latent outputs."""
        md = self._check(attn_metadata, "forward_mqa")
        latent, self.latent_cache_k.latent = self.latent_cache_k.latent, None
        if latent is None:
            raise RuntimeError("forward_mqa without the step's latents: the layer did not write them through "
                               "impl.latent_cache_k first (vllm-gaudi's HPUMLAAttention.forward_impl does)")
        rows = md.slot_mapping.shape[0]
        if q_nope.shape[0] != rows or latent.shape[0] != rows:
            raise ValueError(f"query rows {q_nope.shape[0]} / latent rows {latent.shape[0]} != planned rows {rows} "
                             "(slot_mapping): the runner's model inputs and its plan disagree")
        return self._attend(q_nope, q_pe, latent, self._blocks(k_cache, md), md)

    def _attend(self, q_nope, q_pe, latent, blocks, md, prompt_route: bool = True) -> torch.Tensor:
        """Latent attention over the step's plan -> `[T, H, L]` in q_nope's dtype; `prompt_route=False`:
        the prompt route's rows left out (zero), `forward_mha` writes them."""
        query = torch.cat([q_nope, q_pe], dim=-1)
        dtype = self._compute_dtype(query, blocks)
        query, latent, kv_scale = query.to(dtype), latent.to(dtype), latent_scale()
        if prompt_route:
            out = mla_attention(query, latent, blocks, md.batch, self.scale, self.kv_lora_rank, kv_scale=kv_scale)
        else:  # attend_step's keyword: checked here, as unified_attention would
            (key, value), (key_cache, value_cache) = (latent_views(x, self.kv_lora_rank) for x in (latent, blocks))
            check_inputs(query, key, value, key_cache, value_cache, md.batch, self.scale, None, None)
            check_scale("kv_scale", kv_scale, key_cache)
            if query.shape[0] != md.batch.bucket.query_len:
                raise ValueError(f"query rows {query.shape[0]} != the bucket's {md.batch.bucket.query_len}")
            out = mla_attention(query, latent, blocks, md.batch, self.scale, self.kv_lora_rank, checked=True,
                                kv_scale=kv_scale, prompt_route=False)
        return out.to(q_nope.dtype)

    @staticmethod
    def _compute_dtype(query: torch.Tensor, blocks: torch.Tensor) -> torch.dtype:
        """The cache's dtype (vllm-gaudi's impl attends in it: float32 activations over a bf16 cache), or the
        query's over an fp8 cache (dequantized as read)."""
        return query.dtype if is_fp8(blocks.dtype) else blocks.dtype

    @staticmethod
    def _check(attn_metadata, where: str) -> UnifiedHpuMetadata:
        if not isinstance(attn_metadata, UnifiedHpuMetadata):
            raise TypeError(f"{where}: attn_metadata of type {type(attn_metadata).__name__}: the unified MLA impl "
                            "runs only the steps the unified model runner plans (UnifiedHpuModelRunner); "
                            "vllm-gaudi's own runner or prompt path built this step")
        return attn_metadata

    @staticmethod
    def _blocks(k_cache, md: UnifiedHpuMetadata) -> torch.Tensor:
        """vllm-gaudi's `[(num_blocks + 1) * block_size, L + R]` as the core's `[num_blocks + 1, block_size,
        L + R]`: view() raises rather than copy."""
        cache = k_cache[0] if isinstance(k_cache, (tuple, list)) else k_cache
        return cache.view(-1, md.batch.block_size, cache.shape[-1])

    def _layer(self):
        """The `HPUMLAAttention` owning this impl (its `W_UK_T`, `_v_up_proj`), found once in the forward
        context's layers: vllm-gaudi's `forward_mha` call does not pass it. Held weakly (the layer holds the
        impl)."""
        layer = self._layer_ref() if getattr(self, "_layer_ref", None) is not None else None
        if layer is None:
            from vllm.forward_context import get_forward_context, is_forward_context_available

            layers = get_forward_context().no_compile_layers.values() if is_forward_context_available() else ()
            layer = next((x for x in layers if getattr(x, "impl", None) is self), None)
            if layer is None or getattr(layer, "W_UK_T", None) is None:
                raise RuntimeError(f"{type(self).__name__}: no MLA layer with this impl and its W_UK_T in the "
                                   "forward context (vllm-gaudi's HPUMLAAttention registers itself there)")
            self._layer_ref = weakref.ref(layer)
        return layer
