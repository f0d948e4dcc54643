"""unified_attention against the float64 dense reference, on every named spec and feature."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import SMALL_TILES, SPECS, TILES, Step, assert_matches, make_block_table, make_tensors, run_case
from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.reference import reference_attention

EXPECTED_PHASE = {"seed": "csu", "decode": "--u", "prefill": "c--", "chunked_prefill": "cs-",
                  "prefix_caching": "csu", "parallel_sampling": "-su"}


@pytest.mark.parametrize("route", ["dense", "tiles"])
def test_every_spec_matches_reference(spec_name, route):
    """Both prompt routes (`PlanOptions.prompt_route`); the phases are the tiled route's."""
    out, ref, batch = run_case(SPECS[spec_name], options=replace(SMALL_TILES, prompt_route=route))
    assert_matches(out, ref)
    if route == "tiles":
        assert batch.bucket.num_prompts == 0
        if spec_name in EXPECTED_PHASE:
            assert batch.phase == EXPECTED_PHASE[spec_name]


@pytest.mark.parametrize("options", [PlanOptions(), SMALL_TILES, PlanOptions(causal_tile=1, shared_rows=1,
                                                                             shared_rows_max=1, shared_tile_keys=1),
                                     PlanOptions(causal_tile=4, shared_rows=1, shared_rows_max=16, shared_tile_keys=8)],
                         ids=["default-tiles", "small-tiles", "unit-tiles", "rows-per-step"])
def test_tile_sizes_do_not_change_results(options):
    for name in ("seed", "long_causal", "prefix_caching", "ragged_partial"):
        out, ref, _ = run_case(SPECS[name], options=options)
        assert_matches(out, ref)


@pytest.mark.parametrize("layout", ["slice", "gather"])
def test_unique_layouts(layout):
    out, ref, batch = run_case(SPECS["decode"], options=PlanOptions(unique_layout=layout))
    assert batch.unique_layout == layout
    assert_matches(out, ref)


def test_auto_layout_gathers_when_the_slice_is_sparse():
    step = Step([1, 1], [8, 8], 4, num_blocks=400)
    table = np.array([[3, 4, 5], [390, 391, 392]])
    dense = build_unified_batch([1, 1], [8, 8], table[:, :2] * 0 + [[3, 4], [5, 6]], 4)
    sparse = build_unified_batch([1, 1], [8, 8], table, 4)
    assert dense.unique_layout == "slice" and sparse.unique_layout == "gather"
    assert sparse.bucket.num_unique_blocks == 4
    del step


@pytest.mark.parametrize("phase", ["".join(p) for p in itertools.product("c-", "s-", "u-")])
def test_all_eight_phases(phase):
    """One step per phase: causal needs a request with >= 2 new tokens; shared a block seen by
    several tokens; unique a block seen by one token."""
    q, c, groups = [], [], []
    if phase[0] == "c":
        q.append(5), c.append(0)
    if phase[1] == "s":
        q += [1, 1]
        c += [8, 8]
        groups.append(([len(q) - 2, len(q) - 1], 2))
    if phase[2] == "u":
        q.append(1), c.append(6)
    if not q:  # '---': single tokens with nothing cached: only their own key
        q, c = [1, 1], [0, 0]
    out, ref, batch = run_case(Step(q, c, 4, prefix_groups=groups), options=TILES)
    assert batch.phase == phase
    assert_matches(out, ref)


def test_padding_to_a_larger_bucket_changes_nothing():
    step = SPECS["seed"]
    out, _, batch = run_case(step)
    s = batch.shape
    kb = SMALL_TILES.blocks_per_tile(step.block_size)
    big = Bucket("csu", s.query_len + 9, s.num_shared_blocks + 3 * kb, s.num_unique_blocks + 5, s.num_logits + 3,
                 s.num_causal_tiles + 4, s.num_prompts + 2, s.prompt_len + 3, s.prompt_blocks + 2)
    assert s.num_prompts > 0  # the seed's prompt is on the prompt route: its arrays are padded too
    padded, ref, pbatch = run_case(step, bucket=big)
    assert pbatch.bucket == big and pbatch.shape == s
    assert_matches(padded, ref)
    torch.testing.assert_close(padded, out, atol=1e-12, rtol=0)


