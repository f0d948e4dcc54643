"""vLLM's CPU worker plus the bucket warmup, which needs the KV cache vLLM allocates late.

The metadata builders exist before the KV cache; the worker's
`compile_or_warm_up_model` is the first start-up hook that has both, and it
runs before the engine takes requests.
"""
from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_gaudi_unified.vllm_plugin.backend import GaudiUnifiedAttentionBackend, GaudiUnifiedMetadataBuilder


def warm_up_buckets(model_runner) -> None:
    """For each KV cache group planned by the unified backend: warm its bucket plan on that group's cache."""
    layers = model_runner.compilation_config.static_forward_context
    for group in (g for groups in model_runner.attn_groups for g in groups):
        builder = group.get_metadata_builder()
        if not isinstance(builder, GaudiUnifiedMetadataBuilder):
            continue
        layer = layers[group.layer_names[0]]
        key_cache, value_cache = GaudiUnifiedAttentionBackend.split_kv_cache(layer.kv_cache, layer.impl.head_size,
                                                                             layer.impl.kv_cache_dtype)
        builder.hooks.warm_up(key_cache, value_cache, layer.impl.num_heads, model_runner.model_config.dtype)


class UnifiedCpuWorker(CPUWorker):
    def compile_or_warm_up_model(self):
        # Before vLLM's own warm-up, which resets the random seed afterwards: the warmup's random
        # inputs must not shift the sampling of the first requests.
        warm_up_buckets(self.model_runner)
        return super().compile_or_warm_up_model()
