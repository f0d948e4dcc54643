"""Multimodal inputs (images) in the unified runner's flat step, on the Gaudi path.

vllm-gaudi runs the vision encoder per prefill batch of its own and lays the image embeddings and
M-RoPE positions out in its `[batch, padded length]` shape. The unified runner's step is one flat batch
of every scheduled request (prompt chunks, decodes, text-only and image requests together), so it
builds the model inputs of that batch here, against vLLM 0.32's multimodal interfaces:

- `encode_scheduled`: the encoder inputs the scheduler scheduled this step
  (`scheduled_encoder_inputs`: it budgets encoder work and skips images a prefix-cache hit covers),
  batched per modality by vLLM's `group_and_batch_mm_kwargs`, through the model's `embed_multimodal`,
  kept by hash in the runner's `encoder_cache` (which vllm-gaudi's `_update_states` frees when the
  scheduler says);
- `step_inputs_embeds`: the step's `inputs_embeds`: each image overlapping a request's scheduled tokens
  gives the rows of its embedding that fall in the step (a prompt chunk may start or end inside its
  placeholders), put at their flat rows by the model's `embed_input_ids`; padding rows embed token 0;
- `mrope_positions`: M-RoPE models (Qwen2-VL and later) take `[3, padded]` positions: the prompt's, which
  vllm-gaudi's `_update_states` asks the model for, and past the prompt the position plus the request's
  delta on all three axes (what vLLM's `MRotaryEmbedding.get_next_input_positions` gives).

Host work is per request and per image (numpy over each one's tokens), never per token.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_gaudi_unified.vllm_plugin.hpu_step import HpuStep


def refused_multimodal(model_config) -> str | None:
    """Why the unified runner does not serve this multimodal model, or None (it serves it)."""
    if model_config.is_multimodal_raw_input_only_model:
        return (f"{model_config.architecture} takes raw multimodal inputs in its forward (no encoder embeddings "
                "to place in the flat step)")
    mm = model_config.multimodal_config
    if mm is not None and getattr(mm, "video_pruning_rate", None):
        return f"{model_config.architecture} with video pruning (M-RoPE positions recomputed from the embeddings)"
    return None


def encode_scheduled(runner, scheduler_output) -> None:
    """Run the encoder over the inputs scheduled this step that the cache does not hold yet."""
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    hashes, kwargs = [], []
    for req_id, indices in (scheduler_output.scheduled_encoder_inputs or {}).items():
        for i in indices:
            feature = runner.requests[req_id].mm_features[i]
            if feature.data is None or feature.identifier in runner.encoder_cache:
                continue
            hashes.append(feature.identifier)
            kwargs.append((feature.modality, feature.data))
    if not kwargs:
        return
    order = sorted(range(len(kwargs)), key=lambda i: kwargs[i][0])  # one batch per modality where possible
    hashes, kwargs = [hashes[i] for i in order], [kwargs[i] for i in order]
    outputs = []
    for _, num_items, batch in group_and_batch_mm_kwargs(kwargs, device=runner.device,
                                                         pin_memory=runner.pin_memory):
        out = runner.model.embed_multimodal(**batch)
        if len(out) != num_items:
            raise RuntimeError(f"the model's embed_multimodal returned {len(out)} embeddings for {num_items} "
                               "multimodal items")
        outputs.extend(out)
    runner.encoder_cache.update(zip(hashes, outputs))


def step_embeddings(runner, step: HpuStep) -> tuple[list[torch.Tensor], np.ndarray]:
    """The encoder rows this step's tokens take, in flat-row order, and a `[num_tokens]` mask of those rows."""
    embeds, is_mm = [], np.zeros(step.num_tokens, dtype=bool)
    starts = np.cumsum(step.query_lens) - step.query_lens
    for req_id, first, done, count in zip(step.req_ids, starts, step.context_lens, step.query_lens):
        done, count = int(done), int(count)
        for feature in runner.requests[req_id].mm_features:
            where = feature.mm_position
            lo, hi = max(done - where.offset, 0), min(done + count - where.offset, where.length)
            if lo >= hi:  # the placeholders lie before this chunk (in the cache) or after it
                continue
            begin, end = where.get_embeds_indices_in_range(lo, hi)
            if begin == end:
                continue
            output = runner.encoder_cache.get(feature.identifier)
            if output is None:
                raise RuntimeError(f"request {req_id}: no encoder output for multimodal item {feature.identifier} "
                                   "scheduled in this step (encoder cache miss)")
            rows = slice(first + where.offset + lo - done, first + where.offset + hi - done)
            is_mm[rows] = True if where.is_embed is None else where.is_embed[lo:hi].numpy()
            embeds.append(output[begin:end])
    return embeds, is_mm


def step_inputs_embeds(runner, token_ids: torch.Tensor, step: HpuStep, scheduler_output) -> torch.Tensor:
    """`[1, padded, hidden]`: the step's token embeddings (`token_ids`: `[1, padded]`) with its images' rows in
    place, after encoding what the scheduler scheduled."""
    encode_scheduled(runner, scheduler_output)
    embeds, is_mm = step_embeddings(runner, step)
    flat = token_ids.reshape(-1)
    mask = np.zeros(flat.shape[0], dtype=bool)
    mask[:len(is_mm)] = is_mm
    out = runner.model.embed_input_ids(flat, multimodal_embeddings=embeds,
                                       is_multimodal=torch.from_numpy(mask).to(flat.device))
    return out.view(1, flat.shape[0], -1)


def text_inputs_embeds(runner, token_ids: torch.Tensor) -> torch.Tensor:
    """`[1, padded, hidden]` token embeddings alone: what a warmup step of a multimodal model feeds its graph
    (serving steps of these models always run from `inputs_embeds`, so their graphs take them as input)."""
    flat = token_ids.reshape(-1)
    return runner.model.embed_input_ids(flat).view(1, flat.shape[0], -1)


def mrope_positions(requests: dict, step: HpuStep, positions: np.ndarray) -> np.ndarray:
    """`[3, padded]` M-RoPE positions for the flat step's `positions` (`[padded]`, `hpu_step.token_positions`;
    padding rows keep position 0 on every axis)."""
    out = np.zeros((3, positions.shape[0]), dtype=np.int64)
    starts = np.cumsum(step.query_lens) - step.query_lens
    for req_id, first, count in zip(step.req_ids, starts, step.query_lens):
        req = requests[req_id]
        pos = positions[first:first + count]
        prompt = req.mrope_positions.numpy()
        inside = pos < prompt.shape[1]
        out[:, first:first + count] = np.where(inside, prompt[:, np.where(inside, pos, 0)],
                                               pos + int(req.mrope_position_delta))
    return out
