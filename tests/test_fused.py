"""The fused paths (paths/fused.py, FusedSDPA in hpu.py) against the float64 reference.

On CPU the kernels are replaced by exact stand-ins (tests/fused_standin.py) and the dispatch is
forced, so everything around the kernel (segments, packing, prefix key counts, the merge, the
partly seen unique blocks, padding) is checked at 1e-6 on caches whose unreadable slots hold
NaN/inf. On CUDA the same cases run through the real flash kernel in bf16 (1e-2).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fused_standin
from conftest import SMALL_TILES, SPECS, Step, assert_matches, run_case
from vllm_gaudi_unified import Bucket, PlanOptions, attention, build_unified_batch, hpu
from vllm_gaudi_unified.paths import fused, tiles
from vllm_gaudi_unified.plan import plan_step

BIG_TILES = PlanOptions(causal_tile=4, shared_rows=256, shared_tile_keys=2048)


@pytest.fixture
def flash_calls(monkeypatch):
    """Route every path through the flash stand-in (fused unique from block size 1); count calls."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3] is None)  # True: batched (unique), False: varlen
        return fused_standin.flash(*args, **kwargs)

    monkeypatch.setattr(fused, "FLASH", counted)
    monkeypatch.setattr(fused, "FUSED_UNIQUE_MIN_BLOCK_SIZE", 1)
    monkeypatch.setattr(attention, "kernel_for", lambda batch, q, cap: "flash" if cap is None else None)
    return calls


@pytest.mark.parametrize("options", [SMALL_TILES, BIG_TILES, PlanOptions()], ids=["small", "big", "default"])
def test_every_spec_through_flash(flash_calls, spec_name, options):
    out, ref, batch = run_case(SPECS[spec_name], options=options)
    assert_matches(out, ref)
    # one call per path with work, and the prompt route's flash call when its prompts are ragged (else SDPA)
    assert len(flash_calls) == sum(p != "-" for p in batch.phase) + batch.plan.prompt_ragged


@pytest.mark.parametrize("options", [SMALL_TILES, PlanOptions()], ids=["small", "default"])
def test_the_prompt_route_through_flash(flash_calls, monkeypatch, spec_name, options):
    """`attention.PROMPT_FLASH`: the prompt route's rows from one flash varlen call (segments of real
    rows against their first ctx + len keys, causal bottom-right aligned), the other paths as before."""
    monkeypatch.setattr(attention, "PROMPT_FLASH", True)
    out, ref, batch = run_case(SPECS[spec_name], options=options)
    assert_matches(out, ref)
    assert len(flash_calls) == sum(p != "-" for p in batch.phase) + (batch.bucket.num_prompts > 0)
    assert batch.plan.shared_prefix_visible


def test_shared_tiles_pack_rows_of_small_groups(flash_calls):
    """Four decodes behind one prefix in a 256-row tile: one segment, four real rows."""
    out, ref, batch = run_case(SPECS["parallel_sampling"], options=BIG_TILES)
    assert batch.shared_rows.shape == (1, 256)
    assert_matches(out, ref)


def test_sliding_window_fuses_only_the_causal_path(flash_calls):
    for name in ("seed", "chunked_prefill", "ragged_partial"):
        out, ref, batch = run_case(SPECS[name], sliding_window=5)
        assert_matches(out, ref)
        assert not batch.plan.shared_prefix_visible or batch.phase[1] == "-"
        assert not any(flash_calls)  # the unique path keeps its masked tiles under a window


def test_soft_cap_keeps_the_matmul_tiles(flash_calls):
    out, ref, _ = run_case(SPECS["seed"], logits_soft_cap=3.0)
    assert_matches(out, ref)
    assert flash_calls == []


def test_a_shared_partly_filled_block_falls_back_to_masked_tiles(flash_calls):
    """Two requests share their partly filled last block (vLLM never does; the API allows it):
    their rows see different slot counts, so the tile is no key prefix."""
    step = Step([1, 1], [6, 7], 4)
    table = np.array([[3, 5], [3, 5]])
    plan = plan_step(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    assert plan.bucket.phase[1] == "s" and not plan.shared_prefix_visible
    from conftest import make_tensors
    from vllm_gaudi_unified import unified_attention
    from vllm_gaudi_unified.reference import reference_attention

    q, k, v, kc, vc = make_tensors(step, table, 8)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, options=SMALL_TILES)
    out = unified_attention(q, k, v, kc, vc, batch, 0.37)
    assert_matches(out, reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37))
    assert flash_calls == []  # self+causal has no work here ('-s-'), shared fell back


