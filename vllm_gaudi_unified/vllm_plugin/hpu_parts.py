"""Steps in parts (`step_parts.py`) on a Gaudi: which of vllm-gaudi's modes runs them, and how.

A plan of grid graphs (`buckets generate --parts`) runs a step with prompts as two attention calls, its grid
part in a grid graph and the rest in a bucket. Whether vllm-gaudi can run that depends on how it makes its
graphs (`vllm_gaudi/v1/worker/hpu_model_runner.py`):

- **lazy mode** (`PT_HPU_LAZY_MODE=1`): the model adapter is wrapped whole in an HPU graph
  (`_maybe_wrap_in_hpu_graph`), one graph per step shape. Two attention calls inside it would make a graph per
  (bucket, grid graph) pair; two model forwards would read every weight twice. A plan in parts is refused.
- **torch.compile mode** (`PT_HPU_LAZY_MODE=0`, without `enforce_eager`): `_maybe_compile` compiles the model
  with backend `"hpu_backend"`, regionally (each child of an `nn.ModuleList`, i.e. each decoder layer, and each
  RMSNorm and VocabParallelEmbedding, its own compiled region), `fullgraph` off. The unified impl then runs a
  plan in parts' attention behind a graph break (`UnifiedHpuMetadata.graph_backend`): a layer's region compiles
  as the graph before the attention and the graph after it, keyed by the step's rows, and the attention calls
  one separately compiled function per graph of the plan (`graphs.compiled_attention`, keyed by bucket or grid
  graph). Compiled attention graphs: buckets + grid graphs, a sum; the layers' graphs: one per row count,
  the buckets' (`model_rows`). The price: per layer a graph break, i.e. two compiled graphs and an eager call
  between them instead of one graph.

A step in parts runs the model over its rows in request order, padded to `model_rows`; every step of such a
plan, in parts or whole, takes the attention's own graphs, so the layers' graphs never depend on the bucket.
Steps in parts are planned for models of one KV cache group of full attention (not MLA, hybrids, encoders,
speculative decoding or pooling: `whole_steps`); their other steps run whole, and every step of those models
runs whole in the layer's graph (no graph break).
Where this runner runs steps in parts (torch.compile mode, such a model), `VLLM_GAUDI_UNIFIED_BUCKETS=auto` makes
a plan in parts (`auto_plan.py`); elsewhere a whole one.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from vllm_gaudi_unified.step_parts import StepParts, build_step_parts
from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuMetadata
from vllm_gaudi_unified.vllm_plugin.hpu_kinds import FULL
from vllm_gaudi_unified.vllm_plugin.hpu_step import slot_mapping

#: The compile backend vllm-gaudi's torch.compile mode uses (`vllm_gaudi.utils.HPUCompileConfig`).
HPU_COMPILE_BACKEND = "hpu_backend"


def lazy_mode() -> bool:
    import habana_frameworks.torch as htorch

    return bool(htorch.utils.internal.is_lazy())


def parts_support(runner, kinds) -> dict:
    """`StepHooks.create`'s arguments for this runner and a KV cache group of its layers by attention kind
    (`kinds`): why a plan in parts is refused (`parts_refusal`; None: the runner runs them), why the group's
    steps run whole under one (`whole_steps`), and the compile backend of the attention's own graphs (None:
    vllm-gaudi does not compile the model). `auto` makes a plan in parts where neither names a reason."""
    from vllm_gaudi.utils import is_fake_hpu

    whole = whole_steps(runner, kinds)
    if lazy_mode():
        return {"parts_refusal": "vllm-gaudi runs in lazy mode (PT_HPU_LAZY_MODE=1), which captures the whole "
                                 "model forward as one HPU graph per step shape: two parts would need a graph per "
                                 "(bucket, grid graph) pair, or two model forwards that each read every weight; "
                                 "serve it in torch.compile mode (PT_HPU_LAZY_MODE=0) or make the plan without "
                                 "--parts", "whole_steps": whole, "graph_backend": None}
    compiled = not is_fake_hpu() and not runner.model_config.enforce_eager  # as vllm-gaudi's `_maybe_compile`
    return {"parts_refusal": None, "whole_steps": whole, "graph_backend": HPU_COMPILE_BACKEND if compiled else None}


def whole_steps(runner, kinds) -> str | None:
    """Why a KV cache group's steps run whole under a plan in parts (None: its steps with prompts may run in
    parts): steps in parts are planned for models of one KV cache group of full attention, without MLA,
    speculative decoding or pooling (see the module doc). Known at start-up, when the plan is loaded."""
    reasons = ((set(kinds) != {FULL}, "attention other than full (sliding windows, chunked local attention)"),
               (len(runner.kv_cache_config.kv_cache_groups) != 1, "several KV cache groups"),
               (runner.model_config.use_mla, "MLA"), (runner.speculative_config is not None, "speculative decoding"),
               (runner.is_pooling_model, "a pooling model"))
    return next((f"steps in parts are planned for one KV cache group of full attention, not {why}"
                 for bad, why in reasons if bad), None)


def model_rows(plan, num_tokens: int) -> int:
    """The rows a step in parts runs the model with: the fewest query rows of a bucket of `plan` that hold its
    `num_tokens` (`BucketPlan.fewest_rows`; warmup runs every bucket through the model, so the layers' graphs
    see no other row count), else `num_tokens`."""
    return plan.fewest_rows(num_tokens)


def metadata_in_parts(runner, step, table: np.ndarray, hooks, kinds) -> dict | None:
    """`{layer_name: UnifiedHpuMetadata}` of the step in parts (`build_step_parts`), its model rows padded to
    `model_rows`; None: the step runs whole (always where the hooks' plan is whole or the group's steps run
    whole, `StepHooks.steps_in_parts`)."""
    if not hooks.steps_in_parts:
        return None
    plan = hooks.bucket_plan
    parts = build_step_parts(step.query_lens, step.context_lens, table, plan, device=runner.device)
    if parts is None:
        return None
    parts = replace(parts, batches=tuple(b.with_prompt_bias(runner.dtype) for b in parts.batches))
    rows = model_rows(plan, parts.num_tokens)
    slots = torch.from_numpy(slot_mapping(step, table, plan.settings.block_size, rows, runner._PAD_SLOT_ID))
    hooks.after_plan(parts.batches[0], step.query_lens, step.context_lens, table, parts=parts)
    md = UnifiedHpuMetadata(batch=parts.batches[0], slot_mapping=slots.to(runner.device), parts=parts,
                            graph_backend=hooks.graph_backend)
    return {name: md for names in kinds.values() for name in names}


def grid_graph_warmup(hooks, bucket, batch) -> tuple[StepParts, int] | None:
    """A grid graph's warmup step as a step in parts of its one part, and its model rows (`model_rows`: a row
    count the buckets' warmup compiles the layers for); None for a bucket, or hooks whose steps run whole."""
    from vllm_gaudi_unified.step_parts import is_grid_graph

    plan = hooks.bucket_plan
    if not hooks.steps_in_parts or not is_grid_graph(bucket):
        return None
    n = batch.num_tokens
    parts = StepParts((batch,), (torch.arange(n, device=batch.device),), n, (np.arange(n, dtype=np.int64),))
    return parts, model_rows(plan, n)
