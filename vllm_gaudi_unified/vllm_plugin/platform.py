"""vLLM's CPU platform with the unified attention backend, for trying and testing off Gaudi.

vLLM's own `CpuPlatform.get_attn_backend_cls` always answers CPU_ATTN, so the
only way to run another backend on the CPU is a platform of our own; this one
changes nothing else. `select_unified_backend` is shared with the Gaudi platform.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.platforms.cpu import CpuPlatform

from vllm_gaudi_unified.log import get_logger

if TYPE_CHECKING:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = get_logger("vllm.gaudi_unified.platform")


def select_unified_backend(attn_selector_config: "AttentionSelectorConfig", backend=None,
                           where: str = "vLLM's model runner") -> str:
    """The unified backend's class path for a layer, or a start-up error naming what it lacks.

    vLLM asks once per distinct layer configuration while building the model,
    so an unsupported feature (MLA, encoder or cross attention, ALiBi-free
    checks aside) stops the start-up with the reasons instead of running wrong.
    `backend`: the backend class (default: the CPU path's `GaudiUnifiedAttentionBackend`;
    on Gaudi `hpu_backend.UnifiedHpuAttentionBackend`); `where` goes into the log line.
    """
    from vllm_gaudi_unified.vllm_plugin.backend import GaudiUnifiedAttentionBackend, register_backend

    if backend is None:
        register_backend()  # the general plugin normally did this; the Attention layer looks the name up
        backend = GaudiUnifiedAttentionBackend
    cfg = attn_selector_config._asdict()
    reasons = backend.validate_configuration(device_capability=None, **cfg)
    if reasons:
        raise ValueError(
            f"The unified attention backend ({backend.get_name()}) cannot run this model: "
            f"{'; '.join(reasons)} (layer config: {attn_selector_config!r}). "
            "Unset VLLM_GAUDI_UNIFIED (or set it to 0) to use vLLM's own backend.")
    logger.info_once("Using the unified attention backend %s (%s).", backend.get_name(), where)
    return backend.full_cls_name()[0] + "." + backend.__qualname__


class UnifiedCpuPlatform(CpuPlatform):
    """`CpuPlatform` whose attention backend is unified attention (unless another is named explicitly),
    and whose worker warms the bucket plan at start-up (`worker.UnifiedCpuWorker`)."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        # vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models (its reference
        # CPU_MLA prefill cannot read cached context); the unified MLA backend reads it like any other step.
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        kept = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        super().check_and_update_config(vllm_config)
        model = vllm_config.model_config
        if model is not None and model.use_mla and vllm_config.attention_config.backend is None:
            sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens = kept
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker":
            parallel.worker_cls = "vllm_gaudi_unified.vllm_plugin.worker.UnifiedCpuWorker"

    @classmethod
    def _align_hybrid_block_size(cls, vllm_config, backend_cls) -> None:
        """Hybrid models (attention beside Mamba layers): the block size vLLM's own CPU attention gets.

        vLLM sizes a hybrid's attention block so that its page holds a Mamba state, in steps of the backend's
        kernel block (16 here, 32 for vLLM's CPU attention), and in prefix caching's 'align' mode the Mamba
        block follows it. vLLM 0.32's CPU Mamba2 kernel returns no intermediate states, so a prefill chunk
        that crosses a Mamba block (where 'align' mode writes a checkpoint) fails in `mamba_mixer2`
        (IndexError): with a 64-token budget a 48-token block (steps of 16) does, vLLM's 64 does not.
        Aligning as vLLM's CPU attention does gives the plugin the same blocks, so the same steps run."""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        from vllm_gaudi_unified.vllm_plugin.backend import GaudiUnifiedAttentionBackend

        if backend_cls is GaudiUnifiedAttentionBackend:
            backend_cls = CPUAttentionBackend
        super()._align_hybrid_block_size(vllm_config, backend_cls)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: "AttentionBackendEnum", attn_selector_config:
                             "AttentionSelectorConfig", num_heads: int | None = None) -> str:
        from vllm_gaudi_unified.vllm_plugin.backend import BACKEND_NAME

        if selected_backend is not None and selected_backend.name != BACKEND_NAME:
            # `--attention-backend X` given explicitly: vLLM's own choice for X.
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
        if attn_selector_config.use_mla:  # latent caches: the MLA backend (vllm_plugin/mla_backend.py)
            from vllm_gaudi_unified.vllm_plugin.mla_backend import GaudiUnifiedMLABackend, register_mla_backend

            register_mla_backend()
            return select_unified_backend(attn_selector_config, GaudiUnifiedMLABackend)
        return select_unified_backend(attn_selector_config)
