"""Unified attention inside vllm-gaudi: backend, per-step metadata, impl, metadata pass-through.

vllm-gaudi's model runner never calls a backend's metadata builder, and its
replaced `Attention.forward` (`vllm_gaudi/ops/hpu_attention.py`) calls
`impl.forward(layer, query, key, value, kv_cache, attn_metadata)` with
vllm-gaudi's own shapes. So on Gaudi the pieces differ from the CPU path
(`backend.py`):

- `UnifiedHpuAttentionBackend` subclasses vllm-gaudi's `HPUAttentionBackend`, so the
  KV-cache shape (`[num_blocks * block_size, num_kv_heads, head_size]` per K and V, which
  vllm-gaudi's worker and runner allocate with one extra padding block), block copy and swap
  stay vllm-gaudi's; the feature declarations are the unified backend's.
- `UnifiedHpuMetadata`: what the runner subclass (`hpu_runner.py`) plans per step and KV cache
  group; it reaches the impl through vllm-gaudi's forward context, per layer.
- `UnifiedHpuAttentionImpl.forward` takes vllm-gaudi's calling convention as it is: query
  `[batch, seq, num_heads * head_size]` (the runner sends one flattened batch, `[1, T, ...]`),
  the cache 4-tuple `(k_cache, v_cache, k_scales, v_scales)`, viewed (never copied) as the
  core's `[num_blocks + 1, block_size, num_kv_heads, head_size]`. An fp8 (e4m3) cache gets the
  new K/V quantized the HPU cast's way (round to nearest, saturating at vllm-gaudi's `FP8_MAX`)
  with the layer's per-tensor scales, or with per-token scales stored in `k_scales` / `v_scales[0]`
  when vllm-gaudi allocated them (its dynamic KV quantization); the paths dequantize what they
  gather with the same scales (`paths/kv_quant.py`). An encoder-only layer has no cache (vLLM's empty
  `kv_cache`): it attends to the step's new tokens alone, as the CPU path's impl does.
- `UnifiedMetadataProcessor`: vllm-gaudi's model adapter post-processes the metadata of every
  forward (biases, block mappings for its own kernels); ours passes through unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionLayer, AttentionType, MultipleOf
from vllm_gaudi.attention.backends.hpu_attn import HPUAttentionBackend
from vllm_gaudi.v1.worker.hpu_model_runner import HPUAttentionMetadataProcessor

from vllm_gaudi_unified import UnifiedBatch, unified_attention
from vllm_gaudi_unified.graphs import compiled_attention
from vllm_gaudi_unified.mla_prompts import expanded_step
from vllm_gaudi_unified.paths.kv_quant import is_fp8, per_token_scales, quantize
from vllm_gaudi_unified.step_parts import StepParts, parts_attention
from vllm_gaudi_unified.vllm_plugin.backend import GaudiUnifiedAttentionBackend, GaudiUnifiedAttentionImpl
from vllm_gaudi_unified.vllm_plugin.cache_write import write_kv
from vllm_gaudi_unified.vllm_plugin.hpu_mamba import MambaStep

#: The name vLLM's registry knows the Gaudi backend by (`backend.BACKEND_NAME` is the CPU path's).
HPU_BACKEND_NAME = "GAUDI_UNIFIED_HPU_ATTN"


def register_hpu_backend() -> None:
    """Add `HPU_BACKEND_NAME` to vLLM's `AttentionBackendEnum` (idempotent); see `backend.register_backend`."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register_backend

    if HPU_BACKEND_NAME not in AttentionBackendEnum.__members__:
        vllm_register_backend(HPU_BACKEND_NAME, f"{__name__}.{UnifiedHpuAttentionBackend.__qualname__}")


