"""Bad values and bad inputs are contained. One section per class of finding; add to it.

1. Containment (a property): a non-finite value in a token's reachable inputs changes only the
   tokens that attend to it, in every path and mode, at fp16 / bf16 / fp32, padded or not.
2. fp16 range: scores and `p @ V` sums beyond 65504 never overflow where the float64 result is finite.
3. Limits that are accepted values: `logits_soft_cap=inf`, `sinks=+-inf`.
4. The planner at huge values: memory bounded by the step, never by the largest block id.
5. Validation: every bad argument of `build_unified_batch`, `PlanOptions`, `unified_attention` is a
   ValueError naming the field and the value.
"""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.plan.options import on_route
from vllm_gaudi_unified.reference import reference_attention

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="no CUDA device on this machine"))]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
#: Small tiles so a few tokens share causal tiles, shared tiles and invariant units.
MODES = {
    "default": PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8),
    "gather": PlanOptions(causal_tile=3, shared_rows=2, shared_tile_keys=4, unique_layout="gather"),
    "slice": PlanOptions(causal_tile=8, shared_rows=8, shared_tile_keys=16, unique_layout="slice"),
    "tiles": PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8, prompt_route="tiles"),
    "invariant": PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8, batch_invariant=True,
                             invariant_rows=4, invariant_chunk=4, invariant_causal_chunk=2),
}


# ----------------------------------------------------------------------------- 1. containment


