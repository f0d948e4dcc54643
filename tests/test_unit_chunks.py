"""A verify step's units in chunks of a request's blocks (`paths/unit_chunks.py`: the torch route's form for units
of many rows per KV head), against the dense float64 reference: every verify shape of `test_verify`, chunks of
one to several blocks (a request's last chunk partly empty, chunks of no request), both unique layouts."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import Step, assert_matches, make_block_table, make_tensors, record_calls, run_case
from hypothesis import given, settings
from hypothesis import strategies as st
import test_verify
from test_verify import UNITS, VERIFY, draw_verify_step

from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.paths import fused, unit_chunks


@pytest.fixture
def chunks(monkeypatch):
    """Every unit of several tokens on the chunks (the tests' heads are few); `chunks(keys)` sets the chunk's keys."""
    monkeypatch.setattr(unit_chunks, "UNIT_CHUNK_MIN_ROWS", 1)
    calls = record_calls(monkeypatch, unit_chunks, "chunked_units_partial")
    return lambda keys: monkeypatch.setattr(unit_chunks, "UNIT_CHUNK_KEYS", keys) or calls


@pytest.mark.parametrize("name", sorted(VERIFY))
@pytest.mark.parametrize("layout", ["slice", "gather"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("keys", [4, 12, 64])
def test_chunked_units_match_reference(chunks, name, layout, dtype, keys):
    calls = chunks(keys)  # block size 4: chunks of 1, 3 and 16 blocks
    step, phase = VERIFY[name]
    with fused.gaudi_route():
        out, ref, batch = run_case(step, dtype=dtype, options=replace(UNITS, unique_layout=layout))
    assert batch.phase == phase and batch.plan.unique_units == 4 and calls
    assert_matches(out, ref)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_chunked_verify_steps(data):
    """Ragged drafts, partial blocks, GQA/MQA, shuffled tables, NaN in unreadable slots, chunks of 1 to 8 blocks."""
    step, opts = draw_verify_step(data)
    saved = unit_chunks.UNIT_CHUNK_MIN_ROWS, unit_chunks.UNIT_CHUNK_KEYS
    unit_chunks.UNIT_CHUNK_MIN_ROWS, unit_chunks.UNIT_CHUNK_KEYS = 1, data.draw(st.sampled_from([2, 8, 16]))
    try:
        with fused.gaudi_route():
            out, ref, _ = run_case(step, options=opts, seed=data.draw(st.integers(0, 99)))
    finally:
        unit_chunks.UNIT_CHUNK_MIN_ROWS, unit_chunks.UNIT_CHUNK_KEYS = saved
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("extra", ["soft_cap", "sinks", "padded"])
def test_chunked_units_with_a_soft_cap_sinks_fp16_and_padding(chunks, dtype, extra):
    calls = chunks(8)
    kw = {"soft_cap": {"logits_soft_cap": 2.5}, "sinks": {"sinks": torch.linspace(-1, 2, 8, dtype=dtype)},
          "padded": {}}[extra]
    step = VERIFY["gqa"][0]
    if extra == "padded":  # more slots, tokens and requests than the step: chunks and rows of no request
        with fused.gaudi_route():
            s = run_case(step, options=UNITS)[2].shape
        kw["bucket"] = replace(s, query_len=s.query_len + 5, num_unique_blocks=s.num_unique_blocks + 7,
                               num_logits=s.num_logits + 2)
    with fused.gaudi_route():
        out, ref, batch = run_case(step, dtype=dtype, options=UNITS, **kw)
    assert batch.plan.unique_units == 4 and calls
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_bad_cached_value_stays_with_its_requests_chunk(chunks, dtype):
    """A NaN in a cached value one request sees reaches that request's tokens, for the query heads of that
    KV head alone; NaN in slots no request may read reaches nothing (`test_verify`'s case, on the chunks)."""
    calls = chunks(8)
    test_verify.test_a_bad_cached_value_stays_with_its_requests_unit(dtype)
    assert calls


def test_padded_bucket_and_decode_step_on_chunks(chunks):
    """`test_verify`'s padded verify bucket and decode step in a verify bucket, on the chunks: padding slots,
    tokens and requests, units of one real token."""
    calls = chunks(8)
    with fused.gaudi_route():
        test_verify.test_padded_bucket_and_decode_step()
    assert len(calls) == 3  # (the unpadded step first, for its shape)


def test_which_units_take_the_chunks():
    """Units of at least `UNIT_CHUNK_MIN_ROWS` rows per KV head (8 tokens x 4 query heads per KV head: a verify
    step of 1 + 7 at Llama's heads), never one-token units (decodes)."""
    q, kc = torch.zeros(1, 32, 8), torch.zeros(1, 4, 8, 8)
    unit = lambda u: type("B", (), {"plan": type("P", (), {"unique_units": u})})  # noqa: E731
    assert unit_chunks.unit_chunks_apply(q, kc, unit(8)) and unit_chunks.unit_chunks_apply(q, kc, unit(4))
    assert not unit_chunks.unit_chunks_apply(q, kc, unit(1)) and not unit_chunks.unit_chunks_apply(q, kc, unit(2))


@pytest.mark.parametrize("forms", [("per_slot_head", "float"), ("per_block", "per_channel"), ("tensor", "none")])
@pytest.mark.parametrize("layout", ["slice", "gather"])
def test_chunked_units_read_fp8(chunks, forms, layout):
    """An fp8 cache dequantized as the chunks gather it, each block with its own scales (NaN in dead blocks')."""
    from test_fp8_kv_cache import _fp8_case

    from vllm_gaudi_unified.reference import reference_attention

    calls = chunks(8)
    step = VERIFY["ragged"][0]
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, torch.float8_e4m3fn, *forms, seed=5)
    with fused.gaudi_route():
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                    options=replace(UNITS, unique_layout=layout))
        out = unified_attention(q, k, v, kq, vq, batch, 0.37, k_scale=ks, v_scale=vs)
    assert calls
    assert_matches(out, reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.37))


def test_compiled_chunks_serve_every_verify_step_of_a_bucket(chunks):
    """Compiled per bucket (`graphs.compiled_attention`, what an HPU graph holds): two verify steps of other
    drafts and contexts padded to one bucket run one compiled function, each matching the reference."""
    from vllm_gaudi_unified.graphs import clear, compiled_attention
    from vllm_gaudi_unified.reference import reference_attention

    calls = chunks(8)
    steps = [Step([4, 2, 3], [13, 30, 9], 4, num_blocks=40), Step([1, 4], [22, 5], 4, num_blocks=40)]
    first = make_block_table(steps[0], np.random.default_rng(0))[0]
    with fused.gaudi_route():
        s = build_unified_batch(steps[0].query_lens, steps[0].context_lens, first, 4, options=UNITS).shape
        bucket = replace(s, query_len=s.query_len + 2, num_unique_blocks=s.num_unique_blocks + 4)
        clear()
        try:
            for i, step in enumerate(steps):
                table, nb = make_block_table(step, np.random.default_rng(i))
                q, k, v, kc, vc = make_tensors(step, table, nb, seed=i)
                batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb,
                                            options=UNITS, bucket=bucket)
                ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
                assert_matches(compiled_attention(q, k, v, kc, vc, batch, 0.37), ref)
        finally:
            clear()
    assert calls
