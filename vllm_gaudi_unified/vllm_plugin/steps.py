"""What happens around each planned step inside vLLM: bucket plan, warmup, debug log, trace.

Made once per metadata builder (at vLLM's start-up, after the KV cache is
sized), used once per step by `GaudiUnifiedMetadataBuilder.build`:

- a bucket plan (`VLLM_GAUDI_UNIFIED_BUCKETS`: a plan file, checked against
  the server's settings, or `auto`: the plan `buckets generate` learns for
  these settings from the simulated mix, made at start-up, in parts where the
  runner runs steps in parts, `auto_plan.py`);
  every step is then padded to its bucket, and the plan
  decides the planner options (a plan is only valid for the options it was
  made with);
- warmup of every bucket of the plan at start-up (`VLLM_GAUDI_UNIFIED_WARMUP`),
  on the real KV cache once vLLM has allocated it (`warm_up`, called by the
  plugin's worker);
- the phase and bucket of each step, logged through vLLM's logger at debug
  level (`VLLM_LOGGING_LEVEL=DEBUG` shows them);
- recording of every step to a trace file (`VLLM_GAUDI_UNIFIED_RECORD_TRACE`)
  in the scheduler trace format of `vllm_gaudi_unified.bucket_plans.trace`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm_gaudi_unified import PlanOptions, UnifiedBatch
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.plan import DEFAULT_OPTIONS
from vllm_gaudi_unified.step_parts import in_parts
from vllm_gaudi_unified.vllm_plugin.config import ENV_BATCH_INVARIANT, ENV_BUCKETS, PluginConfig

logger = get_logger("vllm.gaudi_unified.steps")

#: Why the CPU/CUDA path (`backend.py`) refuses a plan in parts.
ONE_CALL = "this runner runs each step as one attention call: make the plan without --parts"


@dataclass
class StepHooks:
    options: PlanOptions  #: planner options of every step (the bucket plan's when there is one)
    bucket_plan: object | None = None  #: a `BucketPlan` (anything with .find(shape)), or None: steps run unpadded
    trace_path: str | None = None  #: where steps are appended, or None
    warmup_enabled: bool = True  #: VLLM_GAUDI_UNIFIED_WARMUP
    #: the compile backend of a plan in parts' attention graphs in vllm-gaudi's torch.compile mode (`hpu_parts.py`)
    graph_backend: object = None
    #: whether steps with prompts may run in parts: a plan in parts, and a group whose steps run in parts
    steps_in_parts: bool = False

    @classmethod
    def create(cls, config: PluginConfig, vllm_config, kv_cache_spec, device: torch.device,
               sliding_window: int | None = None, may_record: bool = True, parts_refusal: str | None = ONE_CALL,
               whole_steps: str | None = None, graph_backend=None) -> "StepHooks":
        """Hooks of one metadata builder (one KV cache group): `sliding_window` is the group's window,
        `may_record` whether this group's steps are the ones to record (see `_trace_path`), `parts_refusal` why
        this runner refuses a plan in parts (None: it runs them; `hpu_parts.parts_support` gives the last three),
        `whole_steps` why this group's steps run whole under one (None: they may run in parts), `graph_backend`
        the compile backend of such a plan's attention graphs. `auto` makes a plan in parts where neither
        reason is given (`auto_plan.py`)."""
        from vllm_gaudi_unified.bucket_plans.device_options import device_kind, options_for_device

        device = torch.device(device)
        kind = ""  # the per-device table only when asked for (VLLM_GAUDI_UNIFIED_DEVICE_OPTIONS=1)
        if config.device_options:
            kind = device_kind(device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else "")
        # a verify step's 1 + k tokens per request read their blocks once (`PlanOptions.unique_tokens`)
        options = options_for_device(kind, PlanOptions(batch_invariant=config.batch_invariant,
                                                       unique_tokens=1 + _num_speculative_tokens(vllm_config)))
        plan = None
        if config.buckets:
            plan = _load_bucket_plan(config.buckets, vllm_config, kv_cache_spec, options, sliding_window, kind,
                                     parts_refusal, whole_steps)
            # the prompt route when the plan has prompt graphs; a plan in parts: a step not in parts runs whole,
            # tiled (`step_parts.plan_parts`), planned as a rest part is (one compiled graph per bucket)
            options = plan.settings.options if in_parts(plan) else plan.step_options
        parts = plan is not None and in_parts(plan) and parts_refusal is None and whole_steps is None
        trace_path = _trace_path(config, vllm_config) if may_record else None
        hooks = cls(options=options, bucket_plan=plan, trace_path=trace_path, warmup_enabled=config.warmup,
                    graph_backend=graph_backend if parts else None, steps_in_parts=parts)
        if hooks.trace_path:
            _start_trace(hooks.trace_path, vllm_config, kv_cache_spec, sliding_window)
        return hooks

    @classmethod
    def encoder_only(cls, config: PluginConfig) -> "StepHooks":
        """Hooks of an encoder-only KV cache group: default options, no bucket plan and no trace (both describe
        cached steps). The batch-invariant mode is refused: its planner plans causal steps only, and an
        encoder step's tiles follow its batch, so its rows would not be batch-invariant."""
        if config.batch_invariant:
            raise NotImplementedError(f"the batch-invariant mode ({ENV_BATCH_INVARIANT} or VLLM_BATCH_INVARIANT) "
                                      "with encoder-only attention layers: the batch-invariant planner plans causal "
                                      "steps only; serve this model without it")
        return cls(options=DEFAULT_OPTIONS)

    def warm_up(self, key_cache: torch.Tensor, value_cache: torch.Tensor, num_qo_heads: int,
                dtype: torch.dtype | None = None) -> None:
        """Run every bucket of the plan once on the real cache (`[num_blocks, block_size, Hkv, D]`) with
        activations in `dtype` (the model's; default: the cache's, which an fp8 cache is not)."""
        if self.bucket_plan is None or not self.warmup_enabled:
            return
        from vllm_gaudi_unified.warmup import warmup

        report = warmup(self.bucket_plan, device=key_cache.device, dtype=dtype or key_cache.dtype,
                        num_qo_heads=num_qo_heads,
                        num_kv_heads=key_cache.shape[2], head_dim=key_cache.shape[3], key_cache=key_cache,
                        value_cache=value_cache, log=logger)  # a line per bucket in vLLM's log
        logger.info("Unified attention: warmed %d buckets in %.1f s (%s)", len(report.buckets),
                    report.total_seconds, report.mode)

    def after_plan(self, batch: UnifiedBatch, query_lens: np.ndarray, context_lens: np.ndarray,
                   block_table: np.ndarray, parts=None) -> None:
        """Per step, after planning (`parts`: the step in parts, `batch` its grid part): debug log, trace line.
        Host work only."""
        if parts is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("unified attention step in parts: graphs %s, %d tokens", parts.buckets, parts.num_tokens)
        elif logger.isEnabledFor(logging.DEBUG):
            logger.debug("unified attention step: phase %s, bucket %s, step shape %s, %d requests, %d tokens",
                         batch.phase, batch.bucket, batch.shape, batch.num_requests, batch.num_tokens)
        if self.trace_path:
            from vllm_gaudi_unified.bucket_plans.trace import append_step

            # One open/append/close per step: the line is on disk even if vLLM kills this process.
            append_step(self.trace_path, query_lens, context_lens, block_table, batch.block_size)