@st.composite
def poisoned_steps(draw):
    """A random step (ragged, partial blocks, blocks shared by requests — also a block one request
    sees in full and another in part), one poisoned input element, window, cap and padding."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    bs = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 4))
    q = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    ctx = draw(st.lists(st.integers(0, 13), min_size=n, max_size=n))
    nb = [-(-c // bs) for c in ctx]
    width = max(max(nb), 1) + 1
    ids = rng.permutation(np.arange(1, sum(nb) + 3))
    table = np.full((n, width), -1, np.int64)
    used = 0
    for r in range(n):
        table[r, :nb[r]] = ids[used:used + nb[r]]
        used += nb[r]
    if draw(st.booleans()):  # requests reuse request 0's first blocks, partial last blocks included
        for r in range(1, n):
            k = int(rng.integers(0, min(nb[0], nb[r]) + 1))
            table[r, :k] = table[0, :k]
    hkv = draw(st.sampled_from([1, 2]))
    readable = [(r, p) for r in range(n) for p in range(ctx[r])]
    kinds = ["query", "key", "value", "value"] + (["key_cache", "value_cache"] if readable else [])
    poisons = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(kinds))
        if kind.endswith("cache"):
            r, pos = readable[draw(st.integers(0, len(readable) - 1))]
            where = (int(table[r, pos // bs]), pos % bs)
        else:
            where = (draw(st.integers(0, sum(q) - 1)),)
        poisons.append((kind, where, draw(st.integers(0, 7)),
                        draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), 6e4]))))
    return dict(seed=seed, bs=bs, q=q, ctx=ctx, table=table, hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2])),
                num_blocks=int(ids.max()) + 1, poisons=poisons,
                window=draw(st.sampled_from([None, 1, 2, 5])), cap=draw(st.sampled_from([None, 3.0])),
                pad=draw(st.sampled_from([None, "prompts", "sizes"])))


def attending_tokens(case) -> np.ndarray:
    """[T] True for the tokens whose visible keys (or own query) include a poisoned element."""
    q, ctx, table, bs, w = case["q"], case["ctx"], case["table"], case["bs"], case["window"]
    starts = np.cumsum(q) - q
    out = np.zeros(sum(q), bool)
    for kind, where, _, _ in case["poisons"]:
        for r in range(len(q)):
            for j in range(q[r]):
                t, p = starts[r] + j, ctx[r] + j
                lo = 0 if w is None else max(0, p - w + 1)
                if kind == "query":
                    out[t] |= t == where[0]
                elif kind in ("key", "value"):
                    out[t] |= bool(starts[r] <= where[0] <= t and ctx[r] + where[0] - starts[r] >= lo)
                else:
                    out[t] |= any(table[r, pos // bs] == where[0] and pos % bs == where[1]
                                  for pos in range(lo, min(p, ctx[r])))
    return out


def run_poisoned(case, options, dtype, device):
    g = torch.Generator().manual_seed(case["seed"])
    t, hq, hkv, d, bs = sum(case["q"]), case["hq"], case["hkv"], 8, case["bs"]
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    kc, vc = rand(case["num_blocks"], bs, hkv, d), rand(case["num_blocks"], bs, hkv, d)
    bucket = None
    plan = lambda options, bucket=None, device=None: build_unified_batch(
        case["q"], case["ctx"], case["table"], bs, sliding_window=case["window"], num_blocks=case["num_blocks"],
        options=options, bucket=bucket, device=device)
    tiled = plan(on_route(options, "tiles")) if case["pad"] == "sizes" else None
    if case["pad"]:  # rows, tiles, blocks and logits no request owns
        s, kb = (plan(options) if tiled is None else tiled).shape, options.blocks_per_tile(bs)
        grow = dict(query_len=s.query_len + 3, num_causal_tiles=s.num_causal_tiles + 1,
                    num_shared_blocks=s.num_shared_blocks + kb, num_logits=s.num_logits + 1,
                    num_unique_blocks=0 if options.batch_invariant else
                    min(s.num_unique_blocks + 2, case["num_blocks"]))
        if case["pad"] == "prompts" and not options.batch_invariant:  # prompts, rows, context blocks of the route
            grow.update(num_prompts=s.num_prompts + 1, prompt_len=s.prompt_len + 2, prompt_blocks=s.prompt_blocks + 1)
        bucket = Bucket(phase="cs" + ("u" if grow["num_unique_blocks"] else "-"), **grow)
    batch = plan(options, bucket, device)
    tensors = [x.to(device) for x in (q, k, v, kc, vc)]
    clean = unified_attention(*tensors, batch, 0.5, logits_soft_cap=case["cap"])
    if tiled is not None:  # the five sizes alone plan the tiled route: its unpadded plan's result to
        # the dtype's rounding (padded rows change a product's shape; float64 is bitwise: test_attention.py)
        assert batch.shape == tiled.shape
        unpadded = unified_attention(*tensors, tiled.to(device), 0.5, logits_soft_cap=case["cap"])
        torch.testing.assert_close(clean, unpadded)
    for kind, where, head, value in case["poisons"]:
        target = tensors[["query", "key", "value", "key_cache", "value_cache"].index(kind)]
        target[where + (head % target.shape[-2],)] = value
    poisoned = unified_attention(*tensors, batch, 0.5, logits_soft_cap=case["cap"])
    return clean.cpu(), poisoned.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode", sorted(MODES))
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=poisoned_steps())
def test_a_bad_value_reaches_only_the_tokens_that_attend_to_it(case, mode, dtype, device):
    clean, poisoned = run_poisoned(case, MODES[mode], dtype, device)
    assert torch.isfinite(clean).all()
    others = torch.from_numpy(~attending_tokens(case))
    assert torch.isfinite(poisoned[others]).all(), "a bad value leaked into a token that cannot see it"
    # Bitwise on the CPU. On CUDA, fp32 tiles seen on the H100 differed from the clean run in the last bits
    # (5.9e-7 relative) though no bad value reached them: the same call is not bit-reproducible there, so the
    # values are held to the dtype's rounding while finiteness above stays exact.
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    torch.testing.assert_close(poisoned[others], clean[others], **exact)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode", ["default", "gather"])
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=poisoned_steps())
def test_a_bad_value_reaches_only_the_tokens_that_attend_to_it_through_flash(case, mode, dtype):
    """The same property through the fused dispatch (causal, shared and unique flash paths), the
    kernel replaced by its exact CPU stand-in, which multiplies masked zeros by V as flash does (the
    unique path's Triton kernel off: it runs on CUDA or under the interpreter, tests/unique_kernel_cases.py,
    whose caches are poisoned the same way)."""
    import fused_standin

    from vllm_gaudi_unified import attention
    from vllm_gaudi_unified.paths import fused

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "FLASH", fused_standin.flash)
        mp.setattr(fused, "FUSED_UNIQUE_MIN_BLOCK_SIZE", 1)
        mp.setattr(attention, "kernel_for", lambda batch, q, cap: "flash" if cap is None else None)
        mp.setattr(attention, "kernel_unique_applies", lambda kc, vc: False)
        clean, poisoned = run_poisoned(case, MODES[mode], dtype, "cpu")
    assert torch.isfinite(clean).all()
    others = torch.from_numpy(~attending_tokens(case))
    assert torch.isfinite(poisoned[others]).all(), "a bad value leaked into a token that cannot see it"
    torch.testing.assert_close(poisoned[others], clean[others], rtol=0, atol=0)


def test_flash_nan_value_reaches_only_later_rows_of_its_request(monkeypatch):
    """Four new tokens of one request, NaN in the value of token 1: flash's causal mask gives token 0
    a zero weight for it, and 0 * NaN in `P @ V` would make token 0 NaN; only tokens 1..3 may be."""
    import fused_standin

    from vllm_gaudi_unified import attention
    from vllm_gaudi_unified.paths import fused

    monkeypatch.setattr(fused, "FLASH", fused_standin.flash)
    monkeypatch.setattr(attention, "kernel_for", lambda batch, q, cap: "flash")
    for window, want in ((None, [True, False, False, False]), (2, [True, False, False, True])):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(4, h, 8, generator=g).half() for h in (2, 1, 1))
        kc, vc = torch.zeros(2, 4, 1, 8).half(), torch.zeros(2, 4, 1, 8).half()
        v[1] = float("nan")
        batch = build_unified_batch([4], [0], [[1]], 4, sliding_window=window)
        finite = torch.isfinite(unified_attention(q, k, v, kc, vc, batch, 0.5)).flatten(1).all(1)
        assert finite.tolist() == want


def test_issue_example_nan_value_in_a_shared_causal_tile():
    """query_lens [1, 3, 1], context_lens [4, 0, 4], NaN in value of token 2:
    only tokens 2 and 3 may see it (tokens 0..3 share one causal tile)."""
    for options in (PlanOptions(causal_tile=4), MODES["invariant"]):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(5, h, 4, generator=g) for h in (2, 1, 1))
        kc, vc = torch.randn(3, 4, 1, 4, generator=g), torch.randn(3, 4, 1, 4, generator=g)
        v[2] = float("nan")
        batch = build_unified_batch([1, 3, 1], [4, 0, 4], [[1], [0], [2]], 4, options=options)
        finite = torch.isfinite(unified_attention(q, k, v, kc, vc, batch, 0.5)).flatten(1).all(1)
        assert finite.tolist() == [True, True, False, False, True]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [2, 16])
def test_a_bad_shared_value_makes_exactly_its_readers_nan(rows, dtype, monkeypatch):
    """Four decodes share two full blocks (the shared path's tiles), a fifth reads its own; unused slots of
    every block hold NaN. A NaN or inf in one shared slot's value turns exactly the four sharers NaN (as
    the reference does: their output is not a number) and leaves the fifth bit-equal to the clean run."""
    from conftest import record_calls

    from vllm_gaudi_unified.paths import shared

    calls = record_calls(monkeypatch, shared, "attend_heads")
    table = np.array([[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5], [6, 7, 8]])
    options = PlanOptions(shared_rows=rows, shared_rows_max=rows, shared_tile_keys=8)
    batch = build_unified_batch([1] * 5, [9] * 5, table, 4, options=options)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, 8, generator=g).to(dtype) for h in (4, 2, 2))
    kc, vc = (torch.randn(9, 4, 2, 8, generator=g).to(dtype) for _ in range(2))
    for c in (kc, vc):
        c[[2, 3, 4, 5, 8], 2:] = float("nan")  # slots 10, 11 of each request's last block: never written
    clean = unified_attention(q, k, v, kc, vc, batch, 0.5)
    for bad in (float("nan"), float("inf")):
        poisoned = vc.clone()
        poisoned[1, 2, 1, 3] = bad
        out = unified_attention(q, k, v, kc, poisoned, batch, 0.5)
        assert torch.isfinite(clean).all() and calls
        assert torch.isnan(out[:4, 2:]).all() and torch.isfinite(out[:4, :2]).all()  # KV head 1's queries only
        torch.testing.assert_close(out[4], clean[4], rtol=0, atol=0)


# ----------------------------------------------------------------------------- 2. fp16 range


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("step", [([40], [0]), ([1], [64]), ([8], [32]), ([1, 1], [64, 64])],
                         ids=["prefill", "decode", "chunk", "shared-decode"])
def test_fp16_scores_do_not_overflow(step, mode, device):
    """q = k = 24 at head_dim 128: q.k = 73728 > 65504, yet the scaled scores are small (finding 2)."""
    d, bs = 128, 16
    ql, cl = step
    table = np.array([[1, 2, 3, 4]] * len(ql))
    opts = PlanOptions(batch_invariant=mode == "invariant")
    batch = build_unified_batch(ql, cl, table, bs, options=opts, device=device)
    g = torch.Generator().manual_seed(1)
    t = sum(ql)
    q = (24 + torch.rand(t, 2, d, generator=g)).half()
    k = (24 + torch.rand(t, 1, d, generator=g)).half()
    kc = (24 + torch.rand(5, bs, 1, d, generator=g)).half()
    v, vc = torch.randn(t, 1, d, generator=g).half(), torch.randn(5, bs, 1, d, generator=g).half()
    out = unified_attention(*(x.to(device) for x in (q, k, v, kc, vc)), batch, d ** -0.5).cpu()
    ref = reference_attention(q, k, v, kc, vc, ql, cl, table, d ** -0.5)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("mode", ["default", "invariant"])
def test_fp16_weighted_value_sums_do_not_overflow(mode):
    """512 equal scores and values of 300: sum p.v = 153600 > 65504 in one shared tile, result 300."""
    d, bs = 16, 16
    table = np.array([list(range(1, 33))] * 2)
    batch = build_unified_batch([4, 4], [512, 512], table, bs, options=PlanOptions(batch_invariant=mode == "invariant"))
    q, k = torch.zeros(8, 2, d).half(), torch.zeros(8, 1, d).half()
    v, kc, vc = torch.full((8, 1, d), 300.0).half(), torch.zeros(40, bs, 1, d).half(), torch.full((40, bs, 1, d), 300.0).half()
    out = unified_attention(q, k, v, kc, vc, batch, 0.25)
    torch.testing.assert_close(out.float(), torch.full_like(out.float(), 300.0))


# ----------------------------------------------------------------------------- 3. accepted limits


def _small_case(mode="default", hq=4):
    g = torch.Generator().manual_seed(3)
    ql, cl, table = [3, 1], [5, 9], np.array([[1, 2, 3], [4, 5, 6]])
    q, k, v = torch.randn(4, hq, 8, generator=g), torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    kc, vc = torch.randn(7, 4, 2, 8, generator=g), torch.randn(7, 4, 2, 8, generator=g)
    batch = build_unified_batch(ql, cl, table, 4, options=MODES[mode])
    return (q, k, v, kc, vc, batch), (ql, cl, table)


@pytest.mark.parametrize("mode", ["default", "invariant"])
def test_infinite_soft_cap_is_no_cap(mode):
    """cap * tanh(s / cap) -> s as cap -> inf: `logits_soft_cap=inf` is the same as None (docs/usage.md)."""
    args, _ = _small_case(mode)
    out = unified_attention(*args, 0.5, logits_soft_cap=float("inf"))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, unified_attention(*args, 0.5), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["default", "invariant"])
def test_infinite_sinks_are_their_limits(mode):
    """A +inf sink takes all the weight (output 0 on that head); a -inf sink is no sink."""
    args, (ql, cl, table) = _small_case(mode)
    sinks = torch.tensor([float("inf"), float("-inf"), 0.5, -2.0])
    out = unified_attention(*args, 0.5, sinks=sinks)
    assert torch.isfinite(out).all()
    assert (out[:, 0] == 0).all()
    q, k, v, kc, vc, _ = args
    ref = reference_attention(q, k, v, kc, vc, ql, cl, table, 0.5, sinks=torch.tensor([0.0, -1e300, 0.5, -2.0]))
    torch.testing.assert_close(out[:, 1:].double(), ref[:, 1:], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- 4. huge values


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("big", [2**31 + 7, 2**32 + 15, 2**62, 2**63 - 1])
def test_plan_memory_does_not_grow_with_the_largest_block_id(big, mode):
    """Finding 4: bincount / slot arrays sized by the largest id took 16 GiB for id 2**31 + 7."""
    table = np.array([[3, big], [big, 5], [7, 8]], dtype=np.int64)
    opts = PlanOptions(batch_invariant=mode == "invariant")
    peak = _peak_bytes(lambda: build_unified_batch([1, 2, 1], [8, 8, 8], table, 4, options=opts))
    assert peak < 4 << 20
    batch = build_unified_batch([1, 2, 1], [8, 8, 8], table, 4, options=opts)
    assert batch.max_block_id == big
    p = batch.plan
    routes = ([np.concatenate([p.dec_blocks.ravel(), p.pre_blocks.ravel()]),
               np.concatenate([p.slot_blocks, p.ctx_blocks])] if mode == "invariant"
              else [np.concatenate([p.shared_blocks.ravel(), p.unique_blocks])])
    for ids in routes:  # invariant: the tile route's and the fast route's arrays
        assert big in set(int(x) for x in ids), "a block id was truncated"


def test_invariant_mode_does_not_truncate_block_ids_to_32_bits():
    """Block 2**32 + 15 planned as block 15 read the wrong cache block silently."""
    batch = build_unified_batch([1], [4], [[2**32 + 15]], 4, options=PlanOptions(batch_invariant=True))
    assert int(batch.dec_blocks[0, 0]) == int(batch.slot_blocks[0]) == 2**32 + 15
    args = (torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(16, 4, 1, 4),
            torch.zeros(16, 4, 1, 4))
    with pytest.raises(ValueError, match="block id 4294967311 but key_cache has 16 blocks"):
        unified_attention(*args, batch, 0.5)


def test_forced_slice_layout_with_a_huge_block_id_is_refused():
    with pytest.raises(ValueError, match=r"unique_layout='slice'.*2199023255552"):
        build_unified_batch([1], [4], [[2**41]], 4, options=PlanOptions(unique_layout="slice"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(query_lens=[2**40]), r"sum\(query_lens\) = 1099511627776 .* at most"),
    (dict(query_lens=[2**20] * 2**5), r"sum\(query_lens\) = 33554432 .* at most"),
    (dict(context_lens=[2**40]), r"context_lens\[0\] = 1099511627776"),
    (dict(query_lens=[2**62, 2**62, 2**62]), r"sum\(query_lens\)"),
])
def test_dangerous_magnitudes_are_refused_at_once(kwargs, match):
    args = dict(query_lens=[1] * len(kwargs.get("query_lens", kwargs.get("context_lens", [1]))),
                context_lens=[0] * len(kwargs.get("query_lens", kwargs.get("context_lens", [1]))))
    args.update(kwargs)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        build_unified_batch(args["query_lens"], args["context_lens"], np.zeros((len(args["query_lens"]), 1), int), 4)
    assert time.perf_counter() - t0 < 1.0


def test_many_causal_tiles_are_refused_before_they_are_listed():
    """A 2**20-token prompt at causal_tile 1 needs 2**39 tiles: refused, never a MemoryError (on the
    tiled route; the prompt route plans it as one row of 2**20 tokens)."""
    with pytest.raises(ValueError, match="causal tiles"):
        build_unified_batch([2**20], [0], [[0]], 4, options=PlanOptions(causal_tile=1, prompt_route="tiles"))
    plan = build_unified_batch([2**20], [0], [[0]], 4, options=PlanOptions(causal_tile=1)).plan
    assert plan.bucket.prompts == (1, 2**20, 0) and plan.bucket.num_causal_tiles == 0


# ----------------------------------------------------------------------------- 5. validation


TABLE = np.array([[0, 1, 2], [3, 4, 5]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=True), "block_size must be an int >= 1, got True"),
    (dict(block_size=np.bool_(True)), "block_size must be an int >= 1, got True"),
    (dict(block_size=4.0), "block_size must be an int >= 1, got 4.0"),
    (dict(sliding_window=True), "sliding_window must be None or an int >= 1, got True"),
    (dict(num_blocks=True), "num_blocks must be None or an int >= 1, got True"),
    (dict(options="fast"), "options must be a PlanOptions or None, got 'fast'"),
    (dict(bucket="x"), "bucket must be a Bucket, a bucket plan .* or None, got 'x'"),
    (dict(query_lens=[[1], [1, 2]]), "query_lens must be a 1-D sequence of integers"),
    (dict(query_lens=[True, True]), "query_lens must hold integers, got dtype bool"),
    (dict(context_lens=np.array([2**63 + 5, 0], dtype=np.uint64)), r"context_lens\[0\] = 9223372036854775813"),
    (dict(query_lens=np.array([2**64 - 1, 1], dtype=np.uint64)), r"query_lens\[0\] = 18446744073709551615"),
    (dict(block_table=[[0, 1, 2], [3]]), "block_table must be a 2-D table of integers"),
    (dict(block_table=np.array([[0, 1, 2], [3, 2**63 + 1, 5]], dtype=np.uint64)),
     r"block_table\[1, 1\] = 9223372036854775809"),
    (dict(block_table=[[0, 1, 2], [3, "4", 5]]), "block_table must hold integers"),
])
def test_bad_steps(kwargs, match):
    args = dict(query_lens=[1, 1], context_lens=[4, 5], block_table=TABLE, block_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_unified_batch(**args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(causal_tile=True), "PlanOptions.causal_tile must be an int in \\[1, 4096\\], got True"),
    (dict(shared_rows=np.bool_(True)), "PlanOptions.shared_rows must be an int in"),
    (dict(causal_tile=2**40), "PlanOptions.causal_tile must be an int in \\[1, 4096\\], got 1099511627776"),
    (dict(shared_tile_keys=2**40), "PlanOptions.shared_tile_keys must be an int in"),
    (dict(invariant_chunk=2**40), "PlanOptions.invariant_chunk must be an int in"),
    (dict(batch_invariant="false"), "PlanOptions.batch_invariant must be a bool, got 'false'"),
    (dict(batch_invariant=1), "PlanOptions.batch_invariant must be a bool, got 1"),
    (dict(slice_min_density=float("nan")), "PlanOptions.slice_min_density must be a float in"),
    (dict(slice_min_density=True), "PlanOptions.slice_min_density must be a float in"),
    (dict(unique_layout=["slice"]), "PlanOptions.unique_layout must be one of"),
])
def test_bad_plan_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanOptions(**kwargs)


def _tensors(t=2, hq=4, hkv=2, d=8, nb=6, bs=4):
    return dict(query=torch.randn(t, hq, d), key=torch.randn(t, hkv, d), value=torch.randn(t, hkv, d),
                key_cache=torch.randn(nb, bs, hkv, d), value_cache=torch.randn(nb, bs, hkv, d))


@pytest.mark.parametrize("changes, match", [
    (dict(query=torch.randn(2, 0, 8)), "query has 0 heads"),
    (dict(_t=dict(hq=0, hkv=0)), "query has 0 heads"),
    (dict(_t=dict(d=0)), "head_dim 0"),
    (dict(scale=True), "scale must be a finite positive float, got True"),
    (dict(scale=float("inf")), "scale must be a finite positive float, got inf"),
    (dict(logits_soft_cap=True), "logits_soft_cap must be None or a positive float, got True"),
    (dict(logits_soft_cap=float("nan")), "logits_soft_cap must be None or a positive float, got nan"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap must be None or a positive float, got 0.0"),
    (dict(sinks=torch.zeros(4, device="meta")), "sinks are on meta but the query is on cpu"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64)), "sinks must be a floating-point tensor, got torch.int64"),
    (dict(sinks=[0.0] * 4), r"sinks must be a tensor of shape \(4,\)"),
    (dict(query=torch.randn(2, 4, 8, dtype=torch.float64).to(torch.int64), key=torch.zeros(2, 2, 8, dtype=torch.int64),
          value=torch.zeros(2, 2, 8, dtype=torch.int64), key_cache=torch.zeros(6, 4, 2, 8, dtype=torch.int64),
          value_cache=torch.zeros(6, 4, 2, 8, dtype=torch.int64)), "query dtype must be floating point"),
])
def test_bad_attention_arguments(changes, match):
    changes = dict(changes)
    args = _tensors(**changes.pop("_t", {}))
    args.update(batch=build_unified_batch([1, 1], [4, 5], TABLE, 4), scale=0.5)
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        unified_attention(**args)


def test_bucket_sizes_are_not_booleans():
    with pytest.raises(ValueError, match="Bucket.query_len must be a non-negative int, got True"):
        Bucket(phase="--u", query_len=True, num_shared_blocks=0, num_unique_blocks=1, num_logits=1)


def test_a_huge_bucket_is_refused_before_padding():
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="query_len 1099511627776 is beyond the largest accepted"):
        build_unified_batch([1], [4], [[1]], 4, bucket=Bucket("--u", 2**40, 0, 1, 1))
    with pytest.raises(ValueError, match="num_unique_blocks 1099511627776 is beyond"):
        build_unified_batch([1], [4], [[1]], 4, bucket=Bucket("--u", 1, 0, 2**40, 1))
    with pytest.raises(ValueError, match="num_shared_blocks 1099511627776 is beyond"):
        build_unified_batch([1], [4], [[1]], 4, bucket=Bucket("-s-", 1, 2**40, 0, 1),
                            options=PlanOptions(batch_invariant=True))
    assert time.perf_counter() - t0 < 1.0