class UnifiedHpuAttentionBackend(HPUAttentionBackend):
    """vllm-gaudi's cache layout and block operations; the unified backend's declarations."""

    forward_includes_kv_cache_update: bool = True  # vllm-gaudi's Attention.forward asserts it
    supported_dtypes: ClassVar[list[torch.dtype]] = GaudiUnifiedAttentionBackend.supported_dtypes
    # vllm-gaudi's runner names an unquantized cache by its dtype ("bfloat16"), vLLM's config by "auto";
    # fp8 is e4m3 only ("fp8_inc" is vllm-gaudi's name for it): vllm-gaudi's runner has no e5m2 cache.
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3",
                                                 "fp8_inc"]

    @staticmethod
    def get_name() -> str:
        return HPU_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["UnifiedHpuAttentionImpl"]:
        return UnifiedHpuAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type["UnifiedHpuMetadata"]:
        return UnifiedHpuMetadata

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return GaudiUnifiedAttentionBackend.get_supported_kernel_block_sizes()

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return GaudiUnifiedAttentionBackend.get_supported_head_sizes()

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return GaudiUnifiedAttentionBackend.supports_attn_type(attn_type)  # decoders and encoder-only layers

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @staticmethod
    def block_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """vllm-gaudi's `[(num_blocks + 1) * block_size, Hkv, D]` cache as the core's
        `[num_blocks + 1, block_size, Hkv, D]`: a view of the same memory (view() raises rather than copy)."""
        return cache.view(-1, block_size, *cache.shape[1:])


@dataclass
class UnifiedHpuMetadata:
    """One KV cache group's planned step, as the impl reads it from vllm-gaudi's forward context."""

    batch: UnifiedBatch  #: the plan, padded to its bucket when a bucket plan is active, on the model's device
    slot_mapping: torch.Tensor  #: [T] int64 cache slot of each model input row; padding rows: the padding block
    parts: StepParts | None = None  #: the step in parts (`hpu_parts.py`; `batch` is then its grid part's), or None
    #: None: the attention is traced where it stands (an HPU graph, or vllm-gaudi's compiled region); else the
    #: torch.compile backend of its own graphs, one per bucket or grid graph, behind a graph break (`hpu_parts.py`)
    graph_backend: object = None

    @property
    def rows(self) -> int:
        """The model's input rows (the step's tokens, padded)."""
        return self.slot_mapping.shape[0]

    def logits_rows(self, num_requests: int) -> np.ndarray:
        """The model row of each request's last token (`num_requests`: the step's); host arrays only (a step in
        parts: its parts' `host_rows`), no read from the device."""
        if self.parts is None:
            return self.batch.plan.logits_indices[:num_requests]
        return np.sort(np.concatenate([rows[b.plan.logits_indices[:b.num_requests]]
                                       for b, rows in zip(self.parts.batches, self.parts.host_rows)]))

    @property
    def is_prompt(self) -> bool:
        """vllm-gaudi's MLA layer (`HPUMLAAttention.forward_impl`) branches on it: True (the step's bucket
        has a prompt route in its final form, `mla_prompts.expanded_step`) sends the step to the impl's
        `forward_mha` (its prompt rows expanded, the others latent), False to its absorbed branch, the
        impl's `forward_mqa` (`hpu_mla.py`). A function of the bucket, so one graph per bucket holds.
        Nothing else of vllm-gaudi reads it on the unified runner's path (`hpu_mla.py` lists its readers)."""
        return expanded_step(self.batch)


class UnifiedMetadataProcessor(HPUAttentionMetadataProcessor):
    """vllm-gaudi's metadata post-processing, which lets the unified metadata through unchanged.

    The model adapter calls `process_metadata` on every forward; its additions (causal biases,
    one-hot block mappings) serve vllm-gaudi's own kernels. The unified plan already holds
    everything its paths need, so it passes as it is: one `UnifiedHpuMetadata`, or a dict of them
    by layer name (vllm-gaudi's `Attention.forward` looks a dict up by `layer.layer_name`).
    """

    def process_metadata(self, attn_metadata, batch_size, seq_len, device, dtype, model_has_chunked_attention=False):
        if is_unified_metadata(attn_metadata):
            return attn_metadata
        return super().process_metadata(attn_metadata, batch_size, seq_len, device, dtype,
                                        model_has_chunked_attention)


