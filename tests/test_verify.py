"""Speculative verify steps (each request: its last token plus a few drafts over its cached context) on the
unique path's per-request units: a block only one request reads is read once for all its new tokens
(`PlanOptions.unique_tokens`), against the dense float64 reference."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import SMALL_TILES, Step, assert_matches, run_case
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_gaudi_unified import plan_step
from vllm_gaudi_unified.bucket import Bucket

UNITS = replace(SMALL_TILES, unique_tokens=4)

#: name -> (step, the phase with UNITS: verify requests on the unique units, shared blocks on the tiles)
VERIFY = {
    "uniform": (Step([4, 4, 4], [13, 30, 9], 4), "c-u"),
    "ragged": (Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8), "c-u"),
    "gqa": (Step([2, 4, 1], [6, 11, 3], 4, num_qo_heads=8, num_kv_heads=2), "c-u"),
    "mqa": (Step([3, 4, 2], [6, 11, 17], 4, num_qo_heads=6, num_kv_heads=1), "c-u"),
    # parallel sampling with drafts: the common prefix on the shared tiles, each sample's own blocks on its units
    "sampling": (Step([4, 2, 3, 4], [13, 13, 14, 13], 4, prefix_groups=[([0, 1, 2, 3], 3)]), "csu"),
    # a prompt and a long chunk (more new tokens than a unit holds) beside verify requests and decodes
    "mixed": (Step([9, 3, 1, 4, 12], [0, 21, 9, 5, 16], 4), "c-u"),
}


@pytest.mark.parametrize("name", sorted(VERIFY))
@pytest.mark.parametrize("layout", ["slice", "gather"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_verify_units_match_reference(name, layout, dtype):
    step, phase = VERIFY[name]
    out, ref, batch = run_case(step, dtype=dtype, options=replace(UNITS, unique_layout=layout))
    assert batch.phase == phase and batch.plan.unique_units == 4
    assert_matches(out, ref)


def test_a_verify_request_reads_each_block_once():
    """Its blocks are unique slots (one per block, its first token the row), not shared tiles: the slots
    hold exactly the step's context blocks, and the pairs needed count every new token's keys."""
    step = Step([4, 2, 3], [30, 17, 9], 4)
    q, c = np.array(step.query_lens), np.array(step.context_lens)
    nb = -(-(q + c) // 4)
    table = np.arange(1, nb.sum() + 1)[np.minimum(np.arange(nb.max())[None] + (np.cumsum(nb) - nb)[:, None],
                                                  nb.sum() - 1)]
    plan = plan_step(q, c, table, 4, options=replace(UNITS, unique_layout="gather"))
    assert plan.shape.num_shared_blocks == 0 and plan.shape.num_prompts == 0
    assert plan.shape.num_unique_blocks == int((-(-c // 4)).sum())
    starts = np.cumsum(q) - q
    assert sorted(set(plan.unique_rows.tolist())) == sorted(starts.tolist())
    assert plan.work_needed.unique == int(np.dot(q, c))
    plain = plan_step(q, c, table, 4, options=replace(SMALL_TILES, unique_layout="gather"))
    assert plain.shape.num_unique_blocks == 0  # one token per block: every block on the shared or prompt route


@pytest.mark.parametrize("window", [3, 7, 40])
def test_a_window_keeps_per_token_blocks(window):
    """With a sliding window each draft sees a different first key: the step keeps one row per block."""
    step, _ = VERIFY["ragged"]
    out, ref, batch = run_case(step, options=UNITS, sliding_window=window)
    assert batch.plan.unique_units == 1
    assert_matches(out, ref)


def test_padded_bucket_and_decode_step():
    """A verify step in a larger bucket (padding slots, tokens and causal tiles), and a decode step in a
    verify bucket: the units' padding rows are dropped."""
    step, _ = VERIFY["ragged"]
    units = replace(UNITS, unique_layout="gather")
    s = run_case(step, options=units)[2].shape
    big = Bucket("c-u", s.query_len + 5, 0, s.num_unique_blocks + 7, s.num_logits + 2, s.num_causal_tiles + 3)
    out, ref, batch = run_case(step, options=units, bucket=big)
    assert batch.bucket == big
    assert_matches(out, ref)
    dec = Step([1] * 4, [5, 17, 1, 32], 8)
    d = run_case(dec, options=units)[2].shape
    out, ref, batch = run_case(dec, options=units, bucket=Bucket("c-u", 8, 0, d.num_unique_blocks + 3, 4, 2))
    assert batch.plan.unique_units == 4
    assert_matches(out, ref)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_verify_steps(data):
    """Ragged drafts (0..k per request), partial blocks, GQA/MQA, shuffled tables, NaN in unreadable slots."""
    k = data.draw(st.integers(1, 7))
    r = data.draw(st.integers(1, 6))
    q = data.draw(st.lists(st.integers(1, k + 1), min_size=r, max_size=r))
    c = data.draw(st.lists(st.integers(0, 40), min_size=r, max_size=r))
    hkv = data.draw(st.sampled_from([1, 2]))
    step = Step(q, c, data.draw(st.sampled_from([2, 4, 8])), num_qo_heads=hkv * data.draw(st.sampled_from([1, 3])),
                num_kv_heads=hkv)
    opts = replace(SMALL_TILES, unique_tokens=k + 1, unique_layout=data.draw(st.sampled_from(["slice", "gather"])))
    out, ref, _ = run_case(step, options=opts, seed=data.draw(st.integers(0, 99)))
    assert_matches(out, ref)


