"""LoRA adapters on the unified step: one adapter per token of the flat `[1, T]` batch.

vllm-gaudi's punica wrapper (`PunicaWrapperHPU`) does not gather adapters by index: each LoRA
layer multiplies its shrink output by a mask `[tokens, max_loras * max_lora_rank]` (its
`LoraMask`), ones in the columns of the token's adapter slot, zeros elsewhere. vllm-gaudi's
runner builds that mask per row of its padded `[batch, seq]` prompt batches and `[batch, 1]`
decode batches (`_configure_lora` / `create_lora_mask`); the unified step is one flat batch of
several requests, so here the mask has one row per token: the request's adapter on its
scheduled tokens, no adapter on padding. The logits take the rows of the sampled tokens
(`logits_rows`).

vLLM's `LoRAMapping` (`index_mapping`: one adapter id per token; `prompt_mapping`: one per
logits row) goes to vLLM's LoRA manager through vllm-gaudi's `set_active_loras`, as its runner
does: the manager loads the step's adapters into slots, and vLLM's embedding LoRA reads its
per-token indices from it (vllm-gaudi's `HPUVocabParallelEmbeddingWithLoRA`).
"""
from __future__ import annotations

import numpy as np
import torch
from vllm.lora.layers import LoRAMapping

NO_ADAPTER = 0  #: vLLM's id for "no LoRA" in a `LoRAMapping`


def request_adapter_ids(requests: dict, req_ids: list[str]) -> np.ndarray:
    """[R] int64: each request's `lora_int_id`, `NO_ADAPTER` for a request without one."""
    ids = [getattr(requests[r].lora_request, "lora_int_id", NO_ADAPTER) or NO_ADAPTER for r in req_ids]
    return np.asarray(ids, dtype=np.int64)


def token_adapter_ids(adapter_ids: np.ndarray, query_lens: np.ndarray, padded: int) -> np.ndarray:
    """[padded] int64: the adapter of every token of the flat step (requests in order), then
    `NO_ADAPTER` for the padding rows."""
    tokens = np.repeat(adapter_ids, query_lens)
    if len(tokens) > padded:
        raise ValueError(f"padded={padded} rows hold fewer than the step's {len(tokens)} tokens")
    out = np.full(padded, NO_ADAPTER, dtype=np.int64)
    out[:len(tokens)] = tokens
    return out


def adapter_mask(token_ids: np.ndarray, lora_index_to_id: list, max_loras: int, max_rank: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """`[len(token_ids), max_loras * max_rank]`: ones in the `max_rank` columns of each token's adapter
    slot (its index in the LoRA manager's `lora_index_to_id`), a zero row for `NO_ADAPTER`."""
    slot_of = {i: s for s, i in enumerate(lora_index_to_id) if i is not None}
    used = np.unique(token_ids[token_ids != NO_ADAPTER])
    missing = [int(i) for i in used if int(i) not in slot_of]
    if missing:
        raise RuntimeError(f"LoRA adapter ids {missing} are not in a slot of the LoRA manager ({lora_index_to_id}): "
                           "set_active_loras must run before the mask is built")
    slots = np.full(len(token_ids), -1, dtype=np.int64)
    for i in used:  # a loop over the step's adapters (at most max_loras), not its tokens
        slots[token_ids == i] = slot_of[int(i)]
    rows = np.flatnonzero(slots >= 0)
    mask = np.zeros((len(token_ids), max_loras * max_rank), dtype=np.float32)
    cols = slots[rows, None] * max_rank + np.arange(max_rank)
    mask[rows[:, None], cols] = 1.0
    return torch.from_numpy(mask).to(dtype)


def configure_step_lora(runner, step, padded: int, logits_rows: np.ndarray) -> torch.Tensor:
    """Activate the step's adapters with vLLM's per-token `LoRAMapping` and return the per-token
    mask `[padded, max_loras * max_rank]` on the runner's device (`runner`: the unified runner,
    `step`: its `HpuStep`; `logits_rows`: the flat rows whose logits are computed)."""
    config = runner.lora_config
    ids = request_adapter_ids(runner.requests, step.req_ids)
    per_token = token_adapter_ids(ids, step.query_lens, padded)
    lora_requests = {runner.requests[r].lora_request for r, i in zip(step.req_ids, ids) if i != NO_ADAPTER}
    mapping = LoRAMapping(per_token.tolist(), per_token[np.asarray(logits_rows, dtype=np.int64)].tolist(),
                          is_prefill=False)  # vllm-gaudi: always False on HPU
    runner.set_active_loras(lora_requests, mapping)
    index_to_id = runner.lora_manager._adapter_manager.lora_index_to_id
    mask = adapter_mask(per_token, index_to_id, config.max_loras, config.max_lora_rank, config.lora_dtype)
    return mask.to(runner.device)


def no_adapter_mask(runner, rows: int) -> torch.Tensor | None:
    """Warm-up forwards: no adapter on any of `rows` (the mapping too: vLLM's embedding LoRA reads its
    per-token offsets from it, uninitialised until a mapping is set). A zero mask; None without LoRA."""
    config = runner.lora_config
    if config is None:
        return None
    runner.set_active_loras(set(), LoRAMapping([NO_ADAPTER] * rows, [NO_ADAPTER], is_prefill=False))
    return torch.zeros(rows, config.max_loras * config.max_lora_rank, dtype=config.lora_dtype).to(runner.device)


def prompt_logprobs_by_request(runner, compute, prefill_hidden_states: dict, scheduler_output) -> dict:
    """vllm-gaudi's prompt logprobs (`compute`: its `_get_prompt_logprobs_dict`) one request at a time, each
    with its adapter's mask over the rows it takes: it runs the LoRA logits over a request's prompt rows
    (`hidden[:num_logits]`) with whatever mask was set last, the step's sampled rows (an assertion then
    fails in `dispatch_bgmv_linear`). `num_logits` as vllm-gaudi computes it: the scheduled prompt tokens
    that have a next prompt token."""
    from vllm_gaudi.extension.ops import LoraMask

    config, out = runner.lora_config, {}
    index_to_id = runner.lora_manager._adapter_manager.lora_index_to_id
    for req_id, hidden in prefill_hidden_states.items():
        request = runner.requests[req_id]
        rows = min(scheduler_output.num_scheduled_tokens[req_id],
                   len(request.prompt_token_ids or ()) - request.num_computed_tokens - 1)
        if rows > 0:
            ids = np.full(rows, request_adapter_ids(runner.requests, [req_id])[0], dtype=np.int64)
            mask = adapter_mask(ids, index_to_id, config.max_loras, config.max_lora_rank, config.lora_dtype)
            LoraMask.setLoraMask(mask.to(runner.device))
        out.update(compute({req_id: hidden}, scheduler_output))
    return out
