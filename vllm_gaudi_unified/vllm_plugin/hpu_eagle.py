"""EAGLE / EAGLE3 drafts on the Gaudi path, every drafter forward planned as a unified batch.

vllm-gaudi's `HpuEagleProposer` runs the drafter over its own prefill and decode batches with
`HPUAttentionMetadataV1` (the decode steps' built by `prepare_attn_metadata` from vllm-gaudi's
block lists); the unified runner plans no such batches. Here the drafter follows vLLM's EAGLE
proposer (padded drafter batch) with the runner's own plans:

- first pass: the step's rows exactly as the target ran them (same planned step, so the same
  `UnifiedHpuMetadata`, bucket and slots: the drafter's layers are in the step's KV cache group),
  each row's input the token one position later (for a request's last accepted row, the token just
  sampled; for a prompt chunk that does not sample, its next prompt token) and the target's hidden
  state of that row (EAGLE3: its auxiliary layers' states, combined by the head). Rows of rejected
  drafts run too (causal attention: they change nothing before them; later steps overwrite their slots);
- then `k - 1` steps of one row per request (query 1, context = its position) planned by
  `runner.plan_step`, the planner and bucket plan of the target's steps, over the step's block tables
  (vLLM's scheduler reserves the lookahead slots). A position past `max_model_len` runs as vLLM's does:
  position 0, context 0, its slot the padding slot.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_gaudi_unified.vllm_plugin.hpu_step import HpuStep, token_positions

#: The speculative methods whose drafter this module runs.
EAGLE_METHODS = ("eagle", "eagle3")


def drafter_adapter(runner):
    """vllm-gaudi's model adapter around the drafter (unwrapping an HPU graph wrapper)."""
    model = runner.drafter.model
    return getattr(model, "module", model) if not hasattr(model, "metadata_processor") else model


def propose_eagle(runner, sampled: list[list[int]]) -> torch.Tensor:
    """`[requests, k]` int64 draft tokens for the runner's last step, requests in input-batch order.

    `sampled[i]`: the tokens request i sampled this step (accepted drafts then the bonus or correction
    token; empty for a prompt chunk that does not sample)."""
    if runner._step_forward is None:
        raise RuntimeError("EAGLE drafts asked for a step the unified runner did not run (a warmup step?): the "
                           "drafter's first pass reads that step's forward")
    step, (metadata, hidden, aux) = runner.last_step, runner._step_forward
    k = runner.speculative_config.num_speculative_tokens
    n = len(step.req_ids)
    rows = next(iter(metadata.values())).batch.bucket.query_len
    counts = np.fromiter((len(sampled[i]) for i in range(n)), dtype=np.int64, count=n)
    # A request's last valid row: after its accepted drafts (a verifying decode), else its last row.
    last = np.where((np.arange(n) < runner.num_listed_decodes) & (counts > 0), counts - 1, step.query_lens - 1)
    first_row = np.cumsum(step.query_lens) - step.query_lens
    req, pos = token_positions(step, rows)
    width = runner.input_batch.token_ids_cpu.shape[1]
    ids = runner.input_batch.token_ids_cpu[req, np.minimum(pos + 1, width - 1)].astype(np.int64)
    ids[step.num_tokens:] = 0
    if runner.use_aux_hidden_state_outputs:  # EAGLE3: the head combines the auxiliary layers' states
        target_hidden = drafter_adapter(runner).model.combine_hidden_states(torch.cat(list(aux), dim=-1))
    else:
        target_hidden = hidden
    out_hidden, next_hidden = _draft_forward(runner, ids, pos, target_hidden, metadata)
    sample_rows = torch.from_numpy(first_row + last).to(out_hidden.device)
    drafts = [_argmax(runner, out_hidden[sample_rows])]
    next_hidden = next_hidden[sample_rows]
    positions = step.context_lens + last
    for s in range(1, k):
        positions = positions + 1
        over = positions >= runner.max_model_len
        dstep = HpuStep(step.req_ids, np.ones(n, dtype=np.int64), np.where(over, 0, positions), step.block_tables)
        md = runner.plan_step(dstep)
        if over.any():
            for m in {id(v): v for v in md.values()}.values():
                m.slot_mapping[torch.from_numpy(np.flatnonzero(over)).to(m.slot_mapping.device)] = runner._PAD_SLOT_ID
        drows = next(iter(md.values())).batch.bucket.query_len
        dids = np.zeros(drows, dtype=np.int64)
        dids[:n] = drafts[-1].cpu().numpy()
        dpos = np.zeros(drows, dtype=np.int64)
        dpos[:n] = dstep.context_lens
        h = next_hidden.new_zeros((drows, next_hidden.shape[-1]))
        h[:n] = next_hidden
        out_hidden, next_hidden = _draft_forward(runner, dids, dpos, h, md)
        drafts.append(_argmax(runner, out_hidden[:n]))
        next_hidden = next_hidden[:n]
    return torch.stack(drafts, dim=1).cpu()


def _draft_forward(runner, ids: np.ndarray, positions: np.ndarray, hidden: torch.Tensor, metadata):
    """One drafter forward over `[1, rows]` -> (hidden for the logits, hidden for the next step), `[rows, H]`."""
    device = runner.device
    adapter = drafter_adapter(runner)
    ids_t = torch.from_numpy(ids).view(1, -1).to(device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    extra = {}
    import habana_frameworks.torch as htorch

    if htorch.utils.internal.is_lazy():  # the drafter's shapes are not warmed: no graph capture
        extra["bypass_hpu_graphs"] = True
    out = runner.drafter.model(input_ids=ids_t, positions=torch.from_numpy(positions).view(1, -1).to(device),
                               hidden_states=hidden if adapter.flatten_input else hidden.unsqueeze(0),
                               inputs_embeds=None, attn_metadata=metadata, **extra)
    a, b = out  # (hidden for the logits, hidden for the next step); the same tensor for EAGLE
    return a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])


def _argmax(runner, hidden: torch.Tensor) -> torch.Tensor:
    return runner.drafter.model.compute_logits(hidden).argmax(dim=-1)
