"""MLA over an fp8 latent cache (vllm-gaudi's `fp8_inc`: e4m3, one per-tensor scale) on every latent route.

Keys and values are the same stored bytes, so the latent routes (`paths/mla_chunks.py`, the CPU's dense
decodes and `paths/mla_shared.py` in `paths/mla_decode.py`'s choice, and the expanded prompts of
`mla_prompts.py`) dequantize each gathered latent once with its one scale (`kv_quant.read_blocks`). The
reference is the dense expanded MLA reference over the dequantized cache (float64, exact), the new latents
as stored: float64 within 1e-6, bf16 within 1e-2. Unreadable slots hold NaN bytes. Scales that are not one
per-tensor value (per block, or different for keys and values) leave the latent routes to the generic tiles.
"""
from __future__ import annotations

import pytest
import torch

from conftest import SMALL_TILES, SPECS, assert_matches, on_meta, record_calls
from test_mla import MODES, L, P, R, mla_tensors
from test_mla_prompts import SUFFIX, kv_b_weight
from vllm_gaudi_unified import attention, build_unified_batch, unified_attention
from vllm_gaudi_unified.mla import absorb_query, expand_output, latent_views, mla_attention
from vllm_gaudi_unified.mla_prompts import mla_prompt_rows
from vllm_gaudi_unified.paths.kv_quant import dequantize, one_tensor_scale, quantize
from vllm_gaudi_unified.reference import reference_attention, reference_mla

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALES = {"none": None, "float": 0.05, "tensor": torch.tensor([0.03])}
STEPS = ("seed", "decode", "chunked_prefill", "prefix_caching", "parallel_sampling", "ragged_partial")


@pytest.fixture
def routes(monkeypatch):
    """The unique route each call took (`mla_unique_route`), and the shared tiles' latent route's calls;
    `off_cpu()` makes the route what it is off the CPU ('chunks', an HPU's)."""
    taken = {"off_cpu": False}
    taken["unique"] = record_calls(monkeypatch, attention, "mla_unique_route",
                                   lambda args: on_meta(args) if taken["off_cpu"] else args)
    taken["shared"] = record_calls(monkeypatch, attention, "latent_shared_partial")
    return taken


def fp8_mla_case(step, fp8, kv_scale, dtype=torch.float64, options=SMALL_TILES, seed=0):
    """-> (latent output expanded through W_UV, the reference over the dequantized cache, batch). `fp8` None:
    the cache unquantized."""
    table, num_blocks, q_nope, q_pe, w_uk, w_uv, latent, cache = mla_tensors(step, torch.float64, seed)
    if fp8 is None:  # (the same step over the unquantized cache)
        stored, new = cache, latent
    else:
        stored = quantize(cache, fp8, 1.0 if kv_scale is None else kv_scale)  # NaN slots stay NaN bytes
        new = dequantize(quantize(latent, fp8, 1.0 if kv_scale is None else kv_scale), kv_scale)  # as stored
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=num_blocks,
                                options=options)
    scale = (P + R) ** -0.5
    query = absorb_query(q_nope, q_pe, w_uk).to(dtype)
    out = expand_output(mla_attention(query, new.to(dtype), stored, batch, scale, L, kv_scale=kv_scale).double(),
                        w_uv)
    ref = reference_mla(q_nope, q_pe, new, dequantize(stored, kv_scale), w_uk, w_uv, step.query_lens,
                        step.context_lens, table, scale, L)
    return out, ref, batch


@pytest.mark.parametrize("off_cpu", [False, True], ids=["cpu", "off_cpu"])
@pytest.mark.parametrize("form", sorted(SCALES))
@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("name", STEPS)
def test_latent_routes_read_the_fp8_cache(name, fmt, form, off_cpu, routes):
    """float64, 1e-6: every latent route over the quantized cache, each taken where it applies."""
    routes["off_cpu"] = off_cpu
    out, ref, batch = fp8_mla_case(SPECS[name], FP8[fmt], SCALES[form])
    assert_matches(out, ref)
    if "u" in batch.phase:  # the route an unquantized cache takes (off the CPU: 'chunks')
        fp8_route = list(routes["unique"])
        routes["unique"].clear()
        fp8_mla_case(SPECS[name], None, None)
        assert fp8_route == routes["unique"] and (fp8_route == ["chunks"] or not off_cpu)
    assert len(routes["shared"]) == (1 if "s" in batch.phase else 0) * (2 if "u" in batch.phase else 1)


@pytest.mark.parametrize("mode", ["gather", "invariant"])
def test_other_plan_modes(mode, routes):
    """The gather layout and the batch-invariant mode over the same cache (their own routes)."""
    for name in ("prefix_caching", "decode"):
        assert_matches(*fp8_mla_case(SPECS[name], torch.float8_e4m3fn, 0.05, options=MODES[mode])[:2])


@pytest.mark.parametrize("name", STEPS)
def test_bf16(name, routes):
    """bf16 queries and latents over the e4m3 cache, off the CPU's route too: 1e-2."""
    for off_cpu in (False, True):
        routes["off_cpu"] = off_cpu
        out, ref, _ = fp8_mla_case(SPECS[name], torch.float8_e4m3fn, 0.05, dtype=torch.bfloat16)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("k_scale,v_scale", [(0.05, 0.06), (torch.full((1,), 0.05), torch.full((1,), 0.05)),
                                             ("per_block", "per_block")], ids=["two", "two_tensors", "per_block"])