def test_partial_last_block_comes_last_in_its_tile():
    """A chunk over its own context: the request's partly filled last block is the tile's last column."""
    table = np.array([[9, 2, 7, 4]])
    plan = plan_step([3], [14], table, 4, options=PlanOptions(shared_rows=4, shared_tile_keys=16, prompt_route="tiles"))
    assert plan.shared_blocks.tolist() == [[9, 2, 7, 4]]
    assert plan.shared_hi[0, 0].tolist() == [4, 4, 4, 2] and plan.shared_prefix_visible


def test_padding_to_a_larger_bucket_through_flash(flash_calls):
    step = SPECS["seed"]
    _, _, batch = run_case(step)
    s = batch.shape
    kb = SMALL_TILES.blocks_per_tile(step.block_size)
    big = Bucket("csu", s.query_len + 9, s.num_shared_blocks + 3 * kb, s.num_unique_blocks + 5, s.num_logits + 3,
                 s.num_causal_tiles + 4, s.num_prompts + 1, s.prompt_len + 2, s.prompt_blocks + 1)
    out, ref, pbatch = run_case(step, bucket=big)
    assert pbatch.bucket == big
    assert_matches(out, ref)


def test_kernel_selection():
    bf16, f64 = torch.bfloat16, torch.float64
    assert fused.fused_kernel("cuda", bf16, 128, None) == "flash"
    assert fused.fused_kernel("cuda", torch.float16, 64, None) == "flash"
    assert fused.fused_kernel("cuda", bf16, 128, 30.0) is None  # soft cap
    assert fused.fused_kernel("cuda", bf16, 128, None, enabled=False) is None  # PlanOptions.fused_kernels
    assert fused.fused_kernel("cuda", f64, 128, None) is None
    assert fused.fused_kernel("cuda", torch.float32, 128, None) is None
    assert fused.fused_kernel("cuda", bf16, 100, None) is None  # head size flash does not take
    assert fused.fused_kernel("cpu", bf16, 128, None) is None
    assert hpu.select_fused_sdpa("hpu", bf16, importable=True)
    assert not hpu.select_fused_sdpa("hpu", bf16, importable=False)
    assert not hpu.select_fused_sdpa("hpu", torch.float32, importable=True)
    assert not hpu.select_fused_sdpa("cuda", bf16, importable=True)


def test_score_products_keep_16_bits_where_a_gaudi_runs_them():
    """`tiles.score_product` writes fp32 scores for 16-bit operands on CUDA and the CPU, and keeps the operands'
    dtype on an HPU and on CUDA's Gaudi route (which runs, times and holds what a Gaudi does)."""
    assert tiles.gaudi_product("hpu") and not tiles.gaudi_product("cpu") and not tiles.gaudi_product("cuda")
    with fused.gaudi_route():
        assert tiles.gaudi_product("cuda") and not tiles.gaudi_product("cpu")
    assert not tiles.gaudi_product("cuda")
    a, b = torch.randn(2, 3, 8).bfloat16(), torch.randn(2, 8, 5).bfloat16()
    assert tiles.score_product(a, b).dtype == torch.float32
    if torch.cuda.is_available():
        a, b = a.cuda(), b.cuda()
        assert tiles.score_product(a, b).dtype == torch.float32
        with fused.gaudi_route():
            assert tiles.score_product(a, b).dtype == torch.bfloat16


