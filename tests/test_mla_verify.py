"""MLA verify steps on the bucket-shaped latent route (`paths/mla_chunks.py`, what an HPU and the Gaudi route run),
forced on the CPU: each request's unit read once by all its tokens x heads, the drafts' causal pairs taken by the
route (`paths/mla_drafts.py`) instead of the causal tiles, against the dense MLA reference (float64 1e-6, bf16
1e-2), with ragged drafts, partial blocks, shared prefixes, a prompt and a long chunk beside them, NaN in every
unreadable cache slot, padded buckets. The CUDA kernel's verify cases run in tests/mla_kernel_cases.py."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import Step, assert_matches, on_meta, record_calls
from test_mla import H, L, mla_case
from test_verify import UNITS, VERIFY
from vllm_gaudi_unified import Bucket, attention, plan_step
from vllm_gaudi_unified.mla import latent_views, mla_attention
from vllm_gaudi_unified.paths import mla_chunks
from vllm_gaudi_unified.reference import reference_attention


@pytest.fixture
def spy(monkeypatch):
    """The latent route as off the CPU ('chunks'), and each causal-tiles call, kept."""
    return {"routes": record_calls(monkeypatch, attention, "mla_unique_route", on_meta),
            "causal": record_calls(monkeypatch, attention, "causal_partial")}


@pytest.mark.parametrize("keys", [1, 8, 4096])  # chunks of one block .. whole contexts
@pytest.mark.parametrize("layout", ["slice", "gather"])
@pytest.mark.parametrize("name", sorted(VERIFY))
def test_verify_on_chunks_float64(name, layout, keys, spy, monkeypatch):
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", keys)
    out, ref, batch, _ = mla_case(VERIFY[name][0], options=replace(UNITS, unique_layout=layout))
    assert batch.plan.drafts_in_units and batch.plan.unique_units == 4
    assert spy["routes"] == ["chunks"] and not spy["causal"]  # (the drafts' pairs on the route)
    assert_matches(out, ref)


@pytest.mark.parametrize("name", ["ragged", "sampling", "mixed"])
def test_verify_on_chunks_bf16(name, spy):
    """bf16 in latent space against the reference over the same bf16 latents (1e-2)."""
    step = VERIFY[name][0]
    _, _, batch, (query, latent, cache, table, scale) = mla_case(step, dtype=torch.bfloat16, options=UNITS)
    lat = mla_attention(query, latent, cache, batch, scale, L)
    assert lat.dtype == torch.bfloat16 and lat.shape == (sum(step.query_lens), H, L)
    k, v = latent_views(latent, L)
    kc, vc = latent_views(cache, L)
    assert_matches(lat, reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, scale))
    assert set(spy["routes"]) == {"chunks"} and not spy["causal"]


def test_padded_bucket_and_a_decode_step(spy):
    """A verify step in a larger bucket (padding tokens, slots, causal tiles), and a decode step padded into a
    verify bucket: the padding rows stay out of every unit."""
    step, units = VERIFY["ragged"][0], replace(UNITS, unique_layout="gather")
    s = mla_case(step, options=units)[2].shape
    big = Bucket("c-u", s.query_len + 5, 0, s.num_unique_blocks + 7, s.num_logits + 2, s.num_causal_tiles + 3)
    out, ref, batch, _ = mla_case(step, options=units, bucket=big)
    assert batch.bucket == big and batch.plan.drafts_in_units
    assert_matches(out, ref)
    dec = Step([1] * 4, [5, 17, 1, 32], 8)
    d = mla_case(dec, options=units)[2].shape
    out, ref, batch, _ = mla_case(dec, options=units, bucket=Bucket("c-u", 8, 0, d.num_unique_blocks + 3, 4, 2))
    assert batch.plan.unique_units == 4 and batch.plan.drafts_in_units
    assert_matches(out, ref)
    assert not spy["causal"]


def test_long_chunks_off_the_prompt_route_keep_the_causal_tiles(spy):
    """With the prompt route off, a chunk longer than a unit has causal pairs no unit holds: the step is no
    verify step for the route (`drafts_in_units` False), the tiles take every causal pair."""
    out, ref, batch, _ = mla_case(VERIFY["mixed"][0], options=replace(UNITS, prompt_route="tiles"))
    assert not batch.plan.drafts_in_units and len(spy["causal"]) == 1
    assert_matches(out, ref)


def test_drafts_in_units_follows_the_requests_off_the_prompt_route():
    q, c = [4, 2, 1], [13, 30, 9]
    table = np.arange(1, 22).reshape(3, 7)
    assert plan_step(q, c, table, 8, options=UNITS).drafts_in_units
    assert not plan_step(q, c, table, 8).drafts_in_units  # (no units: one token a slot)
    assert not plan_step(q, c, table, 8, options=UNITS, sliding_window=16).drafts_in_units
    assert not plan_step([6, 2, 1], c, table, 8, options=replace(UNITS, prompt_route="tiles")).drafts_in_units
    assert plan_step([6, 2, 1], [0, 30, 9], table, 8, options=UNITS).drafts_in_units  # (the 6: the prompt route)


@pytest.mark.parametrize("name", ["ragged", "sampling"])
def test_chunks_with_broadcast_adds(name, spy, monkeypatch):
    """The chunks' mask and shift as broadcast adds (`MLA_CHUNK_RANK1` off) give the same rows (float64)."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_RANK1", False)
    out, ref, _, _ = mla_case(VERIFY[name][0], options=UNITS)
    assert_matches(out, ref)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_random_verify_steps_on_chunks(data):
    """Ragged drafts (0..k per request), partial blocks, chunk sizes, layouts, NaN in unreadable slots (float64)."""
    k = data.draw(st.integers(1, 4))
    r = data.draw(st.integers(1, 5))
    q = data.draw(st.lists(st.integers(1, k + 1), min_size=r, max_size=r))
    c = data.draw(st.lists(st.integers(1, 30), min_size=r, max_size=r))
    opts = replace(UNITS, unique_tokens=k + 1, unique_layout=data.draw(st.sampled_from(["slice", "gather"])))
    real_route, keys = attention.mla_unique_route, mla_chunks.MLA_CHUNK_KEYS
    try:
        attention.mla_unique_route = lambda batch, query, *args: real_route(batch, query.to("meta"), *args)
        mla_chunks.MLA_CHUNK_KEYS = data.draw(st.sampled_from([1, 8, 64]))
        out, ref, batch, _ = mla_case(Step(q, c, data.draw(st.sampled_from([2, 4, 8]))), options=opts,
                                      seed=data.draw(st.integers(0, 99)))
    finally:
        attention.mla_unique_route, mla_chunks.MLA_CHUNK_KEYS = real_route, keys
    assert_matches(out, ref)


