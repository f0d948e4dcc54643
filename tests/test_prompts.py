"""The prompt route: a request's new tokens over its own context as one padded fused call.

Checked against the float64 dense reference (1e-6) and in bf16 (1e-2), in both forms (rows final
from one SDPA call; a Partial through the matmul tiles under a soft cap, sinks or fused kernels
off), on ragged chunks, partial last blocks, shuffled block tables, caches whose unreadable slots
hold NaN/inf, GQA and MQA, padded buckets; and the planner's choice of route by hand.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SMALL_TILES, TILES, Step, assert_matches, make_block_table, make_tensors, run_case
from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.bucket import with_prompts
from vllm_gaudi_unified.plan import pad_plan, plan_step
from vllm_gaudi_unified.paths import prompts as prompt_paths
from vllm_gaudi_unified.reference import reference_attention


@pytest.fixture(autouse=True)
def _split_whatever_the_grid(monkeypatch):
    """The split form on these small grids too (by default it starts at `SPLIT_MIN_PAIRS`): tests of the
    one call set `SPLIT_CONTEXT` False, `test_the_split_form_starts_at_its_grid_size` the default."""
    monkeypatch.setattr(prompt_paths, "SPLIT_CONTEXT", True)

UNFUSED = replace(SMALL_TILES, fused_kernels=False)  # the Partial form through the matmul tiles


def test_a_chunk_over_its_own_context_is_one_prompt_row_with_its_blocks():
    table = np.array([[9, 2, 7, 4], [5, 6, 0, 0], [8, 0, 0, 0]])
    plan = plan_step([3, 1, 2], [14, 5, 0], table, 4)
    assert plan.shape.prompts == (2, 3, 4) and plan.shape.phase == "--u"  # the decode keeps its unique blocks
    assert plan.prompt_rows.tolist() == [[0, 1, 2], [4, 5, 6]]  # 6 = no row (the step has 6 tokens)
    assert plan.prompt_blocks.tolist() == [[9, 2, 7, 4], [0, 0, 0, 0]]
    assert plan.prompt_ctx.tolist() == [14, 0] and plan.prompt_len.tolist() == [3, 2]
    assert plan.shape.num_causal_tiles == 0 and plan.shape.num_shared_blocks == 0
    assert plan.work_needed.total == plan_step([3, 1, 2], [14, 5, 0], table, 4,
                                               options=PlanOptions(prompt_route="tiles")).work_needed.total


def test_short_drafts_over_a_common_prefix_keep_the_shared_tiles_long_chunks_do_not():
    table = np.array([[1, 2, 3], [1, 2, 4]])
    drafts = plan_step([4, 4], [9, 9], table, 4)  # speculative drafts over a common prefix: shared tiles
    assert drafts.shape.num_prompts == 0 and drafts.shape.phase[:2] == "cs"
    chunks = plan_step([40, 40], [9, 9], table, 4)  # long chunks: each its own call, the prefix read twice
    assert chunks.shape.prompts == (2, 40, 3) and chunks.shape.phase == "---"


def test_decodes_and_windows_do_not_take_the_prompt_route():
    assert plan_step([1, 1], [5, 9], np.array([[1, 2, 0], [3, 4, 5]]), 4).shape.num_prompts == 0
    assert plan_step([6, 1], [5, 9], np.array([[1, 2, 0], [3, 4, 5]]), 4, sliding_window=4).shape.num_prompts == 0


def test_a_one_token_prompt_joins_a_step_of_prompts():
    plan = plan_step([5, 1], [0, 0], np.zeros((2, 1), int), 4)
    assert plan.shape.prompts == (2, 5, 0) and plan.shape.phase == "---"


@pytest.mark.parametrize("options", [SMALL_TILES, UNFUSED], ids=["final", "partial"])
@pytest.mark.parametrize("spec", [
    Step([12, 5], [20, 9], 4),  # chunked prefill, partial last blocks
    Step([7, 16, 3, 1], [0, 0, 0, 0], 4),  # prompts without context
    Step([9, 1, 1, 30, 2], [7, 16, 33, 0, 5], 8, num_qo_heads=8, num_kv_heads=2),  # mixed, GQA
    Step([21, 1, 1, 6], [16, 18, 21, 16], 4, prefix_groups=[([0, 1, 2, 3], 4)], num_qo_heads=6, num_kv_heads=1),
    Step([20, 20], [8, 8], 4, prefix_groups=[([0, 1], 2)]),  # long chunks over a common prefix
], ids=["chunked", "prefill", "mixed-gqa", "prefix-mqa", "common-prefix"])
def test_matches_the_reference(spec, options):
    out, ref, batch = run_case(spec, options=options)
    assert batch.bucket.num_prompts > 0
    assert_matches(out, ref)


@pytest.mark.parametrize("kw", [dict(logits_soft_cap=3.0), dict(sinks=torch.tensor([0.5, -1.0, 2.0, float("-inf")],
                                                                                     dtype=torch.float64))],
                         ids=["soft_cap", "sinks"])
def test_soft_cap_and_sinks_take_the_partial_form(kw):
    out, ref, batch = run_case(Step([9, 1, 4], [6, 11, 0], 4), **kw)
    assert batch.bucket.num_prompts == 2
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("options", [SMALL_TILES, UNFUSED], ids=["final", "partial"])
def test_low_precision(dtype, options):
    out, ref, _ = run_case(Step([12, 1, 33], [20, 9, 17], 8, num_qo_heads=8, num_kv_heads=2), dtype=dtype,
                           options=options)
    assert_matches(out, ref)


def test_a_step_of_prompts_runs_one_call_and_no_other_path(monkeypatch):
    from vllm_gaudi_unified import attention, hpu
    from vllm_gaudi_unified.paths import fused, prompts

    calls = []
    real, real_lse = hpu.sdpa_final, fused.sdpa_lse
    monkeypatch.setattr(hpu, "sdpa_final", lambda *a: calls.append(a[3] is None) or real(*a))
    monkeypatch.setattr(fused, "sdpa_lse", lambda *a, **kw: calls.append(("lse", kw.get("causal", False),
                                                                          a[3] is None)) or real_lse(*a, **kw))
    monkeypatch.setattr(attention, "_run_paths", lambda *a, **k: pytest.fail("another path ran"))
    out, ref, _ = run_case(Step([7, 16, 3, 1], [0, 0, 0, 0], 4))
    assert calls == [True]  # one call, causal without a mask (no context)
    assert_matches(out, ref)
    calls.clear()
    out, ref, _ = run_case(Step([12, 5], [20, 9], 4))
    assert calls == [("lse", False, False), ("lse", True, True)]  # split: context with its padding bias, new causal
    assert_matches(out, ref)
    calls.clear()
    monkeypatch.setattr(fused, "lse_kernel_for", lambda q: False)  # no fused kernel with statistics for these
    out, ref, _ = run_case(Step([12, 5], [20, 9], 4))             # queries (CUDA, float32): the one call
    assert calls == [False]
    assert_matches(out, ref)
    calls.clear()
    monkeypatch.setattr(prompts, "SPLIT_CONTEXT", False)
    out, ref, _ = run_case(Step([12, 5], [20, 9], 4))
    assert calls == [False]  # one call, with the context's mask
    assert_matches(out, ref)


def test_padding_the_prompt_route_changes_nothing():
    step = Step([9, 1, 4], [6, 11, 0], 4)
    out, ref, batch = run_case(step)
    s = batch.shape
    big = Bucket(s.phase, s.query_len + 5, s.num_shared_blocks, s.num_unique_blocks + 3, s.num_logits + 2,
                 s.num_causal_tiles, s.num_prompts + 2, s.prompt_len + 3, s.prompt_blocks + 2)
    padded, _, pbatch = run_case(step, bucket=big)
    assert pbatch.bucket == big
    assert_matches(padded, ref)
    torch.testing.assert_close(padded, out, atol=1e-12, rtol=0)


def test_a_plans_bucket_takes_the_steps_prompt_shape_in_powers_of_two():
    base = Bucket("--u", 64, 0, 16, 8, 0)
    step = Bucket("--u", 20, 0, 3, 4, 0, 3, 17, 5)
    assert with_prompts(base, step).prompts == (4, 32, 8) and with_prompts(base, step).covers(step)
    assert with_prompts(with_prompts(base, step), step) == with_prompts(base, step)
    assert str(with_prompts(base, step)).endswith(":p4x32x8")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_steps_match_the_reference_on_both_routes(data):
    r = data.draw(st.integers(1, 5))
    q = data.draw(st.lists(st.integers(1, 20), min_size=r, max_size=r))
    ctx = data.draw(st.lists(st.integers(0, 30), min_size=r, max_size=r))
    bs = data.draw(st.sampled_from([1, 4, 8]))
    hkv = data.draw(st.sampled_from([1, 2]))
    share = data.draw(st.integers(0, 2))
    groups = [(list(range(r)), min(share, min(ctx) // bs))] if r > 1 and share else []
    step = Step(q, ctx, bs, prefix_groups=groups, num_qo_heads=2 * hkv, num_kv_heads=hkv)
    seed = data.draw(st.integers(0, 3))
    for options in (SMALL_TILES, UNFUSED, TILES):
        out, ref, _ = run_case(step, options=options, seed=seed)
        assert_matches(out, ref)


def test_a_nan_in_a_new_key_reaches_only_the_rows_that_see_it():
    """Token 2 of a 6-token chunk over 5 cached keys gets a NaN value: rows 2..5 may show it, rows 0 and 1
    and the other request's rows stay bitwise as in the clean run."""
    step = Step([6, 3], [5, 4], 4)
    table, nb = make_block_table(step, np.random.default_rng(1))
    q, k, v, kc, vc = make_tensors(step, table, nb)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    clean = unified_attention(q, k, v, kc, vc, batch, 0.5)
    v[2, 1, 3] = float("nan")
    bad = unified_attention(q, k, v, kc, vc, batch, 0.5)
    assert torch.equal(bad[[0, 1, 6, 7, 8]], clean[[0, 1, 6, 7, 8]])
    assert torch.isnan(bad[2:6, 2:]).all() and torch.equal(bad[2:6, :2], clean[2:6, :2])  # KV head 1's heads


