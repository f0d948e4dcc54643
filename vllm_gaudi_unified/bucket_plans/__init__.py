"""Bucket plans at serve time: which step shapes get a compiled graph, and the lookup each step makes.

- `bucket_plan`: `BucketPlan` (`find`, miss policy, JSON plan files);
- `exponential`: the plan made from the server settings alone (`auto` of a batch-invariant server);
- `settings`: `ServerSettings` (the limits a plan is made for) and `BUCKET_OPTIONS`;
- `cost`: the FLOPs-and-bytes work model that weighs the sizes of a shape;
- `memory`: warmup's peak device memory, from the plan's model;
- `trace`: the JSON Lines scheduler trace format (the plugin records it while serving);
- `prompt_graphs`: the buckets with a prompt shape, in which prompts take the prompt route;
- `simulator`, `workloads`: a vLLM-v1-like scheduler and its workloads (what the default plans, `auto`
  included, learn from).

Nothing here is offline: learning the tiled buckets from traces, evaluating and
plotting live in `vllm_gaudi_unified.tools`.
"""
from vllm_gaudi_unified.bucket_plans.cost import DIMS, CostModel, Hardware, ModelSpec
from vllm_gaudi_unified.bucket_plans.bucket_plan import MISS_POLICIES, BucketMiss, BucketPlan
from vllm_gaudi_unified.bucket_plans.settings import PRESETS, ServerSettings
from vllm_gaudi_unified.bucket_plans.trace import Trace, TraceError, TraceStep, TraceWriter, append_step, read_trace

__all__ = ["BucketMiss", "BucketPlan", "CostModel", "DIMS", "Hardware", "MISS_POLICIES", "ModelSpec", "PRESETS",
           "ServerSettings", "Trace", "TraceError", "TraceStep", "TraceWriter", "append_step", "read_trace"]
