"""Several attention kinds in one step (the Gaudi runner's `hpu_kinds.plan_kinds`), without vLLM.

Chunked local attention (`plan/local_chunks.py`) and sliding windows planned over one block table,
padded to one bucket, against a dense float64 reference that masks by position (written here: a
token sees key position `k` iff `k <= p`, and `p - k < window` / `k // chunk == p // chunk`).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SMALL_TILES, Step, assert_matches, make_block_table, make_tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gaudi_unified import Bucket, unified_attention
from vllm_gaudi_unified.plan.local_chunks import local_chunks
from vllm_gaudi_unified.vllm_plugin.hpu_kinds import FULL, AttentionKind, largest_shape, padding_work, plan_kinds


def dense_reference(q, k, v, kc, vc, step: Step, table, scale, window=None, chunk=None, soft_cap=None, sinks=None):
    """float64, one request at a time, every cached position gathered then masked by position."""
    bs, group = step.block_size, q.shape[1] // k.shape[1]
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for r, (n, ctx) in enumerate(zip(step.query_lens, step.context_lens)):
        blocks = torch.as_tensor(table[r][: -(-ctx // bs)], dtype=torch.long)
        keys = torch.cat([kc[blocks].flatten(0, 1)[:ctx], k[start:start + n]]).double().repeat_interleave(group, 1)
        vals = torch.cat([vc[blocks].flatten(0, 1)[:ctx], v[start:start + n]]).double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), keys) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        p, kp = ctx + torch.arange(n)[:, None], torch.arange(ctx + n)[None, :]
        seen = kp <= p
        if window is not None:
            seen &= p - kp < window
        if chunk is not None:
            seen &= kp // chunk == p // chunk
        s = s.masked_fill(~seen, float("-inf"))
        # Masked positions are dropped before the product: a NaN-poisoned slot outside a chunk is never read.
        s = torch.where(seen, s, torch.full_like(s, float("-inf")))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
        w = torch.softmax(s, dim=-1)[..., : ctx + n]
        out[start:start + n] = torch.einsum("hqk,khd->qhd", w, torch.nan_to_num(vals, nan=0.0, posinf=0.0))
        start += n
    return out


def _case(step: Step, seed: int, dtype=torch.float64):
    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)  # shuffled physical blocks, -1 past each request
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, dtype, seed)  # unreadable slots: NaN / inf
    return table, q, k, v, kc, vc


STEPS = {
    # (query_lens, context_lens, block_size): prompts across chunk boundaries, chunked prefill starting
    # inside a chunk, decodes at a chunk's first and last position, a shared prefix, GQA.
    "mixed": Step([13, 1, 1, 7, 1], [0, 16, 15, 21, 40], 4, prefix_groups=[([0, 3], 2)]),
    "prefill": Step([40, 3], [0, 0], 4),
    "decode": Step([1] * 5, [0, 7, 8, 31, 63], 8),
    "gqa_partial": Step([9, 1, 5], [11, 30, 2], 4, num_qo_heads=8, num_kv_heads=2),
}


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("chunk", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_chunked_local_attention_matches_dense_reference(name, chunk, dtype):
    step = STEPS[name]
    table, q, k, v, kc, vc = _case(step, seed=len(name) + chunk)
    kind = AttentionKind(chunk_size=chunk)
    batch = plan_kinds(step.query_lens, step.context_lens, table, step.block_size, [kind], SMALL_TILES, None,
                       "cpu")[kind]
    cast = lambda *ts: [t.to(dtype) for t in ts]  # noqa: E731
    out = unified_attention(*cast(q, k, v, kc, vc), batch, 0.3)
    ref = dense_reference(*cast(q, k, v, kc, vc), step, table, 0.3, chunk=chunk)
    assert_matches(out, ref)
    # The chunking changes the result (here: against full attention over the same cache).
    full = dense_reference(q, k, v, kc, vc, step, table, 0.3)
    assert (full - dense_reference(q, k, v, kc, vc, step, table, 0.3, chunk=chunk)).abs().max() > 1e-2
    # The logits rows are the real requests' last tokens, not the virtual ones'.
    assert batch.logits_indices.tolist() == (np.cumsum(step.query_lens) - 1).tolist()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 40)), min_size=1, max_size=6),
       st.sampled_from([4, 8, 12]), st.integers(0, 2**31 - 1))
def test_chunked_local_attention_random_steps(reqs, chunk, seed):
    step = Step([q for q, _ in reqs], [c for _, c in reqs], 4)
    table, q, k, v, kc, vc = _case(step, seed)
    kind = AttentionKind(chunk_size=chunk)
    batch = plan_kinds(step.query_lens, step.context_lens, table, 4, [kind], SMALL_TILES, None, "cpu")[kind]
    assert_matches(unified_attention(q, k, v, kc, vc, batch, 0.3),
                   dense_reference(q, k, v, kc, vc, step, table, 0.3, chunk=chunk))


def test_local_chunks_virtual_requests():
    """A 10-token chunk at context 6 with chunks of 8: positions 6..7 (chunk 0, context 6), 8..15 (chunk 1,
    context 0, table from block 2 with blocks of 4), a decode at 16 (chunk 2, context 0)."""
    table = np.arange(100, 110)[None, :].repeat(2, 0)
    q, c, t = local_chunks([10, 1], [6, 16], table, 4, 8)
    assert q.tolist() == [2, 8, 1] and c.tolist() == [6, 0, 0]
    assert t.tolist() == [[100, 101], [102, 103], [104, 105]]


@pytest.mark.parametrize("chunk", [0, -8, 6, 8.0])
def test_local_chunks_bad_chunk_size_names_it(chunk):
    with pytest.raises(ValueError, match="chunk_size"):
        local_chunks([1], [0], np.zeros((1, 1), np.int64), 4, chunk)


def test_kinds_pad_to_one_bucket():
    """Full, windowed (soft-cap, sinks) and chunked layers of one step: one bucket for all (the largest
    shape's), each kind's padded plan still exact; padding adds work only to the smaller kinds."""
    step = STEPS["mixed"]
    table, q, k, v, kc, vc = _case(step, seed=3)
    kinds = [FULL, AttentionKind(sliding_window=6), AttentionKind(chunk_size=8)]
    own = plan_kinds(step.query_lens, step.context_lens, table, 4, kinds, SMALL_TILES, None, "cpu")
    largest = largest_shape([b.shape for b in own.values()])
    target = Bucket(largest.phase, largest.query_len + 3, largest.num_shared_blocks + 8,
                    largest.num_unique_blocks + 5, largest.num_logits + 2, largest.num_causal_tiles + 1,
                    *largest.prompts)
    padded = plan_kinds(step.query_lens, step.context_lens, table, 4, kinds, SMALL_TILES, target, "cpu")
    assert {b.bucket for b in padded.values()} == {target}
    sinks = torch.randn(step.num_qo_heads, dtype=torch.float64)
    rows = target.query_len - q.shape[0]
    pad = lambda t: torch.cat([t, torch.zeros(rows, *t.shape[1:], dtype=t.dtype)])  # noqa: E731
    n = q.shape[0]
    for kind, batch in padded.items():
        kw = dict(logits_soft_cap=20.0, sinks=sinks) if kind.sliding_window else {}
        out = unified_attention(pad(q), pad(k), pad(v), kc, vc, batch, 0.3, **kw)[:n]
        ref = dense_reference(q, k, v, kc, vc, step, table, 0.3, window=kind.window, chunk=kind.chunk_size or None,
                              soft_cap=kw.get("logits_soft_cap"), sinks=kw.get("sinks"))
        assert_matches(out, ref)
    layers = {FULL: 2, kinds[1]: 2, kinds[2]: 2}
    needed, planned = padding_work(padded, layers)
    own_needed, own_planned = padding_work(own, layers)
    assert needed == own_needed and planned > own_planned >= own_needed
    # A bucket smaller than one kind's shape is refused, naming it.
    with pytest.raises(ValueError, match="does not cover"):
        plan_kinds(step.query_lens, step.context_lens, table, 4, kinds, SMALL_TILES, own[kinds[1]].shape, "cpu")


def test_layer_kinds():
    """A layer's kind: its impl's window, or a `ChunkedLocalAttention`'s chunk; both at once is refused."""
    from types import SimpleNamespace as NS

    from vllm_gaudi_unified.vllm_plugin.hpu_kinds import layer_kind

    assert layer_kind(NS(impl=NS(sliding_window=None))) == FULL
    assert layer_kind(NS(impl=NS(sliding_window=128))) == AttentionKind(128)
    assert layer_kind(NS(impl=NS(sliding_window=None), attention_chunk_size=8192)) == AttentionKind(0, 8192)
    assert [str(k) for k in sorted([AttentionKind(0, 32), AttentionKind(16), FULL])] == [
        "full", "chunked local (32)", "sliding window 16"]
    with pytest.raises(NotImplementedError, match="layer l3: a sliding window .* and chunked local attention"):
        layer_kind(NS(layer_name="l3", impl=NS(sliding_window=16), attention_chunk_size=32))
