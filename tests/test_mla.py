"""MLA in latent space (`mla.py`) against the dense expanded MLA reference, and d_k != d_v on every path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SMALL_TILES, SPECS, Step, assert_matches, make_block_table
from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.mla import absorb_query, expand_output, latent_views, mla_attention
from vllm_gaudi_unified.reference import reference_attention, reference_mla

#: Small MLA shapes: latent L, rope R, per-head nope P and value V, query heads H.
L, R, P, V, H = 16, 8, 12, 10, 4
MODES = {"default": SMALL_TILES, "gather": PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8,
                                                        unique_layout="gather"),
         "invariant": PlanOptions(batch_invariant=True, invariant_rows=2, invariant_chunk=3,
                                  invariant_causal_chunk=2, causal_tile=4)}
STEPS = ["seed", "decode", "prefill", "chunked_prefill", "prefix_caching", "parallel_sampling", "ragged_partial",
         "long_causal"]


def mla_tensors(step: Step, dtype=torch.float64, seed=0, poison=True):
    """A step's random MLA inputs: (block table, num_blocks, q_nope, q_pe, W_UK, W_UV, new latents, latent
    cache), with NaN in every cache slot no request may read when `poison`."""
    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
    t, bs = sum(step.query_lens), step.block_size
    q_nope, q_pe = rand(t, H, P), rand(t, H, R)
    w_uk, w_uv = rand(H, P, L, s=0.3), rand(H, L, V, s=0.3)
    latent, cache = rand(t, L + R), rand(num_blocks, bs, L + R)
    if poison:  # every slot no request may read
        readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
        for r, c in enumerate(step.context_lens):
            for pos in range(c):
                readable[table[r, pos // bs], pos % bs] = True
        cache[~readable] = float("nan")
    return table, num_blocks, q_nope, q_pe, w_uk, w_uv, latent, cache


def mla_case(step: Step, dtype=torch.float64, options=SMALL_TILES, seed=0, bucket=None, poison=True):
    """-> (latent-space output expanded through W_UV, the dense expanded reference, batch, tensors)."""
    table, num_blocks, q_nope, q_pe, w_uk, w_uv, latent, cache = mla_tensors(step, dtype, seed, poison)
    bs = step.block_size
    batch = build_unified_batch(step.query_lens, step.context_lens, table, bs, num_blocks=num_blocks,
                                options=options, bucket=bucket)
    scale = (P + R) ** -0.5
    query = absorb_query(q_nope, q_pe, w_uk)
    out = expand_output(mla_attention(query, latent, cache, batch, scale, L).double(), w_uv.double())
    ref = reference_mla(q_nope, q_pe, latent, cache, w_uk, w_uv, step.query_lens, step.context_lens, table, scale, L)
    return out, ref, batch, (query, latent, cache, table, scale)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", STEPS)
def test_latent_attention_equals_the_expanded_reference(name, mode):
    """Absorbing W_UK and attending to the latent equals per-head MLA over up-projected K/V (fp64, 1e-6)."""
    out, ref, _, _ = mla_case(SPECS[name], options=MODES[mode])
    assert_matches(out, ref)


@pytest.mark.parametrize("name", ["seed", "decode", "chunked_prefill", "prefix_caching"])
def test_bf16(name):
    """bf16 inputs, fp32 accumulation; compared in latent space (the output before W_UV) within 1e-2."""
    out, ref, batch, (query, latent, cache, table, scale) = mla_case(SPECS[name], dtype=torch.bfloat16)
    step = SPECS[name]
    k, v = latent_views(latent, L)
    kc, vc = latent_views(cache, L)
    lat = mla_attention(query, latent, cache, batch, scale, L)
    lat_ref = reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, scale)
    assert lat.dtype == torch.bfloat16 and lat.shape == (sum(step.query_lens), H, L)
    assert_matches(lat, lat_ref)


def test_keys_and_values_are_views_of_one_cache():
    cache = torch.randn(5, 4, L + R)
    k, v = latent_views(cache, L)
    assert k.shape == (5, 4, 1, L + R) and v.shape == (5, 4, 1, L)
    assert k.data_ptr() == v.data_ptr() == cache.data_ptr()


def test_padding_to_a_larger_bucket_changes_nothing():
    step = SPECS["seed"]
    out, _, batch, _ = mla_case(step)
    s, kb = batch.shape, SMALL_TILES.blocks_per_tile(step.block_size)
    prompts = (s.num_prompts + 1, s.prompt_len + 2, s.prompt_blocks + 1) if s.num_prompts else (0, 0, 0)
    big = Bucket("csu", s.query_len + 5, s.num_shared_blocks + kb, s.num_unique_blocks + 3, s.num_logits + 2,
                 s.num_causal_tiles + 2, *prompts)
    padded, ref, pbatch, _ = mla_case(step, bucket=big)
    assert pbatch.bucket == big
    assert_matches(padded, ref)
    # the prompt route's one SDPA call over a larger padded batch sums in another order (test_attention's bound)
    torch.testing.assert_close(padded, out, rtol=0, atol=1e-12)


def test_sinks_and_soft_cap_take_the_value_head_dim():
    step = SPECS["seed"]
    _, _, batch, (query, latent, cache, table, scale) = mla_case(step)
    sinks = torch.tensor([0.5, -1.0, float("-inf"), 2.0], dtype=torch.float64)
    out = mla_attention(query, latent, cache, batch, scale, L, sinks=sinks, logits_soft_cap=5.0)
    k, v = latent_views(latent, L)
    kc, vc = latent_views(cache, L)
    ref = reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, scale, sinks=sinks,
                              logits_soft_cap=5.0)
    assert_matches(out, ref)


@pytest.mark.parametrize("changes,match", [
    (dict(value_dim=L + R + 1), "value head_dim 25 must be in"),
    (dict(value_cache_dim=L - 1), r"value_cache shape \(.*15\) must be"),
])
def test_bad_value_dims_are_refused(changes, match):
    step = Step([2, 1], [3, 5], 4)
    table, nb = make_block_table(step, np.random.default_rng(0))
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb)
    dv = changes.get("value_dim", L)
    q, k, v = torch.randn(3, H, L + R), torch.randn(3, 1, L + R), torch.randn(3, 1, dv)
    kc, vc = torch.randn(nb, 4, 1, L + R), torch.randn(nb, 4, 1, changes.get("value_cache_dim", dv))
    with pytest.raises(ValueError, match=match):
        unified_attention(q, k, v, kc, vc, batch, 0.3)


def test_latent_dims_are_checked():
    with pytest.raises(ValueError, match="must exceed kv_lora_rank 24"):
        latent_views(torch.randn(3, L + R), L + R)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_steps_and_containment(data):
    """Ragged steps with chunked prompts over context and shared prefixes match the reference; a bad value in
    one readable latent slot reaches only the tokens that read it (bitwise elsewhere)."""
    n = data.draw(st.integers(1, 4))
    q = data.draw(st.lists(st.integers(1, 7), min_size=n, max_size=n))
    ctx = data.draw(st.lists(st.integers(0, 19), min_size=n, max_size=n))
    bs = data.draw(st.sampled_from([2, 4, 8]))
    groups = []
    if n >= 2 and min(ctx[:2]) >= bs and data.draw(st.booleans()):
        groups = [([0, 1], min(ctx[:2]) // bs)]
    step = Step(q, ctx, bs, prefix_groups=groups)
    mode = data.draw(st.sampled_from(sorted(MODES)))
    out, ref, batch, (query, latent, cache, table, scale) = mla_case(step, options=MODES[mode],
                                                                     seed=data.draw(st.integers(0, 99)))
    assert_matches(out, ref)
    readable = [(r, p) for r in range(n) for p in range(ctx[r])]
    if not readable:
        return
    r0, p0 = readable[data.draw(st.integers(0, len(readable) - 1))]
    blk, slot = int(table[r0, p0 // bs]), p0 % bs
    clean = mla_attention(query, latent, cache, batch, scale, L)
    cache[blk, slot, data.draw(st.integers(0, L + R - 1))] = float("nan")
    poisoned = mla_attention(query, latent, cache, batch, scale, L)
    starts = np.cumsum(q) - q
    sees = np.zeros(sum(q), bool)
    for r in range(n):
        if any(table[r, pos // bs] == blk and pos % bs == slot for pos in range(ctx[r])):
            sees[starts[r]:starts[r] + q[r]] = True
    others = torch.from_numpy(~sees)
    assert torch.isfinite(poisoned[others]).all()
    torch.testing.assert_close(poisoned[others], clean[others], rtol=0, atol=0)


def test_flash_dispatch_leaves_the_latent_to_the_tiles(monkeypatch):
    """Where flash would run (CUDA, 16-bit), a latent step (values narrower than keys: flash takes one head
    dim) still runs the matmul tiles: flash is never called, the result still matches."""
    from vllm_gaudi_unified import attention
    from vllm_gaudi_unified.paths import fused

    def no_flash(*args, **kwargs):
        raise AssertionError("flash called with d_k != d_v")

    monkeypatch.setattr(fused, "FLASH", no_flash)
    monkeypatch.setattr(attention, "kernel_for", lambda batch, q, cap: "flash")
    monkeypatch.setattr(attention, "kernel_unique_applies", lambda kc, vc: False)
    for name in ("seed", "chunked_prefill", "decode"):
        out, ref, _, _ = mla_case(SPECS[name])
        assert_matches(out, ref)
