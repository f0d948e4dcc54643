"""Unified Attention for vLLM on Intel Gaudi.

One attention path for every batch vLLM schedules: `build_unified_batch` plans a
step on the host, `unified_attention` runs it on the device. docs/architecture.md
draws the package. This package root imports neither vLLM nor habana_frameworks,
and loads its exports on first use, so the numpy-only parts (`plan`, `bucket`,
`bucket_plans`) import without torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the module that defines it (imported on first access).
_EXPORTS = {
    "unified_attention": "vllm_gaudi_unified.attention",
    "UnifiedBatch": "vllm_gaudi_unified.batch",
    "build_unified_batch": "vllm_gaudi_unified.batch",
    "Bucket": "vllm_gaudi_unified.bucket",
    "PathWork": "vllm_gaudi_unified.plan",
    "PlanOptions": "vllm_gaudi_unified.plan",
    "StepPlan": "vllm_gaudi_unified.plan",
    "pad_plan": "vllm_gaudi_unified.plan",
    "plan_step": "vllm_gaudi_unified.plan",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vllm_gaudi_unified' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