def is_unified_metadata(attn_metadata) -> bool:
    if isinstance(attn_metadata, dict):  # a hybrid's Mamba2 layers hold their calls (`hpu_mamba.MambaStep`)
        kinds = {type(m) for m in attn_metadata.values()}
        return UnifiedHpuMetadata in kinds and kinds <= {UnifiedHpuMetadata, MambaStep}
    return isinstance(attn_metadata, UnifiedHpuMetadata)


class UnifiedHpuAttentionImpl(GaudiUnifiedAttentionImpl):
    """The unified impl under vllm-gaudi's calling convention (no `output` argument; returns the output)."""

    backend = UnifiedHpuAttentionBackend

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple | None, attn_metadata: UnifiedHpuMetadata | None,
                output: torch.Tensor | None = None, output_scale=None, output_block_scale=None) -> torch.Tensor:
        """query `[B, S, Hq * D]` (or `[B * S, Hq * D]`), key/value the same with Hkv; kv_cache
        `(k_cache, v_cache, k_scales, v_scales)`. Returns query's shape. With `graph_backend` in the metadata
        the call is a graph break in vllm-gaudi's compiled region (`torch.compiler.disable`): the region's graph
        ends here, this runs outside it, and a graph of the region's rest starts after it."""
        if isinstance(attn_metadata, UnifiedHpuMetadata) and attn_metadata.graph_backend is not None:
            return self._forward_apart(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                       output_block_scale)
        return self._forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                             output_block_scale)

    def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None,
                 output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the unified backend")
        shape = query.shape
        encoder_only = self.attn_type == AttentionType.ENCODER_ONLY  # no cache: vllm-gaudi binds none
        if attn_metadata is None or (kv_cache is None and not encoder_only):
            # vllm-gaudi's memory profiling forwards carry no cache (its own impl returns zeros there too).
            return torch.zeros(shape, dtype=query.dtype, device=query.device)
        if not isinstance(attn_metadata, UnifiedHpuMetadata):
            raise TypeError(f"attn_metadata of type {type(attn_metadata).__name__}: the unified impl runs only the "
                            "steps the unified model runner plans (UnifiedHpuModelRunner); vllm-gaudi's own runner "
                            "or a path of it that builds HPUAttentionMetadataV1 reached it")
        if attn_metadata.batch.sliding_window != self.sliding_window:
            raise ValueError(f"layer {getattr(layer, 'layer_name', '?')}: sliding window {self.sliding_window} but "
                             f"planned with {attn_metadata.batch.sliding_window}: the runner gave it another "
                             "attention kind's plan")
        q = query.reshape(-1, self.num_heads, self.head_size)
        k = key.reshape(-1, self.num_kv_heads, self.head_size)
        v = value.reshape(-1, self.num_kv_heads, self.head_size)
        t = attn_metadata.slot_mapping.shape[0]
        if q.shape[0] != t:
            raise ValueError(f"query rows {q.shape[0]} != planned rows {t} (slot_mapping): the runner's model "
                             "inputs and its plan disagree")
        if encoder_only:  # the new tokens alone (the plan is bidirectional: `hpu_runner.plan_step`)
            empty = k.new_empty((0, attn_metadata.batch.block_size, *k.shape[1:]))
            return unified_attention(q, k, v, empty, empty, attn_metadata.batch, self.scale).reshape(shape)
        key_cache, value_cache, k_scales, v_scales = kv_cache
        bs = attn_metadata.batch.block_size
        key_cache = UnifiedHpuAttentionBackend.block_view(key_cache, bs)
        value_cache = UnifiedHpuAttentionBackend.block_view(value_cache, bs)
        k_scale = v_scale = None
        if is_fp8(key_cache.dtype):
            (k_q, k_rows, k_scale), (v_q, v_rows, v_scale) = self._quantize_new_kv(
                layer, k, v, key_cache, k_scales, v_scales, attn_metadata.slot_mapping, bs)
            write_kv(k_q, v_q, key_cache, value_cache, attn_metadata.slot_mapping)
            # The new tokens attend to each other as stored, as they will once cached.
            k, v = k_q.to(q.dtype) * k_rows, v_q.to(q.dtype) * v_rows
        else:
            if k.dtype != key_cache.dtype:  # vllm-gaudi's impl does the same for float32 activations
                q, k, v = q.to(key_cache.dtype), k.to(key_cache.dtype), v.to(key_cache.dtype)
            write_kv(k, v, key_cache, value_cache, attn_metadata.slot_mapping)
        out = self._attend(q, k, v, key_cache, value_cache, attn_metadata, logits_soft_cap=self.logits_soft_cap,
                           sinks=self.sinks, k_scale=k_scale, v_scale=v_scale)
        return out.reshape(shape).to(query.dtype)

    _forward_apart = torch.compiler.disable(_forward)

    def _attend(self, q, k, v, key_cache, value_cache, md: UnifiedHpuMetadata, **kwargs) -> torch.Tensor:
        """The step's attention over the model's rows: whole, or in parts (each part's rows through its graph,
        padding rows zero); by `graph_backend`'s compiled function per graph when the metadata names one."""
        attend = unified_attention if md.graph_backend is None else partial(compiled_attention,
                                                                              backend=md.graph_backend)
        if md.parts is None:
            if md.graph_backend is not None:  # a part's strides (`index_select`): a bucket's one compiled graph
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            return attend(q, k, v, key_cache, value_cache, md.batch, self.scale, **kwargs)
        n = md.parts.num_tokens
        if n > q.shape[0]:
            raise ValueError(f"a step in parts of {n} tokens, but the model gave {q.shape[0]} rows: the runner's "
                             "model inputs and its plan disagree")
        out = parts_attention(q[:n], k[:n], v[:n], key_cache, value_cache, md.parts, self.scale, attention=attend,
                              **kwargs)
        return torch.cat([out, out.new_zeros((q.shape[0] - n, *out.shape[1:]))])

    @staticmethod
    def _quantize_new_kv(layer, k, v, key_cache, k_scales, v_scales, slot_mapping, block_size):
        """Per key and value: (the new rows in the cache's fp8 format, their scales, the cache's scales
        for the paths).

        - No scale tensors (vllm-gaudi's static fp8 cache, `kv_cache_dtype` fp8 / fp8_inc): one scale
          per tensor, the layer's (`_k_scale_float`, 1.0 unless the checkpoint carries KV scales; vllm-gaudi's
          own static cache uses 1.0 as well).
        - Scale tensors (vllm-gaudi's dynamic KV quantization, QUANT_CONFIG with VLLM_DYNAMIC_KV_QUANT):
          one scale per token and KV head, computed here from the new rows and stored in `k_scales` and
          `v_scales[0]` (`[slots, Hkv, 1]`, bf16) at the tokens' slots; the paths read them per block.
          `v_scales[1]` (per block and channel, for vllm-gaudi's own kernels) is not used.
        Both round to nearest and saturate at the format's largest value on this device (the HPU cast's way).
        """
        from vllm_gaudi.extension.ops import FP8_MAX  # 240 on Gaudi2 (e4m3 with that range), else 448

        fp8 = key_cache.dtype
        if (k_scales is None) != (v_scales is None):
            raise ValueError("the KV cache tuple has scales for only one of key and value "
                             f"(k_scales {'absent' if k_scales is None else 'present'}, "
                             f"v_scales {'absent' if v_scales is None else 'present'})")
        if k_scales is None:
            scales = (float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
            return tuple((quantize(x, fp8, s, saturate_at=FP8_MAX), s, s) for x, s in zip((k, v), scales))
        v_slot_scales = v_scales[0] if isinstance(v_scales, (tuple, list)) else v_scales
        slots = slot_mapping.clamp(min=0)  # padding rows (-1) write the null block, as write_kv does
        out = []
        for x, store in ((k, k_scales), (v, v_slot_scales)):
            s = per_token_scales(x, FP8_MAX).to(store.dtype)  # rounded to the stored dtype before use
            store.index_copy_(0, slots, s)
            rows = s.to(x.dtype)
            out.append((quantize(x, fp8, s.float(), saturate_at=FP8_MAX), rows,
                        store.unflatten(0, (-1, block_size))))  # [blocks, block_size, Hkv, 1]: read per block
        return tuple(out)