#: Steps with prompts, chunks over context, drafts (short, over a prefix another request reads) and decodes.
FIVE_SIZE_STEPS = {**SPECS, "drafts": Step([3, 3, 1, 1], [13, 13, 9, 13], 4, prefix_groups=[([0, 1, 3], 3)]),
                   "drafts_alone": Step([4, 1, 3], [9, 12, 5], 4)}


def five_size_bucket(shape: Bucket, kb: int, num_blocks: int) -> Bucket:
    """`shape`'s five sizes, each grown (shared slots by a whole tile of `kb` blocks, unique slots within
    the cache's `num_blocks`: a slice reads that many), and no prompt grid."""
    return Bucket("csu", shape.query_len + 2, shape.num_shared_blocks + kb,
                  max(1, min(shape.num_unique_blocks + 3, num_blocks)), shape.num_logits + 1,
                  shape.num_causal_tiles + 1)


def check_five_size_bucket(step: Step, options: PlanOptions, seed: int = 0, **attn_kwargs):
    """A `Bucket` of the five sizes (no prompt grid) plans a step on the tiled route it describes,
    with no error: bitwise the unpadded tiled plan, within 1e-6 of the reference (float64)."""
    tiled, ref, plain = run_case(step, options=replace(options, prompt_route="tiles"), seed=seed, **attn_kwargs)
    _, num_blocks = make_block_table(step, np.random.default_rng(seed))
    big = five_size_bucket(plain.shape, options.blocks_per_tile(step.block_size), num_blocks)
    out, _, batch = run_case(step, options=options, seed=seed, bucket=big, **attn_kwargs)
    assert batch.bucket == big and batch.shape == plain.shape and batch.shape.num_prompts == 0
    assert_matches(out, ref)
    assert torch.equal(out, tiled)


@pytest.mark.parametrize("name", sorted(FIVE_SIZE_STEPS))
def test_a_bucket_of_the_five_sizes_plans_the_tiled_route(name):
    step = FIVE_SIZE_STEPS[name]
    check_five_size_bucket(step, SMALL_TILES)
    _, _, dense = run_case(step, options=SMALL_TILES)
    if dense.shape.num_prompts:  # a bucket with a prompt grid keeps the prompt route
        s = dense.shape
        grid = Bucket(s.phase, s.query_len + 2, s.num_shared_blocks, s.num_unique_blocks, s.num_logits + 1,
                      s.num_causal_tiles, s.num_prompts + 1, s.prompt_len + 2, s.prompt_blocks + 1)
        out, ref, batch = run_case(step, bucket=grid)
        assert batch.bucket == grid and batch.shape == s
        assert_matches(out, ref)


def test_the_issue_example_pads_a_prompt_step_to_a_bucket_of_the_five_sizes():
    table = np.arange(20).reshape(2, 10)
    batch = build_unified_batch([5, 1], [16, 20], table, 4, bucket=Bucket("csu", 32, 128, 64, 8, 8))
    assert str(batch.bucket) == "csu:q32:s128:u64:l8:c8" and batch.shape.num_prompts == 0
    with pytest.raises(ValueError, match=r"^bucket csu:q32:s64:u64:l8:c8 does not cover the step: "
                                         r"num_shared_blocks 128 > 64$"):  # shared tiles of 512 keys: 128 slots
        build_unified_batch([5, 1], [16, 20], table, 4, bucket=Bucket("csu", 32, 64, 64, 8, 8))