def test_fused_sdpa_partial_equals_the_matmul_tile():
    """FusedSDPA's (out, m, linv) as a Partial: same as `attend`, including rows that see no key and
    poisoned values at masked keys."""
    g = torch.Generator().manual_seed(3)
    t, r, kn, hq, hkv, d = 3, 5, 7, 8, 2, 4
    q = torch.randn(t, r, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, kn, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, kn, hkv, d, generator=g, dtype=torch.float64)
    mask = torch.rand(t, r, kn, generator=g) < 0.6
    mask[0, 2] = False  # a row that sees nothing
    mask[:, :, 6] = False
    v[:, 6] = float("nan")  # a key no row sees
    want = tiles.attend(q, k, v, mask, 0.3, None)
    got = fused.sdpa_stats_partial(fused_standin.sdpa_recomp_fwd, q, k, v, mask, 0.3)
    seen = want.sum > 0
    assert torch.equal(seen, got.sum > 0)
    assert torch.isfinite(got.acc).all() and (got.max[~seen] == float("-inf")).all()
    full = lambda p: p.acc / torch.where(p.sum > 0, p.sum, 1.0)[..., None]  # noqa: E731
    torch.testing.assert_close(full(got), full(want), atol=1e-12, rtol=1e-12)
    lse = lambda p: p.max[seen] + torch.log(p.sum[seen])  # noqa: E731
    torch.testing.assert_close(lse(got), lse(want), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fused_sdpa_contains_a_bad_key_or_value(where, bad):
    """A non-finite K or V element of a key some rows of the tile see and others do not: only the rows
    that see it are NaN (the kernel's -inf bias plus NaN, or a zero weight times NaN, would reach the
    others); every other row is as without it."""
    g = torch.Generator().manual_seed(3)
    t, r, kn, hq, hkv, d = 2, 4, 6, 4, 2, 4
    q = torch.randn(t, r, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, kn, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, kn, hkv, d, generator=g, dtype=torch.float64)
    mask = torch.arange(kn)[None, None, :] <= torch.arange(r)[None, :, None] + 1  # causal-like: rows see more
    mask = mask.expand(t, r, kn).clone()
    clean = fused.sdpa_stats_partial(fused_standin.sdpa_recomp_fwd, q, k, v, mask, 0.3)
    (k if where == "key" else v)[0, 3, 1, 2] = bad  # key 3, KV head 1 of tile 0: rows 2, 3 see it
    got = fused.sdpa_stats_partial(fused_standin.sdpa_recomp_fwd, q, k, v, mask, 0.3)
    hit = torch.zeros(t * r, hq, dtype=torch.bool)
    hit[2:4, 2:4] = True  # query heads 2, 3 belong to KV head 1
    assert torch.isnan(got.max[hit]).all()
    for a, b in zip(got, clean):
        torch.testing.assert_close(a[~hit], b[~hit], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the real flash kernel)")
@pytest.mark.parametrize("options", [SMALL_TILES, BIG_TILES], ids=["small", "big"])
@pytest.mark.parametrize("unique_route", ["default", "flash"])
def test_real_flash_on_cuda(spec_name, options, unique_route, monkeypatch):
    """bf16 through flash on the GPU against the float64 reference, NaN/inf in unreadable slots; the unique
    path by its default route (the Triton kernel where Triton is) and through flash per block."""
    from conftest import make_block_table, make_tensors
    from vllm_gaudi_unified import unified_attention
    from vllm_gaudi_unified.reference import reference_attention

    monkeypatch.setattr(fused, "FUSED_UNIQUE_MIN_BLOCK_SIZE", 1)
    if unique_route == "flash":
        monkeypatch.setattr(attention, "kernel_unique_applies", lambda kc, vc: False)
    step = SPECS[spec_name]
    step = Step(step.query_lens, step.context_lens, step.block_size, step.prefix_groups, num_qo_heads=8,
                num_kv_heads=2, head_dim=64)
    table, nb = make_block_table(step, np.random.default_rng(0))
    low = make_tensors(step, table, nb, dtype=torch.bfloat16)
    ref = reference_attention(*low, step.query_lens, step.context_lens, table, 0.37)
    dev = [x.to("cuda") for x in low]
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=options,
                                device="cuda")
    assert attention.kernel_for(batch, dev[0], None) == "flash"
    out = unified_attention(*dev, batch, 0.37)
    assert_matches(out.cpu(), ref)


def _brute_prefix_visible(plan) -> bool:
    """The flag's definition, cell by cell."""
    hi, real = plan.shared_hi, plan.shared_rows < plan.num_tokens
    top = hi.max(1)
    same = ((hi == top[:, None, :]) | ~real[:, :, None]).all()
    return plan.sliding_window is None and bool(same and ((top[:, 1:] == 0) | (top[:, :-1] == plan.block_size)).all())


