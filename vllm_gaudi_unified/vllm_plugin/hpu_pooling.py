"""Pooling models (embeddings) through the unified runner: one unified batch per step, then the pooler.

vllm-gaudi's own `execute_model` runs a pooling model one request at a time with its own metadata
(whole prompt, no context, its prompt buckets). Here the step is planned like any other
(`UnifiedHpuModelRunner.plan_step`: prompt chunks over cached context, several requests, the bucket
plan), the model runs once, and the model's pooler reads each request's hidden states as vLLM's own
runners hand them to it (`PoolingMetadata.build_pooling_cursor` over the flattened rows); a request
whose prompt is not complete yet (a chunked prefill) gets no output this step, as in vLLM.
"""
from __future__ import annotations

import numpy as np
import torch


def pool_step(runner, scheduler_output):
    """One step of a pooling model through the unified runner -> vLLM's `ModelRunnerOutput`."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import _copy_pooler_output_to_cpu

    from vllm_gaudi_unified.vllm_plugin.hpu_step import step_from_input_batch

    batch = runner.input_batch
    if batch.num_reqs != len(batch.pooling_params):
        raise ValueError(f"a step of {batch.num_reqs} requests of which {len(batch.pooling_params)} are pooling "
                         "requests: a pooling model's steps hold pooling requests only")
    step = step_from_input_batch(batch, scheduler_output.num_scheduled_tokens,
                                 resolve_blocks=runner._resolve_block_table)
    runner.last_step = step
    metadata = runner.plan_step(step)
    padded = next(iter(metadata.values())).batch.bucket.query_len
    _, tokens, positions = runner.step_inputs(step, padded)
    hidden = pooling_forward(runner, tokens, positions, metadata)[:step.num_tokens]
    seq_lens = torch.from_numpy(step.context_lens + step.query_lens)
    pooling = batch.get_pooling_metadata()
    pooling.build_pooling_cursor(step.query_lens.astype(np.int32), seq_lens, device=hidden.device)
    raw = runner.model.pooler(hidden_states=hidden, pooling_metadata=pooling)
    finished = pooling.get_pooling_cursor().get_finished_mask()
    output = ModelRunnerOutput(req_ids=list(step.req_ids), req_id_to_index=dict(batch.req_id_to_index))
    output.pooler_output = (_copy_pooler_output_to_cpu(raw, finished) if raw is not None and any(finished)
                            else [None] * len(step.req_ids))
    return output


def pooling_forward(runner, tokens: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
    """The bare model (vllm-gaudi wraps no adapter around a pooling model) over a planned step:
    `[1, T]` inputs flattened, the unified metadata in vLLM's forward context -> hidden `[T, hidden]`."""
    from vllm.forward_context import set_forward_context

    with set_forward_context(metadata, runner.vllm_config):
        hidden = runner.model.forward(input_ids=tokens.view(-1), positions=positions.view(-1))
    return hidden.reshape(-1, hidden.shape[-1])