def test_padding_adds_paths_that_the_step_does_not_need():
    gather = PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8, unique_layout="gather")
    out, ref, batch = run_case(SPECS["decode"], options=gather, bucket=Bucket("csu", 8, 8, 40, 8, 3))
    assert batch.shape.phase == "--u" and batch.phase == "csu"
    assert_matches(out, ref)


def test_padded_inputs_are_accepted_and_returned_padded():
    step = SPECS["chunked_prefill"]
    rng = np.random.default_rng(0)
    table, nb = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, nb)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    s = batch.shape
    bucket = Bucket(s.phase, s.query_len + 3, s.num_shared_blocks, 0, 2, s.num_causal_tiles, *s.prompts)
    pbatch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES, bucket=bucket)
    pad = lambda x: torch.cat([x, torch.randn((3,) + x.shape[1:], dtype=x.dtype)])
    out = unified_attention(pad(q), pad(k), pad(v), kc, vc, pbatch, 0.5)
    assert out.shape[0] == s.query_len + 3
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.5)
    assert_matches(out[: s.query_len], ref)


def test_shuffled_block_tables_give_the_same_result():
    """Paging invariance: the same logical sequences in other physical blocks."""
    step = SPECS["prefix_caching"]
    outs = []
    for seed in range(3):
        rng = np.random.default_rng(100 + seed)
        table, nb = make_block_table(step, rng)
        q, k, v, _, _ = make_tensors(step, table, nb, seed=7)
        # Same logical content: fill block (r, i) from a fixed per-position tensor.
        g = torch.Generator().manual_seed(1)
        logical_k = torch.randn(len(step.query_lens), table.shape[1], 4, 2, 8, generator=g, dtype=torch.float64)
        logical_v = torch.randn(logical_k.shape, generator=g, dtype=torch.float64)
        kc = torch.full((nb, 4, 2, 8), float("nan"), dtype=torch.float64)
        vc = kc.clone()
        for (members, _), r in itertools.product(step.prefix_groups, range(len(step.query_lens))):
            for i in range(-(-step.context_lens[r] // 4)):
                src = members[0] if r in members and table[r, i] == table[members[0], i] else r
                kc[table[r, i]], vc[table[r, i]] = logical_k[src, i], logical_v[src, i]
        batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
        outs.append(unified_attention(q, k, v, kc, vc, batch, 0.5))
        assert torch.isfinite(outs[-1]).all()
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-12, rtol=0)


def test_decode_reads_its_own_key_once_even_when_the_cache_holds_it():
    """Upstream bug: in a batch with a prompt, a decode token attended to its own key twice
    (new token and cache). Here the slot of the new token holds the same key in the cache, as after
    vLLM's cache write; positions >= context_len must come from key/value only."""
    step = Step([6, 1], [0, 5], 4)
    rng = np.random.default_rng(3)
    table, nb = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, nb)
    for r, (ql, c) in enumerate(zip(step.query_lens, step.context_lens)):  # write the new K/V like vLLM does
        start = sum(step.query_lens[:r])
        for j in range(ql):
            pos = c + j
            kc[table[r, pos // 4], pos % 4], vc[table[r, pos // 4], pos % 4] = k[start + j], v[start + j]
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    out = unified_attention(q, k, v, kc, vc, batch, 0.5)
    assert_matches(out, reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.5))


def test_spec_decode_drafts_are_causal_among_themselves():
    """Upstream bug: draft tokens of speculative decoding saw each other in both directions."""
    step = Step([4, 1, 3], [9, 12, 5], 4)
    out, ref, batch = run_case(step, options=TILES)
    assert batch.phase[0] == "c"
    assert_matches(out, ref)
    out, ref, batch = run_case(step)  # the drafts over their own context: the prompt route
    assert batch.bucket.num_prompts == 2 and batch.phase == "--u"
    assert_matches(out, ref)
    # The first draft must not depend on later drafts: change them and compare.
    rng = np.random.default_rng(0)
    table, nb = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, nb)
    b = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    base = unified_attention(q, k, v, kc, vc, b, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[1:4], v2[1:4] = 100.0, -100.0
    moved = unified_attention(q, k2, v2, kc, vc, b, 0.5)
    torch.testing.assert_close(moved[0], base[0], atol=0, rtol=0)
    assert not torch.allclose(moved[3], base[3])


@pytest.mark.parametrize("feature", ["soft_cap", "window", "window_one", "sinks", "all"])
def test_options(feature, spec_name):
    step = SPECS[spec_name]
    kwargs = {}
    if feature in ("soft_cap", "all"):
        kwargs["logits_soft_cap"] = 1.5
    if feature in ("window", "all"):
        kwargs["sliding_window"] = 5
    if feature == "window_one":
        kwargs["sliding_window"] = 1
    if feature in ("sinks", "all"):
        kwargs["sinks"] = torch.linspace(-1, 2, step.num_qo_heads, dtype=torch.float64)
    out, ref, _ = run_case(step, **kwargs)
    assert_matches(out, ref)


def test_window_skips_blocks_entirely_out_of_reach():
    step = Step([1, 3], [40, 30], 4)
    _, _, full = run_case(step)
    out, ref, windowed = run_case(step, sliding_window=6)
    assert_matches(out, ref)
    assert windowed.work_needed.total < full.work_needed.total
    assert windowed.plan.max_block_id <= full.plan.max_block_id


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision(dtype, spec_name):
    out, ref, _ = run_case(SPECS[spec_name], dtype=dtype)
    assert out.dtype == dtype
    assert_matches(out, ref)


def test_large_block_ids_do_not_overflow():
    """A cache of 70 000 blocks with tiny heads: ids and flattened offsets beyond int16/32-bit slot math."""
    step = Step([3, 1], [9, 6], 4, num_qo_heads=2, num_kv_heads=1, head_dim=2, num_blocks=70_000)
    table = np.array([[69_990, 69_991, 69_992, -1], [5, 69_999, -1, -1]])
    _, _, kc, vc = None, None, None, None
    q, k, v, kc, vc = make_tensors(step, table, 70_000)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=70_000)
    out = unified_attention(q, k, v, kc, vc, batch, 0.5)
    assert batch.unique_layout == "gather"
    assert_matches(out, reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.5))