def test_prefix_flag_matches_its_definition():
    rng = np.random.default_rng(5)
    for trial in range(300):
        r = int(rng.integers(1, 6))
        bs = int(rng.choice([2, 4, 8]))
        q = rng.integers(1, 6, r)
        ctx = rng.integers(0, 30, r)
        nb = -(-(ctx + q) // bs)
        table = np.full((r, int(nb.max())), -1, np.int64)
        free = iter(rng.permutation(np.arange(1, 200)))
        for i in range(r):
            for j in range(nb[i]):
                share = i and rng.random() < 0.5 and j < table.shape[1] and table[0, j] >= 0
                table[i, j] = table[0, j] if share else next(free)  # may share a partly filled block
        window = None if trial % 3 else int(rng.integers(1, 12))
        opts = PlanOptions(shared_rows=int(rng.choice([1, 3, 8])), shared_tile_keys=int(rng.choice([2, 8, 32])))
        plan = plan_step(q, ctx, table, bs, sliding_window=window, options=opts)
        assert plan.shared_prefix_visible == _brute_prefix_visible(plan), (q, ctx, table, window, opts)


def test_clean_causal_values_marks_the_rows_that_see_a_bad_value():
    """Row i of a request (segment) sees token j's value for j in its segment, j <= i, i - j < window: its
    flag is set exactly when such a value is not finite for that KV head; the values come back with every
    non-finite entry 0. Checked pair by pair against the definition (ragged segments, padding rows)."""
    rng = np.random.default_rng(11)
    for trial in range(120):
        t, h = int(rng.integers(1, 40)), int(rng.integers(1, 4))
        lens = np.diff(np.unique(np.concatenate([[0, t], rng.integers(0, t, int(rng.integers(0, 5)))])))
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        v = torch.tensor(rng.normal(size=(t, h, 3)))
        v[torch.tensor(rng.random((t, h, 3)) < 0.04)] = float(rng.choice([np.nan, np.inf]))
        window = None if trial % 2 else int(rng.integers(1, 8))
        seg = torch.tensor(np.concatenate([starts, [t] * 3]))  # rows past the step's tokens: padding
        clean, seen = fused.clean_causal_values(v, seg, window)
        bad = ~torch.isfinite(v).all(-1)
        for i in range(t):
            lo = starts[i] if window is None else max(starts[i], i - window + 1)
            assert torch.equal(seen[i], bad[lo:i + 1].any(0)), (trial, i)
        assert torch.equal(clean, torch.where(torch.isfinite(v), v, 0.0))


@pytest.mark.parametrize("pad", [False, True])
def test_split_steps_through_flash(flash_calls, pad):
    """A step cut into pieces under a gather cap (plan/split.py): each piece's shared and unique tiles
    through flash, the causal pairs once, in the first piece."""
    from test_split import CASES, KB, OPTIONS, CappedPlan

    from conftest import make_block_table, make_tensors
    from vllm_gaudi_unified import unified_attention
    from vllm_gaudi_unified.plan.split import GatherCap
    from vllm_gaudi_unified.reference import reference_attention

    for name, step in sorted(CASES.items()):
        table, num_blocks = make_block_table(step, np.random.default_rng(3))
        q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float64, seed=3)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=OPTIONS,
                                    bucket=CappedPlan(GatherCap(KB, 3), pad))
        assert batch.pieces and all(p.plan.shared_prefix_visible for p in (batch,) + batch.pieces)
        out = unified_attention(q, k, v, kc, vc, batch, 0.37)
        assert_matches(out, reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37))
    assert flash_calls and any(flash_calls) and not all(flash_calls)