_GRAPH_RULE = '''
import sys
from dataclasses import replace
from types import SimpleNamespace
import numpy as np
import habana_standin
habana_standin.install()
from vllm_gaudi_unified import PlanOptions, build_unified_batch
from vllm_gaudi_unified.vllm_plugin.hpu_warmup import UnifiedWarmup
units, table = PlanOptions(unique_tokens=4), np.arange(1, 22).reshape(3, 7)
verify = build_unified_batch([4, 2, 1], [13, 30, 9], table, 8, options=units)
mixed = build_unified_batch([6, 2, 1], [13, 30, 9], table, 8, options=replace(units, prompt_route="tiles"))
assert verify.plan.drafts_in_units and not mixed.plan.drafts_in_units and mixed.plan.unique_units == 4
def graphs(batch, mla):
    r = UnifiedWarmup()
    r.model_config = SimpleNamespace(enforce_eager=False, use_mla=mla)
    r.unified_warmed = {verify.bucket, mixed.bucket}
    return r._use_unified_graphs({"layer": SimpleNamespace(batch=batch)})
print(graphs(verify, True), graphs(mixed, True), graphs(mixed, False))
'''


def test_hpu_graphs_skip_latent_steps_without_drafts_on_their_units():
    """A warmed bucket's HPU graph may hold MLA's verify path (drafts on the units); a step of the same bucket
    whose long chunk needs the causal tiles runs eagerly on an MLA model, and replays the graph otherwise
    (vllm-gaudi imported over tests/habana_standin.py, in a process of its own)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-c", _GRAPH_RULE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-3:] == ["True", "False", "True"]
