"""On Gaudi: vllm-gaudi's platform, with the unified attention backend.

vLLM has no Gaudi platform of its own; vllm-gaudi provides it (and the HPU
worker, model runner and ops). This platform builds on it and changes only
the attention backend choice. `entry.platform_plugin` names this module only
on a machine with an HPU and vllm-gaudi installed, so importing vllm_gaudi
here is safe. Not tested: the project has no Gaudi machine.
"""
from __future__ import annotations

from vllm_gaudi.platform import HpuPlatform

from vllm_gaudi_unified.vllm_plugin.platform import select_unified_backend


class UnifiedHpuPlatform(HpuPlatform):
    """vllm-gaudi's `HpuPlatform`, attention backend aside."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return select_unified_backend(attn_selector_config)
