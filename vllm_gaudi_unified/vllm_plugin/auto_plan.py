"""`VLLM_GAUDI_UNIFIED_BUCKETS=auto`: the bucket plan made at start-up for this server.

The plan is what `vllm-gaudi-unified buckets generate` makes by default, for the
server's own settings (block size, max_num_seqs, max_num_batched_tokens,
max_model_len, KV blocks, sliding window, speculative tokens), model and planner
options: the robust plan learned from the simulated mix of chat, RAG over long
shared documents and long prompts, 50 buckets and 50 prompt graphs (one seed of
each workload, `--seeds 1`: about 15 s on a shared 2-core host for the 8B
Gaudi-3 setting, the child's start included). The exponential plan of the settings alone held thousands of graphs.

Where the runner runs steps in parts (vllm-gaudi's runner in its torch.compile
mode, `PT_HPU_LAZY_MODE=0`, the Gaudi bridge's default, and a model of one KV cache
group of full attention without MLA, speculative decoding or pooling:
`hpu_parts.parts_support`), the plan is one in parts: `buckets generate` with
`PARTS_FLAGS` (grid graphs, its buckets learned at five loads with a margin on
unique blocks and causal tiles), which pads recorded chat and RAG less than the
whole plan (docs/bucketing.md, "Steps in parts"). Everywhere else (lazy mode, the
CPU platform, other models) it is the whole plan. An operator who wants the whole
plan in torch.compile mode passes a plan file made without `--parts`
(`VLLM_GAUDI_UNIFIED_BUCKETS=plan.json`). The start-up log says which kind `auto`
made and why.

It is made by the `buckets generate` command in a child process (the serving
process imports no offline tool) and kept in a cache folder under a key of
everything it depends on, so a restart with the same settings loads it. A
batch-invariant server keeps the exponential plan: its steps are replayed by the
invariant planner, too slow for start-up. If the command fails, the server falls
back to the exponential plan and logs why.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

from vllm_gaudi_unified.log import get_logger

logger = get_logger("vllm.gaudi_unified.steps")

#: Seeds of each simulated workload the start-up plan learns from (`buckets generate --seeds`).
AUTO_SEEDS = "1"
#: The `buckets generate` flags of the plan in parts `auto` makes where the runner runs steps in parts.
PARTS_FLAGS = ("--parts", "--load-fractions", "0.75,0.5,0.375,0.25,0.0625", "--margin-sizes", "unique,causal")


def auto_plan(vllm_config, kv_cache_spec, options, sliding_window: int | None, device_kind: str,
              parts_refusal: str | None):
    """The plan `auto` stands for on this server (module docstring): in parts when `parts_refusal` (why this
    server's steps do not run in parts, `steps._load_bucket_plan`) is None, else whole."""
    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan, gather_cap_for
    from vllm_gaudi_unified.bucket_plans.cost import Hardware

    settings, spec = server_settings(vllm_config, kv_cache_spec, options, sliding_window, device_kind)
    if options.batch_invariant:
        logger.info("Unified attention: auto makes the exponential plan: a batch-invariant server's steps are "
                    "replayed by the invariant planner, too slow for start-up")
    else:
        parts = parts_refusal is None
        logger.info("Unified attention: auto makes %s", "a plan in parts (buckets generate --parts): this runner "
                    "runs steps in parts (vllm-gaudi's torch.compile mode, one KV cache group of full attention)"
                    if parts else f"a whole plan, not one in parts: {parts_refusal}")
        path = cached_plan_path(settings, spec, parts)
        try:
            if not os.path.exists(path):
                make_plan(settings, spec, path, parts)
            plan = BucketPlan.load(path)
            if plan.settings == settings:
                return plan
            logger.warning("Unified attention: the plan made for auto (%s) has other settings than the server's",
                           path)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            logger.warning("Unified attention: could not make the auto plan (%s); using the exponential plan",
                           " ".join(str(exc).split())[-500:])
    from vllm_gaudi_unified.bucket_plans.exponential import exponential_plan

    cap = None if options.batch_invariant else gather_cap_for(settings, spec, Hardware())
    return with_simulated_prompt_graphs(exponential_plan(settings, spec, cap=cap))


def server_settings(vllm_config, kv_cache_spec, options, sliding_window, device_kind):
    """(ServerSettings, ModelSpec) of this server."""
    from vllm_gaudi_unified.bucket_plans.cost import ModelSpec
    from vllm_gaudi_unified.bucket_plans.device_options import options_for_device
    from vllm_gaudi_unified.bucket_plans.settings import BUCKET_OPTIONS, ServerSettings

    sched, model, parallel = vllm_config.scheduler_config, vllm_config.model_config, vllm_config.parallel_config
    spec = vllm_config.speculative_config
    settings = ServerSettings(block_size=kv_cache_spec.block_size, max_num_seqs=sched.max_num_seqs,
                              max_num_batched_tokens=sched.max_num_batched_tokens,
                              max_model_len=model.max_model_len, num_blocks=vllm_config.cache_config.num_gpu_blocks,
                              sliding_window=sliding_window,
                              options=options_for_device(device_kind, replace(BUCKET_OPTIONS,
                                                                              batch_invariant=options.batch_invariant)),
                              num_speculative_tokens=int(spec.num_speculative_tokens or 0) if spec is not None else 0)
    model_spec = ModelSpec(num_layers=model.get_num_layers(parallel),
                           num_qo_heads=model.get_num_attention_heads(parallel),
                           num_kv_heads=kv_cache_spec.num_kv_heads, head_dim=kv_cache_spec.head_size,
                           dtype_bytes=kv_cache_spec.dtype.itemsize, hidden_size=model.get_hidden_size(),
                           vocab_size=model.get_vocab_size())
    return settings, model_spec


def generate_command(settings, spec, path: str, parts: bool = False) -> list[str]:
    """The `buckets generate` command line of the auto plan for `settings` and `spec` (`parts`: in parts,
    `PARTS_FLAGS`)."""
    o = settings.options
    values = {"block_size": settings.block_size, "max_num_seqs": settings.max_num_seqs,
              "max_num_batched_tokens": settings.max_num_batched_tokens, "max_model_len": settings.max_model_len,
              "num_blocks": settings.num_blocks, "sliding_window": settings.sliding_window,
              "num_speculative_tokens": settings.num_speculative_tokens, "causal_tile": o.causal_tile,
              "shared_rows": o.shared_rows, "shared_tile_keys": o.shared_tile_keys, **asdict(spec)}
    flags = [a for k, v in values.items() if v is not None for a in ("--" + k.replace("_", "-"), str(v))]
    return [sys.executable, "-m", "vllm_gaudi_unified.tools.cli", "buckets", "generate", *flags,
            "--seeds", AUTO_SEEDS, *(PARTS_FLAGS if parts else ()), "--jobs", "1", "--no-progress", "-o", path]


def cached_plan_path(settings, spec, parts: bool = False) -> str:
    """Where the auto plan of `settings` and `spec` (`parts`: in parts) is kept: a key of them, of the flags and
    of the code that makes plans."""
    import vllm_gaudi_unified

    root = os.path.dirname(vllm_gaudi_unified.__file__)
    code = [(name, os.path.getsize(p), int(os.path.getmtime(p))) for folder in ("bucket_plans", "tools", "plan")
            for name in sorted(os.listdir(os.path.join(root, folder))) if name.endswith(".py")
            for p in [os.path.join(root, folder, name)]]
    key = json.dumps([settings.to_dict(), asdict(spec), AUTO_SEEDS, code] + ([list(PARTS_FLAGS)] if parts else []),
                     sort_keys=True, default=str)
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm_gaudi_unified")
    return os.path.join(cache, f"auto-plan-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def make_plan(settings, spec, path: str, parts: bool = False) -> None:
    """Run `buckets generate` for the auto plan into `path` (`parts`: in parts); a failure raises with the
    command's last words."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    t0 = time.perf_counter()
    done = subprocess.run(generate_command(settings, spec, path, parts), capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        raise subprocess.SubprocessError(f"buckets generate exited {done.returncode}: {done.stderr[-400:]}")
    logger.info("Unified attention: made the auto bucket plan in %.1f s: %s", time.perf_counter() - t0, path)


def with_simulated_prompt_graphs(plan):
    """`plan` with the prompt graphs the simulated mix of workloads (chat, RAG over long shared documents,
    long prompts: `workloads.MIXES`) hits most at its settings (what `buckets generate --strategy
    exponential --seeds 1` learns)."""
    from vllm_gaudi_unified.bucket_plans.prompt_graphs import learn_prompt_graphs
    from vllm_gaudi_unified.bucket_plans.simulator import SchedulerConfig, Simulator
    from vllm_gaudi_unified.bucket_plans.workloads import workload_from, workloads_of

    sched = SchedulerConfig.from_settings(plan.settings)
    steps = [s for name in workloads_of("mix") for s in Simulator(sched, workload_from(name), 1).steps()]
    graphs, info = learn_prompt_graphs(plan, steps)
    logger.info("Unified attention: %d prompt graphs take %d of %d simulated steps with prompts", len(graphs),
                info["prompt_steps_on_prompt_graphs"], info["prompt_steps"])
    return replace(plan, prompt_graphs=graphs, info={**plan.info, **info})