def _load_bucket_plan(path: str, vllm_config, kv_cache_spec, options: PlanOptions, sliding_window: int | None,
                      device_kind: str = "", parts_refusal: str | None = ONE_CALL, whole_steps: str | None = None):
    """The plan of `path` (or made now for `auto`, with the options measured for `device_kind`: in parts where
    neither `parts_refusal` nor `whole_steps` says why not), refused at start-up when it was made for other
    settings than this server's, or in parts (`buckets generate --parts`) where this runner does not run steps
    in parts (`parts_refusal`: why; None: it does)."""
    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan

    from vllm_gaudi_unified.vllm_plugin.auto_plan import auto_plan

    plan = (auto_plan(vllm_config, kv_cache_spec, options, sliding_window, device_kind, parts_refusal or whole_steps)
            if path == "auto" else BucketPlan.load(path))
    if in_parts(plan) and parts_refusal is not None:
        raise ValueError(f"{ENV_BUCKETS}={path}: a plan of grid graphs (`buckets generate --parts`) runs a step with "
                         f"prompts in two parts, each its own graph; {parts_refusal}")
    sched = vllm_config.scheduler_config
    try:
        plan.check_compatible(kv_cache_spec.block_size, max_num_seqs=sched.max_num_seqs,
                              max_num_batched_tokens=sched.max_num_batched_tokens)
    except ValueError as exc:
        raise ValueError(f"{ENV_BUCKETS}={path}: {exc}") from None
    if options.batch_invariant != plan.settings.options.batch_invariant:
        raise ValueError(f"{ENV_BUCKETS}={path}: the plan was made with batch_invariant="
                         f"{plan.settings.options.batch_invariant}, but {ENV_BATCH_INVARIANT} asks for "
                         f"{options.batch_invariant}")
    logger.info("Unified attention: bucket plan %s, %d buckets, %d prompt graphs, miss policy %r", path, len(plan),
                len(plan.prompt_graphs), plan.miss_policy)
    return plan


def _num_speculative_tokens(vllm_config) -> int:
    """Draft tokens per decode of this server (0 without speculative decoding)."""
    spec = vllm_config.speculative_config
    return int(spec.num_speculative_tokens or 0) if spec is not None else 0


#: Trace files this process already records to. A model with several KV cache groups (sliding-window
#: layers beside full ones) has one builder per group, each planning the same step over its own block
#: table; one builder records, so the trace holds one line per step: a full-attention group's when the
#: model has one (a windowed group's block table has null blocks where blocks left the window), else
#: the first windowed group's (the header then names its window).
_CLAIMED_TRACES: set[str] = set()


def _trace_path(config: PluginConfig, vllm_config) -> str | None:
    """Only the first worker records (with several workers every one plans the same steps), and in it
    only the first builder that may record (`StepHooks.create(may_record=...)`)."""
    path = config.record_trace
    if not path or vllm_config.parallel_config.rank != 0 or path in _CLAIMED_TRACES:
        return None
    _CLAIMED_TRACES.add(path)
    return path


def _start_trace(path: str, vllm_config, kv_cache_spec, sliding_window: int | None) -> None:
    """A new trace file whose header holds the server settings the steps were recorded under."""
    from vllm_gaudi_unified.bucket_plans.trace import TraceWriter

    sched, cache, model = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    header = {
        "source": "vllm-gaudi-unified vLLM plugin",
        "block_size": kv_cache_spec.block_size,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": model.max_model_len,
        "num_blocks": cache.num_gpu_blocks,
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
        "sliding_window": sliding_window,
        "num_speculative_tokens": _num_speculative_tokens(vllm_config),
    }
    with TraceWriter(path, header=header):
        pass
    logger.info("Unified attention: recording every step to %s", path)
