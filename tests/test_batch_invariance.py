"""Batch invariance: one request alone and inside other batches gives the same bits.

The request under test (the *target*) keeps its own new tokens, its own cache
contents and its own options; what changes is everything else: the other
requests, the target's position, which of its cached blocks other requests
share (so the default planner classes them shared instead of unique), the
bucket the step is padded to, and so where the flattened causal tiles cut.
Outputs are compared with `torch.equal`.

The default mode is expected to fail exactly this comparison where its
reduction order depends on the batch (prefix sharing, request offset); those
cases are tested too, so these tests can tell the two modes apart. Devices:
the CPU, and CUDA when present (run on the GPU machine the same way).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run_interpreted
from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch, pad_plan, plan_step, unified_attention
from vllm_gaudi_unified.bucket import phase_of
from vllm_gaudi_unified.reference import reference_attention

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16]
#: Small tiles so that small steps cross tile, unit and call boundaries.
SMALL = PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8)
#: `unique_tokens` 3: requests of 2-3 new tokens over a context are verify units on the fast route.
INVARIANT = replace(SMALL, batch_invariant=True, invariant_rows=2, invariant_chunk=3, invariant_causal_chunk=2,
                    unique_tokens=3)
EXAMPLES = int(os.environ.get("INVARIANCE_EXAMPLES", "40"))


@dataclass(frozen=True)
class Req:
    query_len: int
    context_len: int
    share: int = 0  #: leading cache blocks that are the target's own (a common prefix)


@dataclass(frozen=True)
class World:
    """The target and the batch around it; every tensor is built from `seed`."""

    target: Req
    others: tuple = ()
    position: int = 0  #: the target's index in the batch
    block_size: int = 4
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    pad: tuple = (0, 0, 0, 0, 0)  #: extra (query_len, causal tiles, shared blocks, unique blocks, logits) of the bucket
    seed: int = 0

    @property
    def requests(self) -> list:
        return list(self.others[:self.position]) + [self.target] + list(self.others[self.position:])


def _block_table(world: World, rng: np.random.Generator):
    reqs, bs, t = world.requests, world.block_size, world.position
    need = [-(-(r.context_len + r.query_len) // bs) for r in reqs]
    num_blocks = sum(need) + 9
    free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0: the null block
    table = np.full((len(reqs), max(need) + 2), -1, np.int64)
    table[t, :need[t]] = [free.pop() for _ in range(need[t])]
    for r, req in enumerate(reqs):
        if r != t:
            assert req.share * bs <= min(req.context_len, world.target.context_len)
            table[r, :need[r]] = [table[t, i] if i < req.share else free.pop() for i in range(need[r])]
    return table, num_blocks


def _tensors(world: World, table: np.ndarray, num_blocks: int, dtype, device):
    """Caches (unreadable slots poisoned) and q/k/v, the target's drawn from its own generator."""
    hq, hkv, d, bs = world.num_qo_heads, world.num_kv_heads, world.head_dim, world.block_size
    g = torch.Generator().manual_seed(world.seed)
    rand = lambda *shape, gen=g: torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)
    kc, vc = rand(num_blocks, bs, hkv, d), rand(num_blocks, bs, hkv, d)
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for r, req in enumerate(world.requests):
        for pos in range(req.context_len):
            readable[table[r, pos // bs], pos % bs] = True
    kc[~readable], vc[~readable] = float("nan"), float("inf")
    gt = torch.Generator().manual_seed(world.seed + 1)
    tq = world.target.query_len
    target = (rand(tq, hq, d, gen=gt), rand(tq, hkv, d, gen=gt), rand(tq, hkv, d, gen=gt))
    parts = {name: [] for name in "qkv"}
    for r, req in enumerate(world.requests):
        if r == world.position:
            new = target
        else:
            new = (rand(req.query_len, hq, d), rand(req.query_len, hkv, d), rand(req.query_len, hkv, d))
        for name, x in zip("qkv", new):
            parts[name].append(x)
    q, k, v = (torch.cat(parts[n]) for n in "qkv")
    sinks = torch.randn(hq, generator=gt) if world.sinks else None
    move = lambda x: None if x is None else x.to(device)
    return [move(x) for x in (q, k, v, kc, vc, sinks)] + [[move(x) for x in target]]


def _padded_bucket(shape: Bucket, pad: tuple) -> Bucket:
    q, c, s, u, n = (a + b for a, b in zip((shape.query_len, shape.num_causal_tiles, shape.num_shared_blocks,
                                            shape.num_unique_blocks, shape.num_logits), pad))
    return Bucket(phase_of(c, s, u), q, s, u, n, c)


def _pad_multiple(options: PlanOptions, block_size: int, pad: tuple) -> tuple:
    """Default-mode buckets need whole shared tiles."""
    if options.batch_invariant:
        return pad
    kb = options.blocks_per_tile(block_size)
    return pad[:2] + (pad[2] * kb,) + pad[3:]


def run_world(world: World, options: PlanOptions, dtype, device="cpu"):
    """-> (target alone, target inside the batch), each `[query_len, Hq, D]`."""
    rng = np.random.default_rng(world.seed)
    table, num_blocks = _block_table(world, rng)
    q, k, v, kc, vc, sinks, (tq, tk, tv) = _tensors(world, table, num_blocks, dtype, device)
    kw = dict(sliding_window=world.sliding_window, num_blocks=num_blocks, options=options, device=device)
    attn = dict(logits_soft_cap=world.soft_cap, sinks=sinks)
    t, bs = world.position, world.block_size
    alone_batch = build_unified_batch([world.target.query_len], [world.target.context_len], table[t:t + 1], bs, **kw)
    alone = unified_attention(tq, tk, tv, kc, vc, alone_batch, 0.37, **attn)
    reqs = world.requests
    query_lens, context_lens = [r.query_len for r in reqs], [r.context_len for r in reqs]
    bucket = None
    if any(world.pad):
        shape = plan_step(query_lens, context_lens, table, bs, sliding_window=world.sliding_window,
                          options=options).shape
        bucket = _padded_bucket(shape, _pad_multiple(options, bs, world.pad))
    batch = build_unified_batch(query_lens, context_lens, table, bs, bucket=bucket, **kw)
    out = unified_attention(q, k, v, kc, vc, batch, 0.37, **attn)
    start = sum(query_lens[:t])
    return alone, out[start:start + world.target.query_len]


def assert_same_bits(alone: torch.Tensor, inside: torch.Tensor):
    assert torch.isfinite(alone).all(), "a poisoned cache slot was read"
    if not torch.equal(alone, inside):
        diff = (alone.double() - inside.double()).abs()
        raise AssertionError(f"{int((diff > 0).sum())} of {diff.numel()} values differ, max {float(diff.max()):.3g}")


# ----------------------------------------------------------------------------- named scenarios

#: name -> world. Each varies one thing; the first three are where the default mode's computation of the
#: target changes with its batch (hazards 1 and 2 of plan/invariant.py).
SCENARIOS = {
    # The target's context is a prefix three decodes share: shared tiles instead of per-block partials.
    "shared_prefix_decode": World(Req(1, 61), others=(Req(1, 64, 15), Req(1, 70, 15), Req(1, 61, 15)), position=2,
                                  head_dim=32),
    # A prompt chunk over a shared prefix next to other chunks over the same prefix.
    "shared_prefix_prefill": World(Req(9, 32), others=(Req(9, 32, 8), Req(5, 40, 8)), position=1, head_dim=32),
    # A prefill after an odd-length request: the flattened causal tiles cut it elsewhere.
    "offset_prefill": World(Req(45, 0), others=(Req(3, 0), Req(2, 9)), position=2, head_dim=32),
    # Unrelated decodes around a decode, padded to a larger bucket.
    "padded_decode": World(Req(1, 37), others=(Req(1, 20), Req(1, 5)), position=1, pad=(3, 2, 2, 5, 2)),
    # A chunked prefill with a sliding window among others, position 0.
    "window_chunk": World(Req(13, 22), others=(Req(2, 7), Req(6, 0)), sliding_window=9),
    # Soft cap and sinks, target last.
    "softcap_sinks": World(Req(6, 18), others=(Req(4, 18, 2), Req(1, 3)), position=2, soft_cap=5.0, sinks=True),
    # MQA and a bucket with extra causal tiles and rows.
    "mqa_padded": World(Req(7, 10), others=(Req(5, 12),), position=1, num_qo_heads=6, num_kv_heads=1,
                        pad=(5, 3, 1, 0, 1)),
    # Prompt chunks on their own calls (the split form over a context the next chunk shares), beside a
    # prompt without context (its own causal call), a decode and a short chunk on the routes, padded.
    "own_calls": World(Req(20, 29), others=(Req(17, 32, 7), Req(1, 40, 7), Req(24, 0), Req(2, 9)), position=1,
                       pad=(4, 1, 2, 0, 1)),
    # A verify step (3 tokens over a context, a unit on the fast route) beside verify steps over the same
    # prefix, a longer chunk, decodes and prompts, padded.
    # Decodes over the target's whole chunks (parallel sampling: five readers of each chunk), one of them
    # sharing only the first chunks, beside a short chunk over a shorter prefix.
    "sampling_decodes": World(Req(1, 45), others=(Req(1, 45, 11), Req(1, 47, 11), Req(1, 45, 11), Req(1, 30, 4),
                                                 Req(3, 20, 2)), position=2, head_dim=16),
    "verify_units": World(Req(3, 37), others=(Req(2, 37, 6), Req(1, 41, 9), Req(3, 12), Req(7, 0), Req(1, 9),
                                              Req(5, 0), Req(6, 30, 3)), position=3, pad=(3, 2, 1, 0, 2)),
    # The same with a wider head: the units take the one-row form with their rows stacked (3 x 4 heads <= 16).
    "verify_units_stacked": World(Req(3, 37), others=(Req(2, 37, 6), Req(1, 41, 9), Req(3, 12), Req(7, 0), Req(1, 9),
                                                      Req(5, 0), Req(6, 30, 3)), position=3, pad=(3, 2, 1, 0, 2),
                                  head_dim=16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_invariant_mode_scenarios(name, dtype, device, torch_threads):
    """Same bits with torch's own thread count too (its products split work over threads by shape)."""
    world = SCENARIOS[name]
    assert_same_bits(*run_world(world, INVARIANT, dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [INVARIANT, replace(INVARIANT, invariant_rows=1, invariant_chunk=1,
                                                        invariant_causal_chunk=1, causal_tile=8),
                                     replace(PlanOptions(batch_invariant=True), causal_tile=16)],
                         ids=["small", "ones", "defaults"])
def test_invariant_mode_matches_reference(options, device):
    """The invariant mode computes attention (float64, every named scenario, against the dense reference)."""
    for world in SCENARIOS.values():
        rng = np.random.default_rng(world.seed)
        table, num_blocks = _block_table(world, rng)
        q, k, v, kc, vc, sinks, _ = _tensors(world, table, num_blocks, torch.float64, device)
        reqs = world.requests
        ql, cl = [r.query_len for r in reqs], [r.context_len for r in reqs]
        batch = build_unified_batch(ql, cl, table, world.block_size, sliding_window=world.sliding_window,
                                    num_blocks=num_blocks, options=options, device=device)
        out = unified_attention(q, k, v, kc, vc, batch, 0.37, logits_soft_cap=world.soft_cap, sinks=sinks)
        ref = reference_attention(q, k, v, kc, vc, ql, cl, table, 0.37, sliding_window=world.sliding_window,
                                  logits_soft_cap=world.soft_cap, sinks=sinks)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.cpu(), ref, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- random batches


@st.composite
def worlds(draw, sharing: bool):
    bs = draw(st.sampled_from([2, 4, 8]))
    target = Req(draw(st.integers(1, 20)), draw(st.integers(0, 40)))
    others = []
    for _ in range(draw(st.integers(0 if not sharing else 1, 6))):
        other = Req(draw(st.integers(1, 12)), draw(st.integers(0, 40)))
        if sharing:
            most = min(target.context_len, other.context_len) // bs
            other = replace(other, share=draw(st.integers(0, most)))
        others.append(other)
    heads = draw(st.sampled_from([(4, 2), (4, 4), (6, 1), (8, 2)]))
    pad = draw(st.sampled_from([(0, 0, 0, 0, 0), (3, 1, 2, 0, 1), (1, 4, 7, 3, 2)]))
    return World(target, tuple(others), position=draw(st.integers(0, len(others))), block_size=bs,
                 num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim=draw(st.sampled_from([8, 16])),
                 sliding_window=draw(st.sampled_from([None, None, 6, 17])),
                 soft_cap=draw(st.sampled_from([None, 4.0])), sinks=draw(st.booleans()), pad=pad,
                 seed=draw(st.integers(0, 2**16)))


@st.composite
def invariant_options(draw):
    return replace(PlanOptions(batch_invariant=True), causal_tile=draw(st.sampled_from([2, 4, 8, 64])),
                   invariant_rows=draw(st.sampled_from([1, 2, 4, 8])),
                   invariant_chunk=draw(st.sampled_from([1, 3, 8, 512])),
                   invariant_causal_chunk=draw(st.sampled_from([1, 2, 16])),
                   unique_tokens=draw(st.sampled_from([1, 2, 4])),
                   shared_tile_keys=draw(st.sampled_from([8, 16, 512])))  # small: whole chunks shared


@st.composite
def sibling_worlds(draw):
    """A decode among decodes that share some of its blocks (parallel sampling, a common prompt), beside a
    few other requests (parallel sampling, a common prompt; with small chunks, whole chunks shared)."""
    world = draw(worlds(False))
    bs = world.block_size
    target = Req(1, draw(st.integers(2 * bs, 60)))
    siblings = tuple(Req(1, draw(st.integers(share * bs, 64)), share)
                     for share in draw(st.lists(st.integers(1, target.context_len // bs), min_size=1, max_size=9)))
    others = siblings + world.others[:2]
    return replace(world, target=target, others=others, position=draw(st.integers(0, len(others))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("sharing", [False, True], ids=["no_sharing", "prefix_sharing"])
def test_invariant_mode_random_batches(sharing, dtype, device):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(world=worlds(sharing), options=invariant_options())
    def check(world, options):
        assert_same_bits(*run_world(world, options, dtype, device))

    check()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_invariant_mode_random_siblings(dtype, device):
    """Random decodes sharing the target's blocks."""
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(world=sibling_worlds(), options=invariant_options())
    def check(world, options):
        assert_same_bits(*run_world(world, options, dtype, device))

    check()


# ----------------------------------------------------------------------------- plan and routing


def test_invariant_plan_does_not_depend_on_the_batch():
    """Every visible (token, block) pair is one Triton slot of a one-token request, once; every
    (token, chunk) one tile row, once, a decode's tile has one row; the context of a request with
    several tokens is one flash segment; each request's new tokens one causal segment."""
    world = SCENARIOS["shared_prefix_prefill"]
    world = replace(world, others=world.others + (Req(1, 61, 2), Req(1, 30), Req(1, 33, 2)))
    table, _ = _block_table(world, np.random.default_rng(0))
    reqs = world.requests
    ql, cl, bs = [r.query_len for r in reqs], [r.context_len for r in reqs], world.block_size
    plan = plan_step(ql, cl, table, bs, options=INVARIANT)
    assert plan.bucket.num_unique_blocks == 0 and plan.dec_rows.shape[1] == 1
    assert plan.pre_rows.shape[1] == INVARIANT.invariant_rows
    kb = INVARIANT.blocks_per_tile(bs)
    starts = np.cumsum(ql) - ql
    decodes = [r for r, q in enumerate(ql) if q == 1]
    slots = sorted(zip(plan.slot_rows.tolist(), plan.slot_blocks.tolist()))
    assert slots == sorted((starts[r], table[r, b]) for r in decodes for b in range(-(-cl[r] // bs)))
    assert (np.diff(plan.slot_rows) >= 0).all()
    kinds = ((plan.dec_rows, plan.dec_col), (plan.unit_rows, plan.unit_col), (plan.pre_rows, plan.pre_col),
             (plan.share_rows.ravel()[:, None], plan.share_col.ravel()))  # the two decodes' shared first chunk
    assert (plan.share_rows < plan.num_tokens).sum() == 2 and plan.share_blocks.tolist() == [table[1, :kb].tolist()]
    for rows, real in ((plan.share_rows, plan.share_real), (plan.dec_rows[:plan.dec_whole, 0], plan.dec_real[:1]),
                       (plan.dec_rows[plan.dec_whole:, 0], plan.dec_real[1:])):  # real rows first, counted
        rows = rows.reshape(len(real), -1)
        assert [int((r < plan.num_tokens).sum()) for r in rows] == list(real)
        assert all((r[:n] < plan.num_tokens).all() for r, n in zip(rows, real))
    for rows, cols in kinds:
        real = rows < plan.num_tokens
        pairs = sorted(zip(rows[real].tolist(), np.broadcast_to(cols[:, None], rows.shape)[real].tolist()))
        assert len(pairs) == len(set(pairs)), "a (token, chunk) pair is computed twice"
    tiles = {(t, c) for rows, cols in kinds
             for t, c in zip(rows.ravel().tolist(), np.broadcast_to(cols[:, None], rows.shape).ravel().tolist())
             if t < plan.num_tokens}
    assert tiles == {(starts[r] + j, c) for r in range(len(reqs)) for j in range(ql[r])
                     for c in range(-(-cl[r] // (bs * kb)))}
    several = [r for r, q in enumerate(ql) if q > 1 and cl[r] > 0]
    assert plan.ctx_rows.tolist() == [starts[r] + j for r in several for j in range(ql[r])]
    assert plan.ctx_used.tolist() == [cl[r] for r in several]
    multi = [r for r, q in enumerate(ql) if q > 1 and not (q <= INVARIANT.unique_tokens and cl[r] > 0)]  # not units
    assert sorted(plan.seg_rows.tolist()) == [starts[r] + j for r in multi for j in range(ql[r])]
    assert plan.seg_cu.tolist() == [0] + np.cumsum([ql[r] for r in multi]).tolist() and plan.seg_max == max(ql)
    assert plan.one_rows.tolist() == [starts[r] for r in decodes]
    assert plan.cached_width == 16  # 61 tokens of context / 4 -> 16 blocks -> 8 chunks of 2, and the self pair


def test_verify_steps_are_units():
    """A request of 2 to `unique_tokens` new tokens over a context has its (token, block) slots once, on its
    first token (the kernel's program there takes all its rows), and no flash context segment; longer chunks
    keep theirs, decodes their own slots; under a sliding window every token has its own slots (units of 1)."""
    world = SCENARIOS["verify_units"]
    table, _ = _block_table(world, np.random.default_rng(world.seed))
    ql, cl, bs = [r.query_len for r in world.requests], [r.context_len for r in world.requests], world.block_size
    starts = np.cumsum(ql) - ql
    plan = plan_step(ql, cl, table, bs, options=INVARIANT)
    units = [r for r in range(len(ql)) if 2 <= ql[r] <= INVARIANT.unique_tokens and cl[r] > 0]
    decodes = [r for r in range(len(ql)) if ql[r] == 1]
    assert units == [0, 2, 3] and plan.slot_units == INVARIANT.unique_tokens
    slots = sorted(zip(plan.slot_rows.tolist(), plan.slot_blocks.tolist()))
    assert slots == sorted((starts[r], table[r, b]) for r in units + decodes for b in range(-(-cl[r] // bs)))
    chunks = [r for r in range(len(ql)) if ql[r] > INVARIANT.unique_tokens and cl[r] > 0]
    assert plan.ctx_rows.tolist() == [starts[r] + j for r in chunks for j in range(ql[r])]
    # a unit's new keys are its program's too: no causal flash segment
    assert not set(plan.seg_rows.tolist()) & {starts[r] + j for r in units for j in range(ql[r])}
    # the tile route: a unit's rows are one tile of `unique_tokens` rows per chunk of its context
    kb = INVARIANT.blocks_per_tile(bs)
    real = (plan.unit_rows < plan.num_tokens).any(1)
    assert plan.unit_rows.shape[1] == INVARIANT.unique_tokens
    assert sorted((tuple(r[r < plan.num_tokens].tolist()), c) for r, c in zip(plan.unit_rows[real],
                                                                             plan.unit_col[real].tolist())) == \
        sorted((tuple(range(starts[r], starts[r] + ql[r])), c) for r in units for c in range(-(-cl[r] // (bs * kb))))
    assert not set(plan.pre_rows[plan.pre_rows < plan.num_tokens].tolist()) & \
        {starts[r] + j for r in units for j in range(ql[r])}
    # the fast route's host arrays: where each token's slots start, the tokens whose programs take new keys
    # (one-token requests, a unit's first token), the most slots of a token; padding adds tokens without any
    assert plan.slot_starts.tolist() == np.searchsorted(plan.slot_rows, np.arange(plan.num_tokens + 1)).tolist()
    assert np.flatnonzero(plan.slot_take).tolist() == sorted(starts[r] for r in units + decodes)
    assert plan.slot_most == max(-(-cl[r] // bs) for r in units + decodes)
    padded = pad_plan(plan, _padded_bucket(plan.shape, (3, 0, 0, 0, 0)))
    assert padded.slot_starts.tolist() == plan.slot_starts.tolist() + [plan.slot_rows.size] * 3
    assert padded.slot_take.tolist() == plan.slot_take.tolist() + [0] * 3
    windowed = plan_step(ql, cl, table, bs, sliding_window=9, options=INVARIANT)
    assert windowed.slot_units == 1
    assert sorted(set(windowed.slot_rows.tolist())) == [starts[r] + j for r in range(len(ql)) if cl[r] > 0
                                                        for j in range(ql[r])]


def test_own_calls_are_taken(monkeypatch):
    """Prompts (no context) and chunks of `CALL_MIN_ROWS` tokens or more take their own calls (two fused calls
    with statistics for a chunk, one causal one for a prompt); a short chunk and a decode stay on the routes;
    with a soft cap the same requests' pairs run on the routes' arrays (no own call)."""
    from vllm_gaudi_unified.paths import fused

    world = SCENARIOS["own_calls"]
    seen = []
    inner = fused.sdpa_lse
    monkeypatch.setattr(fused, "sdpa_lse", lambda *a, **kw: seen.append(kw.get("causal", False)) or inner(*a, **kw))
    table, _ = _block_table(world, np.random.default_rng(world.seed))
    ql, cl = [r.query_len for r in world.requests], [r.context_len for r in world.requests]
    plan = plan_step(ql, cl, table, world.block_size, options=INVARIANT)
    starts = np.cumsum(ql) - ql
    assert [c[:3] for c in plan.calls] == [(starts[r], ql[r], cl[r]) for r in (0, 1, 3)]
    assert not plan.calls_only and plan.pre_own_from < plan.pre_rows.shape[0]
    assert_same_bits(*run_world(world, INVARIANT, torch.float32))
    # the target alone, then in the batch the other chunk, the target, and the prompt's one causal call
    assert seen == [False, True] * 3 + [True]
    seen.clear()
    assert_same_bits(*run_world(replace(world, soft_cap=5.0), INVARIANT, torch.float32))
    assert seen == []


def test_options_are_checked():
    with pytest.raises(ValueError, match="invariant_rows"):
        PlanOptions(batch_invariant=True, invariant_rows=0)
    with pytest.raises(ValueError, match="invariant_chunk"):
        PlanOptions(invariant_chunk=0)
    assert PlanOptions().batch_invariant is False


def test_tree_sum_order():
    """`causal.tree_sum`, the invariant mode's one pairwise tree (the self pair's dot products, the sum over a
    one-row tile's keys, the slots' fold, the MLA chunks' fold): element i added to i + half, then halves again,
    zero-padded to a power of two; over any dim the bits of the same sum over the last."""
    from vllm_gaudi_unified.paths.causal import tree_sum

    x = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0])  # ((1e8 + 3) + (-1e8 + 0)) + ((1 + 0) + (1 + 0)) in fp32
    assert tree_sum(x).item() == 2.0  # (the exact sum 5, a running fp32 sum 4)
    y = torch.randn(3, 6, 5, 8) * torch.logspace(-4, 4, 8)
    for d in range(y.dim()):
        last = tree_sum(y.movedim(d, -1).contiguous())
        for overwrite in (False, True):
            assert torch.equal(tree_sum(y.clone(), overwrite, dim=d).view(torch.int32), last.view(torch.int32))


def test_invariant_mode_takes_only_its_own_path(monkeypatch):
    """With batch_invariant the default paths never run; without it the invariant one never runs."""
    import vllm_gaudi_unified.attention as attention

    world = SCENARIOS["shared_prefix_prefill"]

    def fail(*args, **kwargs):
        raise AssertionError("wrong path")

    monkeypatch.setattr(attention, "_run_paths", fail)
    run_world(world, INVARIANT, torch.float32)
    monkeypatch.undo()
    monkeypatch.setattr(attention, "invariant_output", fail)
    run_world(world, SMALL, torch.float32)


# ----------------------------------------------------------------------------- the fast route


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast route's flash and Triton kernels need CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("target", [Req(1, 3000), Req(250, 4100), Req(2, 8190)], ids=["decode", "chunk", "two"])
def test_long_contexts_on_cuda(target, dtype):
    """Where the batch sets what the kernels launch: the Triton split count (a 20k context beside a 3k
    one: 4 splits vs 1), flash's segment count and max lengths, the grid; at the suite's head shapes."""
    others = (Req(1, 20000), Req(37, 5000), Req(1, 9000), Req(300, 0)) + tuple(Req(1, 100 + i) for i in range(60))
    world = World(target, others=others, position=1, block_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    assert_same_bits(*run_world(world, PlanOptions(batch_invariant=True), dtype, "cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast route's flash and Triton kernels need CUDA")
@pytest.mark.parametrize("target", [Req(4, 3000), Req(1, 3000), Req(2, 700)], ids=["verify", "decode", "one_split"])
def test_mqa_splits_on_cuda(target):
    """One KV head (8 query heads, head size 128): splits of 1024 keys. The target alone is final rows (the ordered
    combine's, or the kernel's for one split); beside a 20k decode and a chunk of 9 over 500 (a flash segment) its
    splits are folded into a Partial, merged and normalized by torch: the same bits."""
    others = (Req(1, 20000), Req(9, 500), Req(3, 1200)) + tuple(Req(1, 100 + 37 * i) for i in range(40))
    world = World(target, others=others, position=2, block_size=16, num_qo_heads=8, num_kv_heads=1, head_dim=128)
    assert_same_bits(*run_world(world, PlanOptions(batch_invariant=True, unique_tokens=4), torch.bfloat16, "cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gaudi route is measured on CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_invariant_mode_on_the_gaudi_route(name, dtype):
    """The named scenarios on CUDA with the CUDA-only kernels off (`fused.gaudi_route()`, what the cost
    table's Gaudi route runs): the torch route and the own calls' fused SDPA calls."""
    from vllm_gaudi_unified.paths import fused

    with fused.gaudi_route():
        assert_same_bits(*run_world(SCENARIOS[name], INVARIANT, dtype, "cuda"))


#: Decodes over a shared prefix at a Llama-3-8B layer's shapes: (siblings, prefix, own tokens).
SHARED_DECODES = [(15, 2048, 64), (63, 4096, 256)]


def _shared_decodes_world(siblings: int, prefix: int, own: int) -> World:
    others = tuple(Req(1, prefix + own, prefix // 16) for _ in range(siblings)) + (Req(1, 700), Req(9, 300))
    return World(Req(1, prefix + own), others=others, position=siblings // 2, block_size=16, num_qo_heads=32,
                 num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_shared_decodes_at_model_shapes(dtype):
    """A decode over a prefix it shares with 15 others (parallel sampling): alone = in the batch."""
    assert_same_bits(*run_world(_shared_decodes_world(*SHARED_DECODES[0]), PlanOptions(batch_invariant=True), dtype))


def test_invariant_step_traces_as_one_graph():
    """A step with share calls, own tiles and a prompt chunk traces whole: an HPU graph (or torch.compile) takes
    the step as one graph, not pieces between Python breaks."""
    world = replace(_shared_decodes_world(*SHARED_DECODES[0]), num_qo_heads=4, num_kv_heads=2, head_dim=16)
    table, num_blocks = _block_table(world, np.random.default_rng(world.seed))
    q, k, v, kc, vc, _, _ = _tensors(world, table, num_blocks, torch.float32, "cpu")
    lens = [r.query_len for r in world.requests], [r.context_len for r in world.requests]
    batch = build_unified_batch(*lens, table, world.block_size, num_blocks=num_blocks,
                                options=PlanOptions(batch_invariant=True))
    assert batch.share_rows.shape[0] > 0  # the step runs share calls
    torch._dynamo.reset()
    explained = torch._dynamo.explain(unified_attention)(q, k, v, kc, vc, batch, 0.37)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gaudi route is measured on CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHARED_DECODES, ids=["sampling_16x2k", "prefix_64x4k"])
def test_shared_decodes_on_the_gaudi_route(shape, dtype):
    """The benchmark's shared prefix and parallel sampling shapes on CUDA's Gaudi route: alone = in the batch."""
    from vllm_gaudi_unified.paths import fused

    with fused.gaudi_route():
        assert_same_bits(*run_world(_shared_decodes_world(*shape), PlanOptions(batch_invariant=True), dtype, "cuda"))


def test_fast_route_interpreted():
    """The fast route under Triton's interpreter and the exact flash stand-in, in a process of its own
    (tests/invariant_fast_cases.py): alone = in batch, and the float64 reference, every scenario and the
    route's own worlds (`FAST_WORLDS`)."""
    pytest.importorskip("triton")
    import invariant_fast_cases

    worlds = len(SCENARIOS) + len(invariant_fast_cases.FAST_WORLDS)
    assert run_interpreted("invariant_fast_cases.py") == ["ok", str(worlds)]