@pytest.mark.parametrize("phase", ["--u", "-su", "---"])
def test_warmup_builds_a_batch_for_a_bucket_with_prompts(phase):
    """Warmup runs every bucket: one that carries the prompt route's shape gets a step with a prompt."""
    from vllm_gaudi_unified.warmup import batch_for_bucket

    bucket = Bucket(phase, 16, 8 if phase[1] == "s" else 0, 4 if phase[2] == "u" else 0, 4, 0, 2, 4, 2)
    batch = batch_for_bucket(bucket, 4, SMALL_TILES)
    assert batch.bucket == bucket and batch.shape.num_prompts >= 1
    q, k, v = (torch.randn(16, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    kc, vc = (torch.randn(16, 4, 2, 8, dtype=torch.float64) for _ in range(2))
    assert torch.isfinite(unified_attention(q, k, v, kc, vc, batch, 0.5)).all()


@pytest.mark.parametrize("split", [True, False], ids=["split", "single"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_the_steps_prompt_bias_gives_the_same_rows_padded_and_poisoned(dtype, split, monkeypatch):
    """`with_prompt_bias` (the mask made once per step, as vllm-gaudi's `attn_bias`; split: the context
    keys' padding bias) changes no bit: a padded bucket with partial last blocks, a decode beside the
    prompts, unreadable slots poisoned."""
    from vllm_gaudi_unified.paths import prompts

    monkeypatch.setattr(prompts, "SPLIT_CONTEXT", split)
    step = Step([9, 1, 4, 12], [6, 11, 0, 21], 4, num_qo_heads=4, num_kv_heads=2)
    table, nb = make_block_table(step, np.random.default_rng(3))
    q, k, v, kc, vc = make_tensors(step, table, nb, dtype)
    plain = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES)
    s = plain.shape
    big = Bucket(s.phase, s.query_len + 3, s.num_shared_blocks, s.num_unique_blocks + 2, s.num_logits + 1,
                 s.num_causal_tiles, s.num_prompts + 1, s.prompt_len + 2, s.prompt_blocks + 1)
    padded = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES,
                                 bucket=big)
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
    for batch in (plain, padded):
        biased = batch.with_prompt_bias(dtype)
        b = batch.bucket
        assert biased.prompt_bias.dtype == dtype and biased.prompt_bias.shape == (
            (b.num_prompts, 1, 1, b.prompt_blocks * 4) if split else
            (b.num_prompts, 1, b.prompt_len, b.prompt_blocks * 4 + b.prompt_len))
        out = unified_attention(q, k, v, kc, vc, biased, 0.37)
        torch.testing.assert_close(out, unified_attention(q, k, v, kc, vc, batch, 0.37), rtol=0, atol=0)
        assert_matches(out, ref)
    other = plain.with_prompt_bias(torch.float32)  # made for another dtype: not used, the call makes its own
    torch.testing.assert_close(unified_attention(q, k, v, kc, vc, other, 0.37),
                               unified_attention(q, k, v, kc, vc, plain, 0.37), rtol=0, atol=0)


def test_no_prompt_bias_without_context_or_prompts():
    none = build_unified_batch([7, 5], [0, 0], np.zeros((2, 1), int), 4)  # prompts without context: causal
    assert none.with_prompt_bias(torch.float64) is none
    dec = build_unified_batch([1, 1], [5, 9], np.array([[1, 2, 0], [3, 4, 5]]), 4)
    assert dec.with_prompt_bias(torch.float64) is dec


def test_a_step_of_expanded_mla_prompts_gets_the_one_calls_mask():
    """Values narrower than keys (MLA's expanded prompts) keep the one call (`split_context`), so the
    runners ask for its full `[P, 1, Qp, Kp]` mask once per step (`same_head_dims=False`), not the split
    form's key bias that every layer call would then have to replace."""
    from vllm_gaudi_unified.paths import prompts

    batch = build_unified_batch([6, 3], [5, 9], np.array([[1, 2, 0], [3, 4, 5]]), 4)
    assert prompts.split_context(batch) and not prompts.split_context(batch, same_head_dims=False)
    p, qp = batch.prompt_rows.shape
    keys = batch.prompt_blocks.shape[1] * 4
    assert batch.with_prompt_bias(torch.float64).prompt_bias.shape == (p, 1, 1, keys)
    assert batch.with_prompt_bias(torch.float64, same_head_dims=False).prompt_bias.shape == (p, 1, qp, keys + qp)


def test_a_nan_in_a_cached_key_of_the_context_reaches_only_its_prompts_rows():
    """A real context slot of request 0 holds NaN in K: every row of request 0 sees it (its KV head's
    query heads), request 1's rows and the other KV head's heads stay bitwise as in the clean run."""
    step = Step([6, 3], [5, 4], 4)
    table, nb = make_block_table(step, np.random.default_rng(1))
    q, k, v, kc, vc = make_tensors(step, table, nb)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    clean = unified_attention(q, k, v, kc, vc, batch, 0.5)
    kc[table[0, 1], 0, 1, 2] = float("nan")  # position 4 of request 0: its last context key
    bad = unified_attention(q, k, v, kc, vc, batch, 0.5)
    assert torch.equal(bad[6:], clean[6:]) and torch.equal(bad[:6, :2], clean[:6, :2])
    assert torch.isnan(bad[:6, 2:]).all()


def test_a_step_of_one_prompt_or_of_equal_prompts_is_the_grid_of_its_rows():
    """`prompt_grid`: the prompts' rows are the step's first rows as `[P, Qp]` (one prompt, or every prompt
    but the last of `Qp` tokens), only in a step of prompts alone; a step padded to a bucket only with one
    prompt (every step padded to a bucket of several prompts must take the same code)."""
    table = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    grid = lambda q, c, **kw: plan_step(q, c, table[: len(q)], 4, **kw).prompt_grid  # noqa: E731
    assert grid([9], [5]) and grid([6, 6, 6], [0, 3, 9])
    assert not grid([6, 6, 2], [1, 0, 0])  # the grid's last prompt would run past the step's 14 rows
    assert not grid([2, 6, 6], [0, 0, 0])  # the first prompt is short: the second does not start at Qp
    assert not grid([6, 1], [0, 5])  # a decode beside: not a step of prompts alone
    assert not grid([6, 6], [3, 3], options=PlanOptions(prompt_route="tiles"))
    one = plan_step([9], [5], table[:1], 4)
    s = one.shape
    big = Bucket(s.phase, s.query_len + 7, 0, 0, s.num_logits, 0, 1, s.prompt_len + 3, s.prompt_blocks + 1)
    assert pad_plan(one, big).prompt_grid
    two = plan_step([6, 6], [3, 3], table[:2], 4)
    assert two.prompt_grid and not pad_plan(two, two.shape).prompt_grid  # an exact fit, as if padded
    s = two.shape
    assert not pad_plan(two, Bucket(s.phase, s.query_len + 4, 0, 0, 4, 0, 2, 8, 2)).prompt_grid


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("spec", [Step([9], [6], 4), Step([7, 7, 7], [5, 0, 11], 4), Step([8, 8], [0, 0], 4)],
                         ids=["one", "equal", "no-context"])
def test_the_grid_form_gives_the_rows_of_the_gather_form(spec, dtype):
    """Queries as a view and the output written where it is (`grid_rows`): the same rows as through the
    gathers, against the reference, also padded to a bucket of one prompt, with the unreadable cache
    slots and the padding rows' inputs poisoned, and a NaN in one new value reaching only its rows."""
    spec = replace(spec, num_qo_heads=4, num_kv_heads=2)
    table, nb = make_block_table(spec, np.random.default_rng(5))
    q, k, v, kc, vc = make_tensors(spec, table, nb, dtype)
    ref = reference_attention(q, k, v, kc, vc, spec.query_lens, spec.context_lens, table, 0.41)
    plan = build_unified_batch(spec.query_lens, spec.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES)
    assert plan.plan.prompt_grid
    gathered = replace(plan, plan=replace(plan.plan, prompt_grid=False))
    out = unified_attention(q, k, v, kc, vc, plan, 0.41)
    torch.testing.assert_close(out, unified_attention(q, k, v, kc, vc, gathered, 0.41), rtol=0, atol=0)
    assert_matches(out, ref)
    if len(spec.query_lens) == 1:  # padded: rows past the prompt hold NaN inputs and come out zero
        s = plan.shape
        big = Bucket(s.phase, s.query_len + 6, 0, 0, s.num_logits + 1, 0, 1, s.prompt_len + 4, s.prompt_blocks + 1)
        padded = build_unified_batch(spec.query_lens, spec.context_lens, table, 4, num_blocks=nb,
                                     options=SMALL_TILES, bucket=big)
        assert padded.plan.prompt_grid
        nan = lambda x: torch.cat([x, torch.full((6, *x.shape[1:]), float("nan"), dtype=x.dtype)])  # noqa: E731
        pout = unified_attention(nan(q), nan(k), nan(v), kc, vc, padded, 0.41)
        torch.testing.assert_close(pout[: q.shape[0]], out, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-2)
        assert (pout[q.shape[0]:] == 0).all()
    v[2, 1, 3] = float("nan")  # token 2 of the first prompt, KV head 1: its later rows, heads 2 and 3
    bad = unified_attention(q, k, v, kc, vc, plan, 0.41)
    first = spec.query_lens[0]
    assert torch.isnan(bad[2:first, 2:]).all() and torch.equal(bad[:2], out[:2])
    assert torch.equal(bad[2:first, :2], out[2:first, :2]) and torch.equal(bad[first:], out[first:])


SPLIT_CASES = {
    # ragged contexts with partial last blocks, a prompt with context 0 beside ones with context
    "ragged": Step([9, 13, 5, 1], [7, 0, 21, 3], 4, num_qo_heads=4, num_kv_heads=2),
    "gqa-one-block": Step([16, 3], [4, 12], 4, num_qo_heads=8, num_kv_heads=2),  # whole blocks, GQA 4
    "mqa": Step([6, 11, 2], [0, 9, 17], 8, num_qo_heads=3, num_kv_heads=1),
}


def _split_and_single(spec, dtype, bucket_pad: bool, poison: bool, seed: int = 7):
    """(split, single, reference) for a step of prompts, padded to a bigger bucket (padding prompts,
    padding blocks, padding rows) and with the unreadable cache slots poisoned when asked."""
    from vllm_gaudi_unified.paths import prompts

    table, nb = make_block_table(spec, np.random.default_rng(seed))
    q, k, v, kc, vc = make_tensors(spec, table, nb, dtype)
    ref = reference_attention(q, k, v, kc, vc, spec.query_lens, spec.context_lens, table, 0.37)
    batch = build_unified_batch(spec.query_lens, spec.context_lens, table, spec.block_size, num_blocks=nb,
                                options=SMALL_TILES)
    if bucket_pad:
        s = batch.shape
        big = Bucket(s.phase, s.query_len + 5, s.num_shared_blocks, s.num_unique_blocks + 2 * (s.phase[2] == "u"),
                     s.num_logits + 2, s.num_causal_tiles, s.num_prompts + 1, s.prompt_len + 3, s.prompt_blocks + 2)
        batch = build_unified_batch(spec.query_lens, spec.context_lens, table, spec.block_size, num_blocks=nb,
                                    options=SMALL_TILES, bucket=big)
    if poison:  # every slot no row may read: past each context in its last block, and unused blocks
        used = torch.zeros(kc.shape[:2], dtype=torch.bool)
        for r, c in enumerate(spec.context_lens):
            for p in range(c):
                used[table[r, p // spec.block_size], p % spec.block_size] = True
        kc[~used], vc[~used] = float("nan"), float("inf")
    assert prompts.split_context(batch)
    split = unified_attention(q, k, v, kc, vc, batch, 0.37)
    saved, prompts.SPLIT_CONTEXT = prompts.SPLIT_CONTEXT, False
    try:
        single = unified_attention(q, k, v, kc, vc, batch, 0.37)
    finally:
        prompts.SPLIT_CONTEXT = saved
    return split, single, ref, (q, k, v, kc, vc, batch, table)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_the_split_form_matches_the_reference_and_the_single_call(name, pad, dtype):
    """The split form (context call + causal new-key call + merge) against the float64 reference (1e-6;
    bf16 1e-2) and the single call with the full bias: ragged contexts, context 0 beside context > 0,
    partial last blocks, padding prompts/blocks/rows, unused slots poisoned, GQA and MQA."""
    split, single, ref, _ = _split_and_single(SPLIT_CASES[name], dtype, pad, poison=True)
    assert torch.isfinite(split).all()
    assert_matches(split, ref)  # conftest: 1e-6 in float64, 1e-2 in bf16
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(split, single, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_the_split_form_contains_a_bad_new_key_and_a_bad_context_key(dtype):
    """A NaN new value reaches only the rows at or after it (its KV head's query heads); a NaN real context
    key reaches every row of its prompt (that KV head) and no other prompt's rows; a NaN in an unused slot
    (poisoned above) reaches nothing."""
    spec = SPLIT_CASES["ragged"]
    split, _, _, (q, k, v, kc, vc, batch, table) = _split_and_single(spec, dtype, False, poison=True)
    v[2, 1, 3] = float("nan")  # token 2 of prompt 0 (9 tokens), KV head 1: rows 2..8, heads 2 and 3
    bad = unified_attention(q, k, v, kc, vc, batch, 0.37)
    assert torch.isnan(bad[2:9, 2:]).all() and torch.equal(bad[:2], split[:2])
    assert torch.equal(bad[2:9, :2], split[2:9, :2]) and torch.equal(bad[9:], split[9:])
    v[2, 1, 3] = 0.5
    clean = unified_attention(q, k, v, kc, vc, batch, 0.37)
    kc[table[2, 1], 2, 0, 1] = float("nan")  # position 6 of prompt 2 (context 21), KV head 0
    bad = unified_attention(q, k, v, kc, vc, batch, 0.37)
    start, stop = 9 + 13, 9 + 13 + 5
    assert torch.isnan(bad[start:stop, :2]).all() and torch.equal(bad[start:stop, 2:], clean[start:stop, 2:])
    assert torch.equal(bad[:start], clean[:start]) and torch.equal(bad[stop:], clean[stop:])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_the_split_form_on_the_grid(dtype):
    """A step of equal prompts is the grid of its rows (`prompt_grid`): the split form gives the rows of
    the gather form and of the single call, a prompt with context 0 among them."""
    from vllm_gaudi_unified.paths import prompts

    spec = Step([7, 7, 7], [5, 0, 11], 4, num_qo_heads=4, num_kv_heads=2)
    table, nb = make_block_table(spec, np.random.default_rng(5))
    q, k, v, kc, vc = make_tensors(spec, table, nb, dtype)
    ref = reference_attention(q, k, v, kc, vc, spec.query_lens, spec.context_lens, table, 0.41)
    plan = build_unified_batch(spec.query_lens, spec.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES)
    assert plan.plan.prompt_grid and prompts.split_context(plan)
    gathered = replace(plan, plan=replace(plan.plan, prompt_grid=False))
    out = unified_attention(q, k, v, kc, vc, plan.with_prompt_bias(dtype), 0.41)
    assert plan.with_prompt_bias(dtype).prompt_bias.shape == (3, 1, 1, 12)  # the split form's key bias
    torch.testing.assert_close(out, unified_attention(q, k, v, kc, vc, gathered, 0.41), rtol=0, atol=0)
    assert_matches(out, ref)


def test_the_split_stats_kernel_gives_the_lse_on_a_fully_masked_row_selected_away():
    """`fused.sdpa_lse` on the CPU (the flash kernel with its logsumexp) against the dense softmax, GQA,
    causal top-left, and what it gives for a row whose keys are all masked (0 with LSE 0: why the split
    form selects context-0 prompts away instead of weighting them)."""
    from vllm_gaudi_unified.paths import fused

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.zeros(2, 1, 1, 5, dtype=torch.float64)
    bias[0, ..., 3:] = float("-inf")
    bias[1] = float("-inf")
    for causal in (False, True):
        out, lse = fused.sdpa_lse(q, k, v, None if causal else bias, 0.3, causal=causal)
        s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
        s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf")) if causal else s + bias
        rows = slice(None) if causal else 0
        want = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
        torch.testing.assert_close(out[rows], want[rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[rows], s.logsumexp(-1)[rows], rtol=0, atol=1e-12)
    assert torch.isfinite(out).all()
    out, lse = fused.sdpa_lse(q, k, v, bias, 0.3)
    assert (out[1] == 0).all() and (lse[1] == 0).all()  # fully masked: not -inf, so it is never weighted


def test_the_split_form_compiles_once_per_bucket_and_the_key_carries_the_form(monkeypatch):
    """Two chunked steps padded to one bucket run one compiled function (no recompile), each matching the
    reference; the single-call form is another compiled function (`graphs.bucket_key` carries the form)."""
    from vllm_gaudi_unified.graphs import bucket_key, clear, compiled_attention
    from vllm_gaudi_unified.paths import prompts

    steps = [Step([9, 5], [6, 0], 4, num_blocks=24, num_qo_heads=4, num_kv_heads=2),
             Step([3, 7], [13, 2], 4, num_blocks=24, num_qo_heads=4, num_kv_heads=2)]
    bucket = Bucket("---", 32, 0, 0, 2, 0, 2, 16, 4)
    clear()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i, step in enumerate(steps):
                table, nb = make_block_table(step, np.random.default_rng(i))
                q, k, v, kc, vc = make_tensors(step, table, nb, seed=i)
                batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES,
                                            bucket=bucket).with_prompt_bias(q.dtype)
                assert batch.bucket == bucket and prompts.split_context(batch)
                ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
                assert_matches(compiled_attention(q, k, v, kc, vc, batch, 0.37), ref)
        split_key = bucket_key(batch, q, kc)
        monkeypatch.setattr(prompts, "SPLIT_CONTEXT", False)
        assert bucket_key(batch, q, kc) != split_key
    finally:
        clear()


def test_the_split_form_starts_at_its_grid_size(monkeypatch):
    """By default (`SPLIT_CONTEXT` None) a bucket's grid takes the split form from `SPLIT_MIN_PAIRS` rows x
    context keys on (a function of the bucket: one graph each), the one call below it; forced either way
    by `SPLIT_CONTEXT` (a benchmark's `prompt_split:0` gives 0); MLA's expanded prompts never split."""
    monkeypatch.setattr(prompt_paths, "SPLIT_CONTEXT", None)
    step = Step([6, 3], [5, 9], 4)
    table, nb = make_block_table(step, np.random.default_rng(0))
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=nb)
    p, qp = batch.prompt_rows.shape
    pairs = p * qp * batch.prompt_blocks.shape[1] * 4
    monkeypatch.setattr(prompt_paths, "SPLIT_MIN_PAIRS", pairs + 1)
    assert not prompt_paths.split_context(batch)
    assert batch.with_prompt_bias(torch.float64).prompt_bias.shape == (p, 1, qp, pairs // (p * qp) + qp)
    monkeypatch.setattr(prompt_paths, "SPLIT_MIN_PAIRS", pairs)
    assert prompt_paths.split_context(batch) and not prompt_paths.split_context(batch, same_head_dims=False)
    q, k, v, kc, vc = make_tensors(step, table, nb)
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
    assert_matches(unified_attention(q, k, v, kc, vc, batch, 0.37), ref)
    for forced, want in ((0, False), (False, False), (1, True), (True, True)):
        monkeypatch.setattr(prompt_paths, "SPLIT_MIN_PAIRS", 1 << 40 if want else 0)
        monkeypatch.setattr(prompt_paths, "SPLIT_CONTEXT", forced)
        assert prompt_paths.split_context(batch) is want


def test_the_grid_gives_a_prompt_to_the_tiles_only_where_that_is_cheaper():
    """`fill_grid` by its cost model: ragged prompts without context stay one grid (the tiles' calls and
    their causal pairs cost more than the padding: one call for all four measured 5x faster on the
    H200's Gaudi route), while short questions over their documents beside a 2k chunk over 6k leave it
    (each would pad to that chunk's 8k keys), and the plan matches the reference either way."""
    bs = 128

    def plan_of(q, ctx):
        nb = -(-(np.asarray(q) + np.asarray(ctx)) // bs)
        table = np.arange(len(q) * int(nb.max())).reshape(len(q), -1)
        return plan_step(q, ctx, table, bs)

    ragged = plan_of([100, 1500, 3000, 700], [0] * 4)
    assert ragged.shape.prompts == (4, 3000, 0) and ragged.shape.phase == "---"
    rag = plan_of([2048] + [40] * 8, [6144] + [3072] * 8)
    assert rag.shape.prompts == (1, 2048, 48) and rag.shape.phase[0] == "c"



@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_step_split_between_the_grid_and_the_tiles_matches_the_reference(dtype, monkeypatch):
    """The same choice on a small step (the grid's thresholds scaled down to it): a 64-token chunk over
    40 keys keeps the grid, the 2-token questions over their 200-key documents take the tiles."""
    from vllm_gaudi_unified.plan import prompts as plan_prompts

    monkeypatch.setattr(plan_prompts, "GRID_MIN_PAIRS", 0)
    monkeypatch.setattr(plan_prompts, "TILES_CALL_COST", 0)
    out, ref, batch = run_case(Step([64, 2, 3, 2], [40, 200, 190, 201], 8), dtype=dtype)
    assert batch.bucket.num_prompts == 1 and batch.bucket.phase[0] == "c"
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("form", ["full", "padded", "gathered"])
@pytest.mark.parametrize("which", ["key", "value", "inf"])
def test_prompts_without_context_contain_a_bad_new_key_through_the_inputs(dtype, form, which):
    """Prompts without context off a Gaudi: one causal call with no pass over its rows (`_causal_keys`,
    `StepPlan.prompt_full`). A non-finite new key or value of token 3 of prompt 1 (KV head 1) reaches its
    rows 3.. (query heads 2, 3) and nothing else; the rest matches the reference; padding rows are zero."""
    spec = Step([6, 6, 6], [0, 0, 0], 4, num_qo_heads=4, num_kv_heads=2)
    table, nb = make_block_table(spec, np.random.default_rng(3))
    q, k, v, kc, vc = make_tensors(spec, table, nb, dtype)
    ref = reference_attention(q, k, v, kc, vc, spec.query_lens, spec.context_lens, table, 0.41)
    batch = build_unified_batch(spec.query_lens, spec.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES)
    assert batch.plan.prompt_grid and batch.plan.prompt_full and batch.prompt_blocks.shape[1] == 0
    if form == "gathered":
        batch = replace(batch, plan=replace(batch.plan, prompt_grid=False))
    pad = 0
    if form == "padded":  # the same step in a larger bucket: padding rows hold NaN inputs and come out zero
        s, pad = batch.plan.shape, 6
        big = replace(s, query_len=s.query_len + pad, num_logits=s.num_logits + 1)
        batch = build_unified_batch(spec.query_lens, spec.context_lens, table, 4, num_blocks=nb,
                                    options=SMALL_TILES, bucket=big)
        assert not batch.plan.prompt_full
    nan = lambda x: torch.cat([x, torch.full((pad, *x.shape[1:]), float("nan"), dtype=x.dtype)])  # noqa: E731
    out = unified_attention(nan(q), nan(k), nan(v), kc, vc, batch, 0.41)
    assert_matches(out[:18], ref)
    assert (out[18:] == 0).all()
    bad_value = float("inf") if which == "inf" else float("nan")
    (k if which == "key" else v)[9, 1, 5] = bad_value  # token 3 of prompt 1, KV head 1
    bad = unified_attention(nan(q), nan(k), nan(v), kc, vc, batch, 0.41)
    assert torch.isnan(bad[9:12, 2:]).all()
    keep = torch.ones(bad.shape[:2], dtype=torch.bool)
    keep[9:12, 2:] = False
    assert torch.equal(bad[keep], out[keep])


@pytest.mark.parametrize("ctx", [0, 5], ids=["no-context", "context"])
def test_the_compiled_step_contains_a_bad_new_key_as_the_eager_one_does(ctx):
    """`graphs.compiled_attention` (torch.compile per bucket): a NaN value or an inf key of token 3 of
    prompt 1 reaches exactly its KV head's rows 3.. of that prompt, as eager. (The finiteness test once
    read `(x * 0).sum() == 0`, which the compiler folds to True: the compiled step leaked NaN upwards.)"""
    from vllm_gaudi_unified.graphs import clear, compiled_attention

    spec = Step([6, 6, 6], [ctx] * 3, 4, num_qo_heads=4, num_kv_heads=2)
    table, nb = make_block_table(spec, np.random.default_rng(4))
    q, k, v, kc, vc = make_tensors(spec, table, nb, torch.bfloat16)
    batch = build_unified_batch(spec.query_lens, spec.context_lens, table, 4, num_blocks=nb, options=SMALL_TILES)
    clear()
    clean = compiled_attention(q, k, v, kc, vc, batch, 0.41)
    assert torch.equal(clean, unified_attention(q, k, v, kc, vc, batch, 0.41))
    for which, value in (("value", float("nan")), ("key", float("inf"))):
        kk, vv = k.clone(), v.clone()
        (kk if which == "key" else vv)[9, 1, 5] = value
        bad = compiled_attention(q, kk, vv, kc, vc, batch, 0.41)
        assert torch.isnan(bad[9:12, 2:]).all(), which
        keep = torch.ones(bad.shape[:2], dtype=torch.bool)
        keep[9:12, 2:] = False
        assert torch.equal(bad[keep], clean[keep]), which
    clear()