@st.composite
def random_steps(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 6))
    q = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    c = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    groups = []
    if n >= 2 and draw(st.booleans()):
        members = sorted(draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n)))
        common = min(c[m] for m in members) // bs
        if common:
            groups.append((members, draw(st.integers(1, common))))
    hkv = draw(st.sampled_from([1, 2]))
    return Step(q, c, bs, prefix_groups=groups, num_qo_heads=hkv * draw(st.sampled_from([1, 3])), num_kv_heads=hkv,
                head_dim=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=random_steps(), window=st.sampled_from([None, 1, 3, 11]), cap=st.sampled_from([None, 2.0]),
       tiles=st.sampled_from([SMALL_TILES, PlanOptions(), PlanOptions(causal_tile=3, shared_rows=2,
                                                                      shared_tile_keys=5, unique_layout="gather")]),
       seed=st.integers(0, 2**16))
def test_random_batches(step, window, cap, tiles, seed):
    out, ref, _ = run_case(step, options=tiles, seed=seed, sliding_window=window, logits_soft_cap=cap)
    assert_matches(out, ref)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=random_steps(), window=st.sampled_from([None, 3]), cap=st.sampled_from([None, 2.0]),
       tiles=st.sampled_from([SMALL_TILES, PlanOptions(causal_tile=3, shared_rows=2, shared_tile_keys=5,
                                                       unique_layout="gather")]),
       seed=st.integers(0, 2**16))
