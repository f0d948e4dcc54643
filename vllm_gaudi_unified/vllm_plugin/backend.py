"""Unified attention as a vLLM v1 attention backend.

The usual v1 split (see `vllm/v1/attention/backends/cpu_attn.py`):

- `GaudiUnifiedAttentionBackend`: static declarations only, so vLLM's selector
  can accept or refuse a model before anything is built;
- `GaudiUnifiedMetadata`: one planned step, shared by every layer of the step;
- `GaudiUnifiedMetadataBuilder`: vLLM's `CommonAttentionMetadata` of a step ->
  `build_unified_batch`; it runs once per step (per KV cache group), never per layer;
- `GaudiUnifiedAttentionImpl`: `forward` writes the step's new K/V into the
  cache, then runs `attention.attend_step` (no per-layer checks or copies: the
  step's first layer checks the inputs, q/k/v come at the bucket's rows as views
  of vLLM's tensors or in buffers the builder keeps).

KV cache layout. vLLM hands each layer its cache as a logical
`[num_blocks, num_kv_heads, block_size, head_size + head_size_v]` view whose
memory order is the layout the backend declares. We declare LBNHC (memory
`[num_blocks, block_size, num_kv_heads, K | V]`), so `split_kv_cache` gets the
core's `[num_blocks, block_size, num_kv_heads, head_size]` key and value caches
as views, without a copy.

Encoder-only layers (BERT-style embedders, `AttentionType.ENCODER_ONLY`) keep no
cache: vLLM gives them a KV cache group of their own (`EncoderOnlyAttentionSpec`)
whose builder sees `causal=False`; the step is planned bidirectional
(`build_unified_batch(causal=False)`: every token sees its whole request) and
`forward` attends the new tokens alone, writing nothing. Cross-attention and
encoder-decoder layers read another sequence's cache and stay refused.

fp8 KV cache (`kv_cache_dtype` fp8 / fp8_e4m3 / fp8_e5m2): vLLM allocates the
cache as bytes; `split_kv_cache` views them in the fp8 format, `forward`
quantizes the new K/V with the layer's per-tensor scales (`layer._k_scale_float`,
`_v_scale_float`) the way vLLM's CPU cache-write kernel does (dividing by the
scale, rounding toward zero: the same bytes), and passes the scales to
`unified_attention`, whose paths dequantize the blocks they gather.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, EncoderOnlyAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_gaudi_unified import UnifiedBatch, build_unified_batch
from vllm_gaudi_unified.attention import BucketRows, attend_step, check_inputs
from vllm_gaudi_unified.batch import StepBuffers
from vllm_gaudi_unified.paths.kv_quant import FP8_DTYPES, quantize
from vllm_gaudi_unified.vllm_plugin.cache_write import write_kv
from vllm_gaudi_unified.vllm_plugin.config import PluginConfig
from vllm_gaudi_unified.vllm_plugin.steps import StepHooks

#: The name vLLM's registry and `--attention-backend` know this backend by.
BACKEND_NAME = "GAUDI_UNIFIED_ATTN"


def register_backend() -> None:
    """Add `BACKEND_NAME` to vLLM's `AttentionBackendEnum` (idempotent).

    vLLM's `Attention` layer looks its backend up by `get_name()` in that enum,
    so this must run in every process that builds the model: the general
    plugin does it, and the platforms repeat it before selecting the backend.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        vllm_register_backend(BACKEND_NAME, f"{__name__}.{GaudiUnifiedAttentionBackend.__qualname__}")


