"""Bucketing: which step shapes get a compiled graph, learned from scheduler traces.

- `trace`: the JSON Lines trace format, `read_trace`, `TraceWriter` / `append_step`;
- `simulator`: a vLLM-v1-like scheduler that makes traces from a seed;
- `shapes`: replays traces through the core planner to get each step's shape;
- `cost`: the FLOPs-and-bytes work model that weighs the sizes of a shape;
- `plan`: `BucketPlan` (`find`, miss policy, JSON files);
- `strategies`: `exponential` (baseline) and `trace` (learned) plans;
- `evaluate`, `plot`, `cli`: the `vllm-gaudi-unified buckets ...` commands.
"""
from vllm_gaudi_unified.bucketing.cost import DIMS, CostModel, Hardware, ModelSpec
from vllm_gaudi_unified.bucketing.plan import MISS_POLICIES, BucketMiss, BucketPlan
from vllm_gaudi_unified.bucketing.settings import PRESETS, ServerSettings
from vllm_gaudi_unified.bucketing.trace import Trace, TraceError, TraceStep, TraceWriter, append_step, read_trace

__all__ = ["BucketMiss", "BucketPlan", "CostModel", "DIMS", "Hardware", "MISS_POLICIES", "ModelSpec", "PRESETS",
           "ServerSettings", "Trace", "TraceError", "TraceStep", "TraceWriter", "append_step", "read_trace"]
