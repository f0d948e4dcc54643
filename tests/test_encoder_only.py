"""Encoder-only (bidirectional) steps: every new token sees every new token of its request, no cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SMALL_TILES, assert_matches
from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.reference import reference_attention

TILES = {"small": SMALL_TILES, "unit": PlanOptions(causal_tile=1), "default": PlanOptions(),
         "odd": PlanOptions(causal_tile=3)}


def encoder_case(query_lens, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0, options=SMALL_TILES, bucket=None,
                 window=None):
    """-> (output, float64 reference, batch); an empty cache (encoders read none); `window`: two-sided."""
    g = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    cache = torch.empty((0, 16, hkv, d), dtype=dtype)
    table = np.zeros((len(query_lens), 1), np.int64)
    zeros = [0] * len(query_lens)
    batch = build_unified_batch(query_lens, zeros, table, 16, options=options, bucket=bucket, causal=False,
                                sliding_window=window)
    out = unified_attention(q, k, v, cache, cache, batch, 0.41)
    ref = reference_attention(q, k, v, cache, cache, query_lens, zeros, table, 0.41, causal=False,
                              sliding_window=window)
    return out, ref, batch, (q, k, v)


@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_ragged_requests_match_the_reference(tiles, dtype):
    out, ref, batch, _ = encoder_case([7, 1, 16, 3, 2, 9], dtype=dtype, options=TILES[tiles])
    assert batch.phase == "c--" and batch.plan.bidirectional
    assert_matches(out, ref)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
def test_gqa_and_mqa(hq, hkv):
    assert_matches(*encoder_case([5, 11, 2], hq=hq, hkv=hkv)[:2])


def test_single_token_requests_see_only_themselves():
    out, ref, batch, (_, _, v) = encoder_case([1, 1, 1])
    assert batch.phase == "---" and batch.shape.num_causal_tiles == 0
    assert_matches(out, ref)
    torch.testing.assert_close(out, v.repeat_interleave(2, 1), rtol=0, atol=0)


def test_every_token_of_a_request_gets_the_same_keys():
    """Bidirectional, not causal: the first token's output depends on the last token's value."""
    out, ref, _, (q, k, v) = encoder_case([6, 4])
    v2 = v.clone()
    v2[5] += 1.0  # the last token of request 0
    cache = torch.empty((0, 16, 2, 8), dtype=torch.float64)
    batch = build_unified_batch([6, 4], [0, 0], np.zeros((2, 1), np.int64), 16, options=SMALL_TILES, causal=False)
    changed = unified_attention(q, k, v2, cache, cache, batch, 0.41)
    assert (changed[:6] - out[:6]).abs().amax(-1).amax(-1).min() > 0  # every token of request 0 moved
    torch.testing.assert_close(changed[6:], out[6:], rtol=0, atol=0)  # request 1 did not


def test_padding_to_a_larger_bucket_changes_nothing():
    out, _, batch, _ = encoder_case([7, 2, 5])
    s = batch.shape
    big = Bucket("c--", s.query_len + 5, 0, 0, s.num_logits + 2, s.num_causal_tiles + 3)
    padded, ref, pbatch, _ = encoder_case([7, 2, 5], bucket=big)
    assert pbatch.bucket == big
    assert_matches(padded, ref)
    torch.testing.assert_close(padded, out, rtol=0, atol=0)


@pytest.mark.parametrize("lens", [[7, 2, 5], [1, 1, 1], [16], [33, 1, 9, 4, 2]])
def test_power_of_two_buckets_as_the_gaudi_runner_pads(lens):
    """`bucket.pow2_bucket` (the Gaudi runner's encoder-only steps, `hpu_kinds.plan_encoder_only`): the same
    phase, every size the next power of two (under 2x), and the padded step gives the unpadded rows exactly."""
    from vllm_gaudi_unified.bucket import pow2_bucket

    out, ref, batch, _ = encoder_case(lens)
    s = batch.shape
    b = pow2_bucket(s)
    assert b.phase == s.phase and b.covers(s)
    assert all(n == 0 if m == 0 else m <= n < 2 * m and n & (n - 1) == 0 for n, m in zip(b.sizes, s.sizes))
    padded, _, pbatch, _ = encoder_case(lens, bucket=b)
    assert pbatch.bucket == b
    torch.testing.assert_close(padded, out, rtol=0, atol=0)
    assert_matches(padded, ref)


def test_tiles_hold_each_pair_of_a_request_once():
    """Every (row, key) pair of one request, self excepted, lies in exactly one tile."""
    q = np.array([9, 1, 4, 2])
    batch = build_unified_batch(q, [0] * 4, np.zeros((4, 1), np.int64), 16, options=SMALL_TILES, causal=False)
    assert batch.shape.num_causal_tiles == 3 * 3 + 2 * 1 + 1  # query tiles [0,4) [4,8) [8,12) [12,16)
    assert batch.work_needed.causal == int(np.dot(q, q))
    owner = np.repeat(np.arange(4), q)
    seen = np.zeros((16, 16), int)
    for qs, ks in zip(batch.plan.causal_q_start, batch.plan.causal_k_start):
        seen[qs:qs + 4, ks:ks + 4] += 1
    pairs = (owner[:, None] == owner[None, :]) & ~np.eye(16, dtype=bool)
    assert (seen[pairs] == 1).all()


@pytest.mark.parametrize("window", [1, 2, 3, 6, 40])
@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_two_sided_windows(tiles, dtype, window):
    """A sliding window in an encoder-only step (ModernBERT's local layers) is two-sided: keys less than W
    positions away on either side, inside the request; tiles only within reach of their tokens."""
    lens = [7, 1, 16, 3, 2, 9]
    out, ref, batch, _ = encoder_case(lens, dtype=dtype, options=TILES[tiles], window=window)
    assert batch.sliding_window == window and batch.plan.bidirectional
    assert batch.work_needed.causal == sum(min(i + window, n) - max(i - window + 1, 0) for n in lens for i in range(n))
    assert_matches(out, ref)
    if window < 16:  # the window matters: whole-request attention differs
        full = encoder_case(lens, dtype=dtype, options=TILES[tiles])[0]
        assert (full - out).abs().max() > 1e-2
    if window == 1:  # each token alone: its own value
        assert batch.shape.num_causal_tiles == 0


def test_window_tiles_hold_each_pair_in_reach_once():
    """With a window, every (row, key) pair of one request within W - 1 (self excepted) lies in exactly one
    tile, and whole tiles out of reach are not listed."""
    q, w, tile = np.array([20, 3, 9]), 3, 4
    opts = PlanOptions(causal_tile=tile)
    batch = build_unified_batch(q, [0] * 3, np.zeros((3, 1), np.int64), 16, options=opts, causal=False,
                                sliding_window=w)
    unwindowed = build_unified_batch(q, [0] * 3, np.zeros((3, 1), np.int64), 16, options=opts, causal=False)
    assert batch.shape.num_causal_tiles < unwindowed.shape.num_causal_tiles
    owner = np.repeat(np.arange(3), q)
    t = int(q.sum())
    seen = np.zeros((t + tile, t + tile), int)
    for qs, ks in zip(batch.plan.causal_q_start, batch.plan.causal_k_start):
        seen[qs:qs + tile, ks:ks + tile] += 1
    idx = np.arange(t)
    pairs = (owner[:, None] == owner[None, :]) & (np.abs(idx[:, None] - idx[None, :]) < w) & ~np.eye(t, dtype=bool)
    assert (seen[:t, :t][pairs] == 1).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(context_lens=[0, 3]), r"context_lens\[1\] = 3 must be 0"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(options=PlanOptions(batch_invariant=True)), "batch_invariant"),
])
def test_refusals_name_the_field(kwargs, match):
    args = dict(query_lens=[3, 2], context_lens=[0, 0], block_table=np.zeros((2, 1), np.int64), block_size=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_unified_batch(**args, causal=False)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 13), min_size=1, max_size=5), tile=st.sampled_from([1, 2, 4, 5, 64]),
       hkv=st.sampled_from([1, 2]), poison=st.integers(0, 10**6), seed=st.integers(0, 1000),
       window=st.sampled_from([None, 1, 2, 5]))
def test_random_steps_and_containment(lens, tile, hkv, poison, seed, window):
    """Random ragged steps match the reference; a NaN in one token's value reaches the tokens that see it
    alone (its request's, within the window)."""
    opts = PlanOptions(causal_tile=tile)
    out, ref, batch, (q, k, v) = encoder_case(lens, hq=2 * hkv, hkv=hkv, options=opts, seed=seed, window=window)
    assert_matches(out, ref)
    t = sum(lens)
    bad = poison % t
    v[bad, 0, poison % 8] = float("nan")
    cache = torch.empty((0, 16, hkv, 8), dtype=torch.float64)
    poisoned = unified_attention(q, k, v, cache, cache, batch, 0.41)
    owner = np.repeat(np.arange(len(lens)), lens)
    sees = (owner == owner[bad]) & (np.abs(np.arange(t) - bad) < (window or t))
    others = torch.from_numpy(~sees)
    assert torch.isfinite(poisoned[others]).all()
    torch.testing.assert_close(poisoned[others], out[others], rtol=0, atol=0)
    assert not torch.isfinite(poisoned[torch.from_numpy(sees)]).all(-1).all(-1).any()
