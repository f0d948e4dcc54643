"""Speculative decoding (ngram) through vllm-gaudi's sampling, with one unified forward per step.

vllm-gaudi verifies drafts in its decode branch: rejection sampling over the
logits of every decode row, after its prefill branch sampled the prompts. The
unified runner keeps that split for sampling only (`hpu_runner.py`); the rows
come from the step's one forward. What this module adds:

- `spec_decode_metadata`: vLLM's `SpecDecodeMetadata` for the decodes of the
  step, in vLLM's compact layout (one logits row per decode token);
- `GreedyRejectionSampler`: vLLM's `RejectionSampler` with greedy verification
  for that layout. vllm-gaudi replaces vLLM's `rejection_sample` with one that
  reads its own padded layout (every decode `max drafts + 1` rows) and, when a
  request has fewer drafts than the longest and all of them are accepted, drops
  the request's bonus token (padding rows count as mismatches). Greedy only, as
  vllm-gaudi's: a random-sampling request is refused with the reason.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, apply_sampling_constraints
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata


def spec_decode_metadata(query_lens: np.ndarray, token_ids: np.ndarray, device) -> SpecDecodeMetadata:
    """Rejection-sampling metadata for decodes that occupy the step's first rows, each with
    `query_len = 1 + drafts` rows (its last sampled token, then its draft tokens).

    Compact layout (vLLM's GPU runner's): the logits are those of every decode row in row order
    (`logits_indices = arange(rows)`); request i's drafts are verified by its first `drafts_i` rows,
    its bonus token comes from its last row, and each draft is the token one row below the logits
    that verify it."""
    drafts = query_lens - 1
    ends = np.cumsum(query_lens)
    req = np.repeat(np.arange(len(drafts)), drafts)
    within = np.arange(int(drafts.sum())) - np.repeat(np.cumsum(drafts) - drafts, drafts)
    target = (ends - query_lens)[req] + within

    def on_device(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

    return SpecDecodeMetadata(
        draft_token_ids=on_device(token_ids[target + 1]),
        num_draft_tokens=drafts.tolist(),
        cu_num_draft_tokens=on_device(np.cumsum(drafts)),
        cu_num_sampled_tokens=on_device(ends),
        target_logits_indices=on_device(target),
        bonus_logits_indices=on_device(ends - 1),
        logits_indices=on_device(np.arange(int(ends[-1]) if len(ends) else 0)),
    )


def greedy_verify(draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor, bonus_token_ids: torch.Tensor,
                  num_draft_tokens: list[int]) -> torch.Tensor:
    """Greedy verification, vectorised: per request, the target's tokens up to and including the first
    that differs from its draft, or all drafts and then the bonus token. -> `[requests, max drafts + 1]`
    int32, `PLACEHOLDER_TOKEN_ID` past each request's output (vLLM's `parse_output` drops those).

    draft/target `[total drafts]` (compact, request after request), bonus `[requests]`."""
    device = target_token_ids.device
    n, width = len(num_draft_tokens), max(num_draft_tokens, default=0)
    d = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    if width == 0:
        return bonus_token_ids.reshape(n, 1).int()
    pos = torch.arange(width, device=device)[None, :]
    valid = pos < d[:, None]
    flat = ((torch.cumsum(d, 0) - d)[:, None] + pos).clamp(max=int(d.sum()) - 1)  # [n, width] into the drafts
    target = target_token_ids[flat]
    mismatch = valid & (target != draft_token_ids[flat])
    # Drafts accepted: up to the first mismatch (whose target token is the correction), or all of them.
    accepted = torch.where(mismatch.any(1), mismatch.int().argmax(1), d)
    out = torch.full((n, width + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
    out[:, :width] = torch.where(valid & (pos <= accepted[:, None]), target, PLACEHOLDER_TOKEN_ID)
    done = accepted == d
    out[torch.arange(n, device=device)[done], d[done]] = bonus_token_ids.flatten()[done].int()
    return out


class GreedyRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler (logits processors, sampling constraints, bonus sampling, logprobs)
    with `greedy_verify` in place of the module-level `rejection_sample` that vllm-gaudi replaced."""

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                sampling_metadata) -> SamplerOutput:
        if not sampling_metadata.all_greedy:
            raise NotImplementedError("speculative decoding with unified attention on Gaudi verifies drafts "
                                      "greedily only (as vllm-gaudi does): use temperature 0 with a "
                                      "speculative_config, or turn speculation off for sampled requests")
        bonus = self.sampler(logits=logits[metadata.bonus_logits_indices],
                             sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
                             predict_bonus_token=True,
                             logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode
                             else "raw_logits")
        raw_target = logits[metadata.target_logits_indices].to(torch.float32)
        target = raw_target if self.is_processed_logprobs_mode else raw_target.clone()
        target = self.apply_logits_processors(target, sampling_metadata, metadata)
        target = apply_sampling_constraints(target, metadata.cu_num_draft_tokens, sampling_metadata)
        out = greedy_verify(metadata.draft_token_ids, target.argmax(dim=-1), bonus.sampled_token_ids,
                            metadata.num_draft_tokens)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._get_logprobs_tensors(sampling_metadata.max_num_logprobs, metadata, logits,
                                                  target if self.is_processed_logprobs_mode else raw_target,
                                                  bonus.logprobs_tensors.logprobs, out)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)
