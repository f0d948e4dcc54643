"""Unified Attention for vLLM on Intel Gaudi.

One attention path for every batch vLLM schedules: `build_unified_batch` plans a
step on the host, `unified_attention` runs it on the device. This package root
imports neither vLLM nor habana_frameworks.
"""
from vllm_gaudi_unified.attention import unified_attention
from vllm_gaudi_unified.batch import UnifiedBatch, build_unified_batch
from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.plan import PathWork, PlanOptions, StepPlan, pad_plan, plan_step

__version__ = "0.1.0"
__all__ = ["Bucket", "PathWork", "PlanOptions", "StepPlan", "UnifiedBatch", "build_unified_batch", "pad_plan",
           "plan_step", "unified_attention"]