@pytest.mark.parametrize("causal", [False, True], ids=["bias", "causal"])
def test_fused_sdpa_statistics_give_the_lse_the_split_prompt_form_merges(causal):
    """`recomp_stats` (FusedSDPA's forward with statistics, heads-major, GQA by an expanded view) as the
    split prompt form reads it on a Gaudi: normalised rows and LSE = m - log(linv), against the dense
    softmax; and the CPU kernel `sdpa_lse` uses and its matmul fallback give the same."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = None if causal else torch.zeros(2, 1, 1, 5, dtype=torch.float64).index_fill_(-1, torch.tensor([3, 4]),
                                                                                        float("-inf"))
    out, m, linv = fused.recomp_stats(fused_standin.sdpa_recomp_fwd, q, k, v, bias, 0.3, causal)
    s = (q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * 0.3
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf")) if causal else s + bias
    want = torch.softmax(s, -1) @ v.repeat_interleave(3, 1)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(m - torch.log(linv), s.logsumexp(-1), rtol=0, atol=1e-12)
    for got_out, got_lse in (fused.sdpa_lse(q, k, v, bias, 0.3, causal=causal),
                             fused.sdpa_lse_matmul(q, k, v, bias, 0.3, causal=causal)):
        torch.testing.assert_close(got_out, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_lse, s.logsumexp(-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("setting", [None, False], ids=["default", "never"])
def test_ragged_prompts_take_flash_by_default(flash_calls, monkeypatch, setting):
    """`StepPlan.prompt_ragged` (the prompts fill less than `RAGGED_FILL` of their padded grid): on CUDA
    the final form is one flash varlen call over their real rows (`attention.prompt_flash`) unless
    `PROMPT_FLASH` is False; prompts that fill their grid keep the grid's SDPA calls. Padded to a bucket,
    the bucket's grid decides."""
    from vllm_gaudi_unified.plan.prompts import RAGGED_FILL, prompt_ragged

    monkeypatch.setattr(attention, "PROMPT_FLASH", setting)
    ragged = Step([2, 11, 3], [29, 0, 6], 4)  # short chunks over long contexts beside a fresh prompt
    out, ref, batch = run_case(ragged, options=PlanOptions())
    assert_matches(out, ref)
    assert batch.plan.prompts_only and batch.plan.prompt_ragged
    assert flash_calls == ([False] if setting is None else [])
    flash_calls.clear()
    even = Step([6, 6], [8, 8], 4)
    out, ref, batch = run_case(even, options=PlanOptions())
    assert_matches(out, ref)
    assert not batch.plan.prompt_ragged and flash_calls == []
    big = Bucket(batch.bucket.phase, 64, 0, 0, 2, 0, 2, 24, 16)  # the same prompts in a far larger grid
    out, ref, padded = run_case(even, options=PlanOptions(), bucket=big)
    assert_matches(out, ref)
    assert padded.plan.prompt_ragged and flash_calls == ([False] if setting is None else [])
    # the rule: real pairs (each row's context and, causal, its new keys) against the grid's
    lengths, ctx = np.array([6, 6]), np.array([8, 8])
    real = 2 * (6 * 8 + 21)
    assert prompt_ragged(lengths, ctx, (2, 6, 2), 4) is (real < RAGGED_FILL * 2 * 6 * (8 + 3.5))
    assert prompt_ragged(lengths, ctx, (2, 24, 16), 4) and not prompt_ragged(lengths[:0], ctx[:0], (0, 0, 0), 4)


@pytest.mark.parametrize("name", ["prefix_caching", "parallel_sampling", "seed"])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_shared_tiles_with_a_gaudis_16_bit_scores_match_the_reference(name, soft_cap, monkeypatch):
    """The shared tiles as a Gaudi computes them (`score_product` keeping bf16: the scale folded into q, one
    softmax over bf16 scores, its row maximum for the sum), run on the CPU: within bf16's 1e-2 of the
    float64 reference, every unused slot poisoned, padded to a bucket with more shared tiles or not."""
    from conftest import record_calls

    from vllm_gaudi_unified.paths import shared

    monkeypatch.setattr(tiles, "gaudi_product", lambda device_type: True)
    calls = record_calls(monkeypatch, shared, "attend_heads")
    products = record_calls(monkeypatch, tiles, "score_product")
    out, ref, batch = run_case(SPECS[name], dtype=torch.bfloat16, logits_soft_cap=soft_cap)
    s, kb = batch.shape, batch.shared_blocks.shape[1]
    big = Bucket("csu", s.query_len + 3, s.num_shared_blocks + 2 * kb, s.num_unique_blocks, s.num_logits,
                 s.num_causal_tiles + 1, s.num_prompts, s.prompt_len, s.prompt_blocks)
    padded, _, _ = run_case(SPECS[name], dtype=torch.bfloat16, logits_soft_cap=soft_cap, bucket=big)
    assert len(calls) == 2 and products and all(p.dtype == torch.bfloat16 for p in products)
    for o in (out, padded):
        assert_matches(o, ref)
