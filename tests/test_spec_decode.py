"""Speculative decoding in the core: steps as vLLM schedules them with draft tokens, several in a row.

A speculative decode is a request whose query is its last sampled token
followed by `k` draft tokens, over its cached context. After the step the
target accepts the first `a` drafts (0 <= a <= k): the context grows by `1 + a`
and the K/V the step wrote for the rejected drafts stays in the cache past the
new context (vLLM does not clear it; the next step overwrites some of it). These
tests run such steps in a row, with prompt chunks and a shared prefix in the same
steps, and check each step against the dense reference over the true sequences.
The rejected drafts' slots are set to NaN after every step, so reading one of them
would show. Upstream's bug (drafts seeing later drafts) is checked by changing the
later drafts' keys and values and requiring bit-identical earlier rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SMALL_TILES, assert_matches

from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.reference import reference_attention

BS, HQ, HKV, D = 4, 4, 2, 8


def _block_tables(num_requests: int, max_len: int, prefix_group: list[int], prefix_blocks: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Blocks for `max_len` tokens per request from a shuffled free list (block 0: null block);
    the requests of `prefix_group` share their first `prefix_blocks` blocks."""
    per = -(-max_len // BS)
    num_blocks = num_requests * per + 1
    free = list(rng.permutation(np.arange(1, num_blocks)))
    table = np.array([[free.pop() for _ in range(per)] for _ in range(num_requests)])
    for r in prefix_group[1:]:
        table[r, :prefix_blocks] = table[prefix_group[0], :prefix_blocks]
    return table, num_blocks


def _slots(table: np.ndarray, r: int, positions: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(table[r, positions // BS] * BS + positions % BS)


def _run_step(q, k, v, kc, vc, query_lens, context_lens, table, num_blocks):
    """Write the step's K/V at their slots (as vLLM's backend does before attending), then attend."""
    slots = torch.cat([_slots(table, r, np.arange(c, c + n)) for r, (n, c) in enumerate(zip(query_lens, context_lens))])
    kc.view(-1, HKV, D)[slots], vc.view(-1, HKV, D)[slots] = k, v
    batch = build_unified_batch(query_lens, context_lens, table, BS, num_blocks=num_blocks, options=SMALL_TILES)
    return unified_attention(q, k, v, kc, vc, batch, 0.4), batch


@pytest.mark.parametrize("num_drafts", [1, 2, 3, 4])
def test_speculative_steps_with_rejections_and_rollback(num_drafts):
    """Five steps: request 0 is a prompt fed in chunks, then decodes; requests 1-3 share a 2-block prefix
    and decode speculatively with `num_drafts` drafts (some steps propose fewer, as ngram does when it
    finds no match), each step accepting a random number of drafts and rolling back the rest."""
    rng = np.random.default_rng(num_drafts)
    g = torch.Generator().manual_seed(num_drafts)
    table, num_blocks = _block_tables(4, 64, [1, 2, 3], 2, rng)
    kc = torch.full((num_blocks, BS, HKV, D), float("nan"), dtype=torch.float64)
    vc = torch.full_like(kc, float("inf"))
    # Cached context at the start: request 0 has nothing yet; 1-3 share 8 prefix tokens, then their own.
    context = np.array([0, 9, 11, 13])
    prompt_left = 13  # request 0's prompt tokens still to feed
    for r in range(1, 4):
        pos = np.arange(context[r])
        kc.view(-1, HKV, D)[_slots(table, r, pos)] = torch.randn(len(pos), HKV, D, generator=g, dtype=torch.float64)
        vc.view(-1, HKV, D)[_slots(table, r, pos)] = torch.randn(len(pos), HKV, D, generator=g, dtype=torch.float64)
    for step in range(5):
        chunk = min(prompt_left, 6)
        drafts = rng.integers(0, num_drafts + 1, size=3)  # drafts proposed this step per decode
        query_lens = np.array([chunk if chunk else 1 + int(rng.integers(0, num_drafts + 1))] + list(1 + drafts))
        t = int(query_lens.sum())
        q = torch.randn(t, HQ, D, generator=g, dtype=torch.float64)
        k = torch.randn(t, HKV, D, generator=g, dtype=torch.float64)
        v = torch.randn(t, HKV, D, generator=g, dtype=torch.float64)
        out, batch = _run_step(q, k, v, kc, vc, query_lens, context, table, num_blocks)
        ref = reference_attention(q, k, v, kc, vc, query_lens, context, table, 0.4)
        assert_matches(out, ref)
        if query_lens[1:].max() > 1:
            assert batch.phase[0] == "c", "draft rows must be causal among themselves"
        # Accept some drafts, roll back the rest: their slots hold stale K/V (here NaN) past the new context.
        is_prompt = np.array([chunk > 0, False, False, False])
        accepted = np.where(is_prompt, query_lens, 1 + rng.integers(0, query_lens))  # 1 + a with a <= drafts
        for r in range(4):
            stale = np.arange(context[r] + accepted[r], context[r] + query_lens[r])
            kc.view(-1, HKV, D)[_slots(table, r, stale)] = float("nan")
            vc.view(-1, HKV, D)[_slots(table, r, stale)] = float("nan")
        context = context + accepted
        prompt_left -= chunk


@pytest.mark.parametrize("num_drafts", [1, 2, 4])
def test_each_draft_sees_the_prefix_and_earlier_drafts_only(num_drafts):
    """Upstream's bug: draft rows were not causal. Changing draft j's key and value must leave every row
    before it bit-identical (the last sampled token and drafts < j) and change draft j's own row,
    with the drafts over a prefix shared by two requests (shared path) and a unique context."""
    rng = np.random.default_rng(7)
    g = torch.Generator().manual_seed(7)
    table, num_blocks = _block_tables(3, 32, [0, 1], 3, rng)
    context = np.array([14, 13, 9])
    query_lens = np.full(3, 1 + num_drafts)
    kc = torch.full((num_blocks, BS, HKV, D), float("nan"), dtype=torch.float64)
    vc = torch.full_like(kc, float("inf"))
    for r in range(3):
        pos = np.arange(context[r])
        kc.view(-1, HKV, D)[_slots(table, r, pos)] = torch.randn(len(pos), HKV, D, generator=g, dtype=torch.float64)
        vc.view(-1, HKV, D)[_slots(table, r, pos)] = torch.randn(len(pos), HKV, D, generator=g, dtype=torch.float64)
    t = int(query_lens.sum())
    q = torch.randn(t, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(t, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(t, HKV, D, generator=g, dtype=torch.float64)
    base, batch = _run_step(q, k, v, kc.clone(), vc.clone(), query_lens, context, table, num_blocks)
    assert batch.phase[:2] == "cs"
    assert_matches(base, reference_attention(q, k, v, kc, vc, query_lens, context, table, 0.4))
    starts = np.r_[0, np.cumsum(query_lens)[:-1]]
    for j in range(1, num_drafts + 1):
        rows = starts + j  # draft j of every request
        k2, v2 = k.clone(), v.clone()
        k2[rows], v2[rows] = 50.0, -50.0
        moved, _ = _run_step(q, k2, v2, kc.clone(), vc.clone(), query_lens, context, table, num_blocks)
        earlier = np.concatenate([np.arange(s, s + j) for s in starts])
        later = np.concatenate([np.arange(s + j, s + 1 + num_drafts) for s in starts])
        torch.testing.assert_close(moved[earlier], base[earlier], atol=0, rtol=0)
        assert not torch.allclose(moved[later], base[later])