# One tile of shared keys unpadded, two in the bucket, two KV heads: the score product's operands keep one
# layout at every tile count (`paths/tiles.py: attend`), or the real rows' scores differ by an ulp.
@example(step=Step([5], [1], 1, num_qo_heads=6, num_kv_heads=2, head_dim=4), window=None, cap=None,
         tiles=PlanOptions(causal_tile=3, shared_rows=2, shared_tile_keys=5, unique_layout="gather"), seed=0)
def test_random_batches_in_a_bucket_of_the_five_sizes(step, window, cap, tiles, seed):
    check_five_size_bucket(step, tiles, seed, sliding_window=window, logits_soft_cap=cap)


def test_partial_slots_lists_every_partly_seen_slot_once_then_slot_zero():
    """The unique path's masked slots (`_partial_slots`, a rank compaction): every slot with a real row
    that sees part of its block, in slot order, then slot 0 up to the bucket's count."""
    from vllm_gaudi_unified.paths.unique import _partial_slots

    ctx = [5, 8, 13, 1, 16]  # block size 4: partial last blocks for 5, 13 and 1; 8 and 16 end on a block
    table = np.arange(5 * 4).reshape(5, 4) + 1
    batch = build_unified_batch([1] * 5, ctx, table, 4, num_blocks=21)
    n = batch.num_tokens
    sel = _partial_slots(batch, n, 4)
    rows, lo, hi = batch.unique_rows, batch.unique_lo, batch.unique_hi
    want = torch.nonzero((rows < n) & ((lo > 0) | (hi < 4))).flatten()
    assert want.numel() == 3
    assert sel[: want.numel()].tolist() == want.tolist()
    assert (sel[want.numel():] == 0).all() and sel.numel() == min(rows.shape[0], batch.bucket.num_logits)


def test_one_compiled_function_serves_every_step_of_a_bucket():
    """`graphs.compiled_attention` checks and pads eagerly and compiles only the step: decode steps of
    different sizes (token count, largest block id, contexts) padded to one bucket run one compiled
    function with no recompile, each matching the reference; a bad step still gets the check's error."""
    from vllm_gaudi_unified.graphs import clear, compiled_attention

    steps = [Step([1, 1, 1], [5, 9, 3], 4, num_blocks=24), Step([1, 1], [7, 2], 4, num_blocks=24)]
    cases = []
    for i, step in enumerate(steps):
        table, nb = make_block_table(step, np.random.default_rng(i))
        cases.append((step, table, make_tensors(step, table, nb, seed=i)))
    first = build_unified_batch(steps[0].query_lens, steps[0].context_lens, cases[0][1], 4, options=SMALL_TILES)
    s = first.shape
    bucket = Bucket(s.phase, s.query_len + 2, s.num_shared_blocks, s.num_unique_blocks + 4, s.num_logits + 1,
                    s.num_causal_tiles)
    clear()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step, table, (q, k, v, kc, vc) in cases:
                batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES,
                                            bucket=bucket)
                assert batch.bucket == bucket
                ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
                assert_matches(compiled_attention(q, k, v, kc, vc, batch, 0.37), ref)
            with pytest.raises(ValueError, match="query has"):
                compiled_attention(q[:1], k[:1], v[:1], kc, vc, batch, 0.37)
    finally:
        clear()


def test_compiled_step_with_shared_tiles():
    """A step with shared tiles of several rows and KV heads (parallel sampling: `tiles.attend_heads`) and
    every unique slot a partial block, compiled as a bucket's graph is: it compiles (its buffers written in
    their own layout, `tiles.written`) and matches the reference, poisoned slots included."""
    from vllm_gaudi_unified.graphs import clear, compiled_attention

    step = SPECS["parallel_sampling"]
    table, nb = make_block_table(step, np.random.default_rng(0))
    q, k, v, kc, vc = make_tensors(step, table, nb)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    assert batch.phase == "-su" and batch.shared_rows.shape[1] > 1
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
    clear()
    try:
        assert_matches(compiled_attention(q, k, v, kc, vc, batch, 0.37), ref)
    finally:
        clear()