@pytest.mark.parametrize("name", ["uniform", "ragged", "sampling"])
@pytest.mark.parametrize("gaudi", [False, True])
def test_mla_verify_steps(name, gaudi):
    """MLA (one latent KV head, values the first dims of the keys): a verify step's units on the latent routes,
    on the CPU and on the Gaudi route's bucket-shaped chunks, against the expanded reference (float64)."""
    from contextlib import nullcontext

    from test_mla import mla_case

    from vllm_gaudi_unified.paths import fused

    with fused.gaudi_route() if gaudi else nullcontext():
        out, ref, batch, _ = mla_case(VERIFY[name][0], options=UNITS)
    assert batch.plan.unique_units == 4
    assert_matches(out, ref)


def test_units_take_the_requests_new_pairs(monkeypatch):
    """On the matmul tiles a verify step runs no self or causal path: each request's new pairs are one tile
    beside its units (`units.request_pairs`); a step with a prompt-route row keeps the causal tiles."""
    from vllm_gaudi_unified import attention

    ran = []
    for name in ("self_partial", "causal_partial"):
        inner = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _f=inner, _n=name, **kw: ran.append(_n) or _f(*a, **kw))
    for case in ("ragged", "gqa", "sampling"):
        out, ref, batch = run_case(VERIFY[case][0], options=UNITS)
        assert_matches(out, ref)
    assert ran == []
    out, ref, batch = run_case(VERIFY["mixed"][0], options=UNITS)
    assert batch.bucket.num_prompts > 0 and "causal_partial" in ran
    assert_matches(out, ref)


def test_a_bad_draft_value_stays_with_the_rows_that_see_it():
    """A NaN in one draft's value (an overflow upstream) reaches that token and the later ones of its
    request, never its earlier tokens or another request."""
    from conftest import make_block_table, make_tensors

    from vllm_gaudi_unified import build_unified_batch, unified_attention

    step = Step([4, 3, 4], [13, 9, 30], 4, num_qo_heads=4, num_kv_heads=2)
    table, nb = make_block_table(step, np.random.default_rng(3))
    q, k, v, kc, vc = make_tensors(step, table, nb, torch.float64, 3)
    v[5, 1, 0] = float("nan")  # request 1's second token (tokens 4..6)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb, options=UNITS)
    out = unified_attention(q, k, v, kc, vc, batch, 0.37)
    bad = torch.isnan(out).any(-1).any(-1)
    assert bad.tolist() == [False] * 5 + [True, True] + [False] * 4