class GaudiUnifiedAttentionBackend(AttentionBackend):
    """What the unified backend supports; vLLM's `validate_configuration` reads these."""

    forward_includes_kv_cache_update: bool = True  # forward writes K/V itself: one call per layer
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    #: "auto": the model dtype; fp8 formats with per-tensor scales (what vLLM's CPU attention offers).
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["GaudiUnifiedAttentionImpl"]:
        return GaudiUnifiedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["GaudiUnifiedMetadataBuilder"]:
        return GaudiUnifiedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The planner takes any block size; whole 16-token blocks keep the gathered
        # key tiles aligned on the HPU (vllm-gaudi's default is 128).
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # The paths are plain matmuls over head_dim; multiples of 16 up to 512 cover the models
        # vLLM serves and keep the HPU's matmul engine on full tiles.
        return list(range(16, 513, 16))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)  # memory [num_blocks, block_size, num_kv_heads, K|V]; see the module doc

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        # Decoders, and encoder-only layers (no cache; see the module doc). Not ENCODER / ENCODER_DECODER:
        # cross-attention reads the encoder's output as a second sequence the planner does not model.
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # unified_attention(sinks=...)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # planned per step (build_unified_batch(sliding_window=...)), one window per KV cache group

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # VLLM_BATCH_INVARIANT=1 plans with PlanOptions(batch_invariant=True) unless
        # VLLM_GAUDI_UNIFIED_BATCH_INVARIANT=0 says otherwise (config.py)
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The planner reads each request's query length from vLLM's host copy
        # (`query_start_loc_cpu`); adaptive verification trims drafts on the device only.
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # a connector moves cache pages in its own layout assumptions; not verified with ours

    @staticmethod
    def split_kv_cache(kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's per-layer cache view -> (key_cache, value_cache), each
        `[num_blocks, block_size, num_kv_heads, head_size]`, views of the same memory
        (for an fp8 `kv_cache_dtype`, vLLM's bytes viewed in that fp8 format)."""
        if kv_cache_dtype in FP8_DTYPES and kv_cache.dtype == torch.uint8:
            kv_cache = kv_cache.view(FP8_DTYPES[kv_cache_dtype])
        blocks = kv_cache.permute(0, 2, 1, 3)  # [num_blocks, block_size, num_kv_heads, head_size + head_size_v]
        return blocks[..., :head_size], blocks[..., head_size:]


@dataclass
class GaudiUnifiedMetadata:
    """One planned step; every attention layer of the step reads the same object."""

    batch: UnifiedBatch  #: the plan (padded to its bucket when a bucket plan is active), on the model's device
    slot_mapping: torch.Tensor  #: [num_tokens] int64, cache slot (block * block_size + offset) of each new token
    num_tokens: int  #: real new tokens of the step; vLLM may hand forward() more rows (padding), never fewer
    rows: BucketRows | None = None  #: q/k/v at the bucket's rows (the builder's, kept from step to step)
    #: the cache slots of the new tokens when every one is cached (no -1): the CPU's dense decode route
    #: reads the decodes' new keys from the cache with the rest (`paths/decodes.py`)
    self_slots: torch.Tensor | None = None
    checked: bool = False  #: the step's inputs were checked (by its first layer)
    #: an encoder-only group's plan per sliding window of its layers (vLLM puts every encoder-only layer in one
    #: group: ModernBERT's global and local layers), `batch` the first; None (decoders): every layer reads `batch`
    window_batches: dict | None = None

    def batch_for(self, sliding_window: int | None) -> UnifiedBatch:
        """The plan a layer with this window reads."""
        return self.batch if self.window_batches is None else self.window_batches[sliding_window]


class GaudiUnifiedMetadataBuilder(AttentionMetadataBuilder[GaudiUnifiedMetadata]):
    """Turns vLLM's common metadata of a step into a `UnifiedBatch`, once per step.

    Request lengths, as vLLM and the planner name them::

        |------------------- seq_len -------------------|
        |---- context_len (in the cache) ----|-- query --|
    """

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        refuse_unsupported_config(vllm_config)
        self.block_size = kv_cache_spec.block_size
        #: an encoder-only group: no cache, steps planned bidirectional, unpadded, not traced
        self.encoder_only = isinstance(kv_cache_spec, EncoderOnlyAttentionSpec)
        self.speculative = vllm_config.speculative_config is not None
        #: the model's dtype: the prompt route's mask is made in it once per step, for every layer
        dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
        self.model_dtype = dtype if isinstance(dtype, torch.dtype) else None
        #: MLA's expanded prompts have values narrower than keys: their step mask is the one call's (`split_context`)
        self.same_head_dims = not getattr(getattr(vllm_config, "model_config", None), "use_mla", False)
        #: an encoder-only group plans each of its layers' windows (two-sided: `plan/bidirectional.py`)
        self.encoder_windows = sorted(_group_windows(vllm_config, layer_names), key=lambda w: w or 0) \
            if self.encoder_only else None
        self.sliding_window = None if self.encoder_only else _group_sliding_window(vllm_config, layer_names)
        # One group's steps go to the trace: a full-attention group's if the model has one.
        may_record = self.sliding_window is None or not _model_has_full_attention(vllm_config)
        config = PluginConfig.from_env()
        self.hooks = StepHooks.encoder_only(config) if self.encoder_only else StepHooks.create(
            config, vllm_config, kv_cache_spec, device, sliding_window=self.sliding_window, may_record=may_record)
        # Kept from step to step: the plan's arrays (sized by the largest bucket: a step allocates nothing and
        # a bucket's graph sees the same addresses every step) and the q/k/v rows of padded steps.
        plan = self.hooks.bucket_plan
        reserve = None if plan is None else StepBuffers.reserve_for(plan.buckets + plan.prompt_graphs,
                                                                   self.hooks.options, self.block_size)
        self.buffers = StepBuffers(device, reserve=reserve)
        self.rows = BucketRows()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> GaudiUnifiedMetadata:
        cm = common_attn_metadata
        if cm.causal is not (not self.encoder_only):
            raise NotImplementedError(f"unified attention got causal={cm.causal!r} in a "
                                      f"{'encoder-only' if self.encoder_only else 'decoder'} KV cache group: it "
                                      "runs causal decoder groups and bidirectional encoder-only groups")
        query_lens, context_lens, block_table = step_lengths(cm, exact_seq_lens=self.speculative)
        window_batches = None
        if self.encoder_only:  # unpadded, one plan per window (no kept buffers: each build would overwrite them)
            window_batches = {w: build_unified_batch(query_lens, context_lens, block_table, self.block_size,
                                                     sliding_window=w, options=self.hooks.options, causal=False)
                              for w in self.encoder_windows}
            batch = window_batches[self.encoder_windows[0]]
        else:
            batch = build_unified_batch(query_lens, context_lens, block_table, self.block_size,
                                        sliding_window=self.sliding_window, options=self.hooks.options,
                                        bucket=self.hooks.bucket_plan, buffers=self.buffers)
            self.hooks.after_plan(batch, query_lens, context_lens, block_table)
            if self.model_dtype is not None:
                batch = batch.with_prompt_bias(self.model_dtype, self.same_head_dims)
        num_tokens = batch.num_tokens
        slots = cm.slot_mapping[:num_tokens].long()
        cached = slots.device.type == "cpu" and bool((slots >= 0).all())
        return GaudiUnifiedMetadata(batch=batch, slot_mapping=slots, num_tokens=num_tokens, rows=self.rows,
                                    self_slots=slots if cached else None, window_batches=window_batches)


def step_lengths(cm: CommonAttentionMetadata, exact_seq_lens: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query_lens, context_lens, block_table) of the step's requests, as host arrays.

    Query lengths come from vLLM's host copy `query_start_loc_cpu`. With
    speculative decoding a decode's query is its last sampled token followed by
    its draft tokens (`1 + k` rows, causal among themselves like any chunk), and
    the sequence lengths need care, so `exact_seq_lens` must then be set:

    - vLLM's host `seq_lens_cpu_upper_bound` is *optimistic* under speculative
      decoding: with async scheduling it assumes every draft of the previous step
      was accepted, and in a drafter's steps after the first it still counts the
      rejected drafts that `seq_lens` already dropped;
    - `seq_lens` is exact: rejected drafts are rolled back (their cache slots
      lie past the new context length and are overwritten by the next step's
      tokens, never read).

    So with `exact_seq_lens` the lengths are `seq_lens` (free on the CPU, one
    small device-to-host copy elsewhere); without it the host upper bound,
    exact when nothing is speculated, so on a device only the block table is
    copied back. Requests with no token this step (padding rows) are left out:
    they own no rows of the flattened token batch.
    """
    n = cm.num_reqs
    starts = cm.query_start_loc_cpu[: n + 1].numpy().astype(np.int64)
    query_lens = np.diff(starts)
    seq_lens = cm.seq_lens if exact_seq_lens or cm.seq_lens_cpu_upper_bound is None else cm.seq_lens_cpu_upper_bound
    seq_lens = seq_lens[:n].cpu().numpy().astype(np.int64)
    block_table = cm.block_table_tensor[:n].cpu().numpy()
    live = query_lens > 0
    if not live.all():
        query_lens, seq_lens, block_table = query_lens[live], seq_lens[live], block_table[live]
    return query_lens, seq_lens - query_lens, block_table


def refuse_unsupported_config(vllm_config: VllmConfig) -> None:
    """Start-up errors for engine features the unified backend does not handle (rather than wrong output)."""
    problems = []
    parallel = vllm_config.parallel_config
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        problems.append("context parallelism")
    if getattr(parallel, "use_ubatching", False):
        problems.append("micro-batching (dual batch overlap: two steps' metadata alive at once, one set of buffers)")
    if vllm_config.model_config is not None and vllm_config.model_config.is_mm_prefix_lm:
        problems.append("bidirectional attention over multimodal prefixes")
    if problems:
        raise NotImplementedError("The unified attention backend does not support " + ", ".join(problems)
                                  + ". Unset VLLM_GAUDI_UNIFIED to use vLLM's own backend.")


def _group_windows(vllm_config: VllmConfig, layer_names: list[str]) -> set:
    """The sliding windows (None: none) of this group's layers."""
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    return {layer.impl.sliding_window for layer in layers.values()}


def _group_sliding_window(vllm_config: VllmConfig, layer_names: list[str]) -> int | None:
    """The window of this group's decoder layers; the plan is shared by the group, so they must agree."""
    windows = _group_windows(vllm_config, layer_names)
    if len(windows) > 1:
        raise NotImplementedError(f"layers sharing one KV cache group have different sliding windows {windows}; "
                                  "the unified backend plans one window per step (enable vLLM's hybrid KV cache "
                                  "manager so that each window gets its own group)")
    return windows.pop() if windows else None


def _model_has_full_attention(vllm_config: VllmConfig) -> bool:
    """Some attention layer of the model has no sliding window."""
    layers = get_layers_from_vllm_config(vllm_config, Attention)
    return any(layer.impl.sliding_window is None for layer in layers.values())


class GaudiUnifiedAttentionImpl(AttentionImpl[GaudiUnifiedMetadata]):
    """Per layer: write the new K/V into the cache, then `attend_step` (checked once per step)."""

    backend: ClassVar[type[AttentionBackend]] = GaudiUnifiedAttentionBackend  #: whose declarations __init__ checks

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = [what for what, present in (
            ("ALiBi", alibi_slopes is not None),
            (f"attention type {attn_type!r} (decoder and encoder-only only: cross-attention reads another "
             "sequence's cache, which the planner does not model)",
             attn_type not in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)),
            ("KV cache sharing between layers", kv_sharing_target_layer_name is not None),
            (f"kv_cache_dtype {kv_cache_dtype!r}", kv_cache_dtype not in self.backend.supported_kv_cache_dtypes),
        ) if present]
        if unsupported:
            raise NotImplementedError("The unified attention backend does not support " + ", ".join(unsupported))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None  # vLLM passes 0 / None for "no cap"
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.sinks = sinks
        if sinks is not None and tuple(sinks.shape) != (num_heads,):  # a layer's own: checked here, not per step
            raise ValueError(f"sinks must have shape ({num_heads},) (one logit per query head), "
                             f"got {tuple(sinks.shape)}")

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: GaudiUnifiedMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query `[T, Hq, D]`, key/value `[T, Hkv, D]`, output `[T, Hq, D]` (T >= the step's tokens)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the unified backend")
        if attn_metadata is None:  # vLLM's profiling / dummy runs carry no metadata
            return output
        md = attn_metadata
        t, rows = md.num_tokens, md.batch.bucket.query_len
        k_scale = v_scale = None
        encoder_only = self.attn_type == AttentionType.ENCODER_ONLY
        if encoder_only:  # no cache: an empty one, the new tokens alone
            key_cache = value_cache = key.new_empty((0, md.batch.block_size, *key.shape[1:]))
        else:
            key_cache, value_cache = GaudiUnifiedAttentionBackend.split_kv_cache(kv_cache, self.head_size,
                                                                                 self.kv_cache_dtype)
            if key_cache.dtype != key.dtype:  # fp8: store quantized, attend to the new tokens as stored
                k_scale, v_scale = float(layer._k_scale_float), float(layer._v_scale_float)
                key_q = quantize(key[:t], key_cache.dtype, k_scale, rounding="toward_zero")
                value_q = quantize(value[:t], value_cache.dtype, v_scale, rounding="toward_zero")
                write_kv(key_q, value_q, key_cache, value_cache, md.slot_mapping)
                key, value = key_q.to(query.dtype) * k_scale, value_q.to(query.dtype) * v_scale
            else:
                write_kv(key[:t], value[:t], key_cache, value_cache, md.slot_mapping)
        # The bucket's rows: views of vLLM's tensors when it padded its batch that far, else the builder's buffers.
        pad = md.rows or BucketRows()
        query, key, value = pad("query", query, rows), pad("key", key, rows), pad("value", value, rows)
        if not md.checked:  # once per step: the group's layers share shapes, cache and plan
            check_inputs(query, key, value, key_cache, value_cache, md.batch, self.scale, self.logits_soft_cap,
                         self.sinks)
            md.checked = True
        batch = md.batch_for(self.sliding_window)  # (an encoder-only group plans each window of its layers)
        output[:t] = attend_step(query, key, value, key_cache, value_cache, batch, self.scale,
                                 logits_soft_cap=self.logits_soft_cap, sinks=self.sinks,
                                 k_scale=k_scale, v_scale=v_scale,
                                 dense_decodes=not encoder_only,  # it reads the new tokens from the cache
                                 self_slots=md.self_slots)[:t]
        return output