@pytest.mark.parametrize("name", ["decode", "prefix_caching"])
def test_scales_not_one_per_tensor_value_take_the_generic_paths(name, k_scale, v_scale, routes):
    """The same latent bytes read with two scales (or two tensor objects: whether they are equal would take
    a device sync), or per-block scales: no latent route (each dequantizes once, with one scale); the
    generic paths read keys and values apart, exact against the reference over those dequantized caches."""
    step = SPECS[name]
    table, num_blocks, q_nope, q_pe, w_uk, _, latent, cache = mla_tensors(step, torch.float64)
    if k_scale == "per_block":
        k_scale = v_scale = torch.full((num_blocks, 1, 1, 1), 0.05, dtype=torch.float64)
    stored = quantize(cache, torch.float8_e4m3fn, 0.05)
    (key, value), (key_cache, value_cache) = latent_views(latent, L), latent_views(stored, L)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=SMALL_TILES)
    query = absorb_query(q_nope, q_pe, w_uk)
    out = unified_attention(query, key, value, key_cache, value_cache, batch, 0.3, k_scale=k_scale, v_scale=v_scale)
    ref = reference_attention(query, key, value, dequantize(key_cache, k_scale), dequantize(value_cache, v_scale),
                              step.query_lens, step.context_lens, table, 0.3)
    assert_matches(out, ref)
    assert routes["unique"] == [None] and not routes["shared"]


@pytest.mark.parametrize("form", ["float", "tensor"])
@pytest.mark.parametrize("name", ["chunked_prefill", "suffix"])
def test_expanded_prompts_read_the_fp8_cache(name, form):
    """The prompt route's rows in the expanded form (context latents through `kv_b_proj`) over the e4m3 cache:
    float64 1e-6 against the reference over the dequantized cache."""
    step, kv_scale = {"chunked_prefill": SPECS["chunked_prefill"], "suffix": SUFFIX}[name], SCALES[form]
    table, num_blocks, q_nope, q_pe, w_uk, w_uv, latent, cache = mla_tensors(step, torch.float64)
    stored = quantize(cache, torch.float8_e4m3fn, kv_scale)
    new = dequantize(quantize(latent, torch.float8_e4m3fn, kv_scale), kv_scale)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=SMALL_TILES)
    rows = batch.prompt_rows.reshape(-1)
    rows = rows[rows < batch.num_tokens]
    assert rows.numel() and batch.shape.prompt_blocks  # prompts over cached context run expanded
    scale = (P + R) ** -0.5
    weight = kv_b_weight(w_uk, w_uv)
    out = mla_prompt_rows(torch.cat([q_nope, q_pe], -1), new, stored, batch, scale, L, lambda c: c @ weight.T,
                          kv_scale=kv_scale)
    ref = reference_mla(q_nope, q_pe, new, dequantize(stored, kv_scale), w_uk, w_uv, step.query_lens,
                        step.context_lens, table, scale, L)
    assert_matches(out[rows], ref[rows])


def test_a_bad_latent_reaches_only_the_tokens_that_read_it(routes):
    """A NaN byte in one request's cached latent (e4m3 has NaN) shows in that request's rows alone."""
    step = SPECS["decode"]
    table, num_blocks, q_nope, q_pe, w_uk, _, latent, cache = mla_tensors(step, torch.float64)
    stored = quantize(cache, torch.float8_e4m3fn, 0.05)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size)
    query = absorb_query(q_nope, q_pe, w_uk)
    for off_cpu in (False, True):
        routes["off_cpu"] = off_cpu
        clean = mla_attention(query, latent, stored, batch, 0.3, L, kv_scale=0.05)
        bad = stored.clone()
        bad.view(torch.uint8)[int(table[1, 0]), 0, 3] = 0x7F  # e4m3fn NaN in request 1's first cached latent
        poisoned = mla_attention(query, latent, bad, batch, 0.3, L, kv_scale=0.05)
        others = [r for r in range(len(step.query_lens)) if r != 1]
        assert torch.isnan(poisoned[1]).all()
        torch.testing.assert_close(poisoned[others], clean[others], rtol=0, atol=0)


def test_one_tensor_scale_is_decided_on_the_host():
    """`kv_quant.one_tensor_scale`: one per-tensor scale for keys and values, told from host facts alone (no
    tensor comparison, no device sync): the same object, or equal Python numbers."""
    t = torch.tensor([0.5])
    assert one_tensor_scale(None, None) and one_tensor_scale(0.5, 0.5) and one_tensor_scale(t, t)
    assert not one_tensor_scale(0.5, 0.25) and not one_tensor_scale(0.5, None) and not one_tensor_scale(None, t)
    assert not one_tensor_scale(0.5, t) and not one_tensor_scale(t, 0.5) and not one_tensor_scale(t, t.clone())
    per_block = torch.ones(3, 1, 1, 1)
    assert not one_tensor_scale(per_block, per_block)