def test_a_unit_bucket_sends_every_longer_request_to_the_prompt_route():
    """With units of several tokens a request of more new tokens takes the prompt route even when it is a
    short draft over a prefix another request reads (the units then hold every other request's new pairs);
    without units it stays on the shared tiles."""
    step = Step([6, 2, 3], [13, 13, 9], 4, prefix_groups=[([0, 1], 3)])
    out, ref, batch = run_case(step, options=UNITS)
    assert batch.plan.prompt_len.tolist() == [6]  # request 0; request 2's 3 tokens on its units
    assert_matches(out, ref)
    assert run_case(step, options=SMALL_TILES)[2].plan.prompt_len.tolist() == [3]  # request 2 alone


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_bad_cached_value_stays_with_its_requests_unit(dtype):
    """On the Gaudi route's units (`paths/units.py`: per KV head one product over a request's tokens),
    a NaN in a cached value one request sees reaches that request's tokens, for the query heads of that KV
    head alone; NaN in slots no request may read (`make_tensors`) reaches nothing."""
    from conftest import make_block_table, make_tensors

    from vllm_gaudi_unified import build_unified_batch, unified_attention
    from vllm_gaudi_unified.paths import fused

    step = Step([4, 3, 4], [13, 9, 30], 4, num_qo_heads=4, num_kv_heads=2)
    table, nb = make_block_table(step, np.random.default_rng(4))
    q, k, v, kc, vc = make_tensors(step, table, nb, dtype, 4)
    vc[int(table[1, 1]), 2, 1, 0] = float("nan")  # request 1's context slot 6, KV head 1
    with fused.gaudi_route():
        batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb, options=UNITS)
        out = unified_attention(q, k, v, kc, vc, batch, 0.37)
    assert batch.plan.unique_units == 4
    bad = torch.isnan(out).any(-1)  # [tokens, heads]
    want = torch.zeros_like(bad)
    want[4:7, 2:] = True
    assert torch.equal(bad, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("extra", ["alone", "soft_cap", "sinks"])
def test_units_with_a_soft_cap_sinks_and_fp16(dtype, extra):
    """A verify step on the matmul units: a soft cap applies before the softmax, sinks join the merged rows,
    fp16 products run in fp32."""
    kw = {"soft_cap": {"logits_soft_cap": 2.5}, "sinks": {"sinks": torch.linspace(-1, 2, 8, dtype=dtype)},
          "alone": {}}[extra]
    out, ref, batch = run_case(VERIFY["gqa"][0], dtype=dtype, options=UNITS, **kw)
    assert batch.plan.unique_units == 4
    assert_matches(out, ref)


@pytest.fixture(params=["fused", "heads_first", "tokens_first"])
def layout_rows(request, monkeypatch):
    """`units.units_partial` through the fused call (`FUSED`), then the matmul form with its scores head-major,
    then token-major, whatever the rows (`HEADS_FIRST_MIN_ROWS`)."""
    from vllm_gaudi_unified.paths import units

    monkeypatch.setattr(units, "FUSED", request.param == "fused")
    monkeypatch.setattr(units, "HEADS_FIRST_MIN_ROWS", 1 if request.param == "heads_first" else 10**9)
    return request.param


@pytest.mark.parametrize("name", sorted(VERIFY))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_verify_units_in_both_score_layouts(name, dtype, layout_rows):
    step, phase = VERIFY[name]
    out, ref, batch = run_case(step, dtype=dtype, options=UNITS)
    assert batch.phase == phase and batch.plan.unique_units == 4
    assert_matches(out, ref)


@pytest.mark.parametrize("masked", [[1, 0, 0], [0, 1, 1, 0], [1]])
def test_units_add_a_masked_slot_listed_twice_once(masked, layout_rows):
    """`units.units_partial`: a slot listed in `masked` more than once (the bucket's count is padded with slot 0)
    adds its rows once; a masked slot's unseen NaN value reaches no row; the same as the general tiles merged."""
    from vllm_gaudi_unified.merge import normalize, scatter_merge
    from vllm_gaudi_unified.paths.tiles import attend
    from vllm_gaudi_unified.paths.units import units_partial

    g = torch.Generator().manual_seed(3)
    n, hq, hkv, d, bs = 6, 4, 2, 8, 4
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(4, bs, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    k[1, 3], v[1, 3] = float("nan"), float("nan")  # slot 1 sees keys 0-1 only
    tokens = torch.tensor([[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]])
    real = torch.tensor([[True, True, True], [True, True, True], [True, True, False], [True, True, False]])
    mask = torch.ones(4, 1, bs, dtype=torch.bool)
    mask[1, 0, 2:] = False
    got = normalize(units_partial(q, k, v, tokens, real, mask, torch.tensor(masked), 0.4, None))
    want = attend(q[tokens], k, v, mask & real[:, :, None], 0.4, None)
    want = normalize(scatter_merge(want, torch.where(real, tokens, n).reshape(-1), n))
    torch.testing.assert_close(got[:5], want[:5], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # token 5 sees no key here


def test_a_unit_row_without_a_token_reaches_no_token(layout_rows):
    """`units.units_partial`: a unit's rows past its request's tokens see the slot's keys like its real rows
    (one mask per slot), and their rows, NaN from a NaN query here, go to the dropped rows only."""
    from vllm_gaudi_unified.merge import normalize
    from vllm_gaudi_unified.paths.units import units_partial

    g = torch.Generator().manual_seed(5)
    n, hq, hkv, d, bs = 6, 4, 2, 8, 4
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, bs, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    q[2] = float("nan")  # the query of the first unit's row without a token
    tokens = torch.tensor([[0, 1, 2], [3, 4, 5]])
    real = torch.tensor([[True, True, False], [True, True, True]])
    mask = torch.ones(2, 1, bs, dtype=torch.bool)
    mask[1, 0, 3:] = False
    got = normalize(units_partial(q, k, v, tokens, real, mask, torch.tensor([1]), 0.4, None))
    for t, slot in ((0, 0), (1, 0), (3, 1), (4, 1), (5, 1)):
        seen = mask[slot, 0]
        kk, vv = k[slot][seen].repeat_interleave(hq // hkv, 1), v[slot][seen].repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,khd->hk", q[t], kk) * 0.4
        want = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv)
        torch.testing.assert_close(got[t], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # token 2 has no row here


@pytest.mark.parametrize("name", ["ragged", "mqa", "sampling"])
def test_units_token_max_over_copies_is_the_one_scatters(name, layout_rows, monkeypatch):
    """`units.MAX_COPIES`: the units' row maxima scattered into copies of the tokens' max then reduced give the
    same output bits as one scatter (a max in any order), in the scatter form (`merge.DENSE_MAX_WORK` 0), whatever
    a unit's maxima (`MAX_COPIES_UNIT_ENTRIES`)."""
    from vllm_gaudi_unified import merge
    from vllm_gaudi_unified.paths import units

    monkeypatch.setattr(merge, "DENSE_MAX_WORK", 0)  # (`merge.dense_max`, which units asks too)
    monkeypatch.setattr(units, "MAX_COPIES_UNIT_ENTRIES", 10**9)
    outs, starts = [], []
    monkeypatch.setattr(units, "scatter_max", lambda m, i, s: starts.append(s.shape[0]) or merge.scatter_max(m, i, s))
    for copies in (1, 3, 8):
        monkeypatch.setattr(units, "MAX_COPIES", copies)
        starts.clear()
        out, ref, batch = run_case(VERIFY[name][0], dtype=torch.float64, options=UNITS)
        assert batch.plan.unique_units == 4
        assert_matches(out, ref)
        outs.append(out)
        width = width if copies > 1 else max(starts)
        assert max(starts) == copies * width  # the units' rows scattered into the copies
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
