"""The dense decode route of vLLM's CPU platform (`paths/decodes.py`, `attend_step(dense_decodes=True)`):
the same attention as the dense reference, on the steps it takes, and the paths on every other step."""
import numpy as np
import pytest
import torch

from conftest import Step, assert_matches, make_block_table, make_tensors
from vllm_gaudi_unified import Bucket, PlanOptions, build_unified_batch
from vllm_gaudi_unified.attention import attend_step
from vllm_gaudi_unified.bucket import phase_of
from vllm_gaudi_unified.paths import decodes
from vllm_gaudi_unified.reference import reference_attention

LAYOUTS = [PlanOptions(unique_layout="gather"), PlanOptions(unique_layout="slice"), PlanOptions()]


def _step(rng, R, bs, hq, hkv, empty_rows=False):
    ctx = rng.integers(3 * bs + 1, 6 * bs, R)  # ragged, within the padding the route takes
    if empty_rows:
        ctx[rng.random(R) < 0.2] = 0
    return Step([1] * R, ctx.tolist(), bs, num_qo_heads=hq, num_kv_heads=hkv, head_dim=8)


def _attend(step, dtype, options, seed, window=None, pad=0, **kw):
    rng = np.random.default_rng(seed)
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, dtype, seed)  # unread slots hold NaN / inf
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, sliding_window=window,
                                num_blocks=num_blocks, options=options)
    if pad:
        s = batch.shape
        bucket = Bucket(phase_of(0, 0, s.num_unique_blocks + pad), s.query_len + pad, 0, s.num_unique_blocks + pad,
                        s.num_logits + pad, 0)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, sliding_window=window,
                                    num_blocks=num_blocks, options=options, bucket=bucket)
    rows = batch.bucket.query_len
    qq, kk, vv = (torch.cat([x, torch.zeros(rows - x.shape[0], *x.shape[1:], dtype=dtype)]) for x in (q, k, v))
    out = attend_step(qq, kk, vv, kc, vc, batch, 0.37, dense_decodes=True, **kw)[: q.shape[0]]
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37,
                              sliding_window=window, **kw)
    return out, ref, batch


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_decode_steps_match_the_reference(dtype, seed):
    """Ragged contexts, partial last blocks, shuffled tables, MHA / GQA / MQA, slice and gather layouts,
    rows with no cached key, a sliding window, padded buckets; every unread cache slot is NaN / inf."""
    rng = np.random.default_rng(seed)
    hq, hkv = [(4, 4), (8, 2), (6, 1)][seed % 3]
    step = _step(rng, int(rng.integers(1, 12)), int(rng.choice([4, 8, 16])), hq, hkv, empty_rows=seed % 2 == 1)
    out, ref, batch = _attend(step, dtype, LAYOUTS[seed % 3], seed, window=[None, 5][seed // 3 % 2],
                              pad=seed % 4)
    assert decodes.decode_layout(batch) is not None  # the dense route ran
    assert_matches(out, ref)


def test_a_visible_non_finite_key_reaches_its_own_row_alone():
    rng = np.random.default_rng(3)
    step = _step(rng, 5, 4, 4, 2)
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float64)
    kc[table[2, 0], 0] = float("nan")  # request 2's first key
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=num_blocks)
    out = attend_step(q, k, v, kc, vc, batch, 0.37, dense_decodes=True)
    bad = ~torch.isfinite(out).all(-1).all(-1)
    assert bad.tolist() == [r == 2 for r in range(5)]


@pytest.mark.parametrize("case", ["windowed_prompt", "shared_prefix", "soft_cap", "sinks", "no_fused_kernels"])
def test_other_steps_run_the_paths(case):
    """Causal or shared tiles (a prompt under a window: off the prompt route; a common prefix), a soft cap
    or sinks, prompts whose rows are not final: the paths, bit for bit."""
    rng = np.random.default_rng(7)
    step = Step([3, 1, 1], [5, 9, 0], 4) if case in ("windowed_prompt", "no_fused_kernels") else _step(rng, 4, 4, 4, 2)
    if case == "shared_prefix":
        step.prefix_groups = [([0, 1, 2, 3], 1)]
        step.context_lens = [9, 10, 11, 12]
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float64)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 4, num_blocks=num_blocks,
                                sliding_window=6 if case == "windowed_prompt" else None,
                                options=PlanOptions(fused_kernels=case != "no_fused_kernels"))
    kw = {"soft_cap": dict(logits_soft_cap=5.0), "sinks": dict(sinks=torch.randn(4, dtype=torch.float64))}.get(case, {})
    a = attend_step(q, k, v, kc, vc, batch, 0.37, dense_decodes=True, **kw)
    b = attend_step(q, k, v, kc, vc, batch, 0.37, **kw)
    assert torch.equal(a, b)
    if case in ("windowed_prompt", "shared_prefix"):  # causal or shared tiles
        assert batch.phase[:2] != "--"
    if case == "no_fused_kernels":
        assert batch.bucket.num_prompts and batch.phase[:2] == "--"


def test_a_layout_too_padded_for_the_route_runs_the_paths(monkeypatch):
    monkeypatch.setattr(decodes, "MAX_PADDING", 0.5)
    out, ref, batch = _attend(_step(np.random.default_rng(1), 6, 4, 4, 2), torch.float64, PlanOptions(), 1)
    assert decodes.decode_layout(batch) is None
    assert_matches(out, ref)


@pytest.mark.parametrize("seed", range(4))
def test_new_tokens_read_from_the_cache_slots_they_were_written_to(seed):
    """`self_slots` (a server writes the new K/V before attending): the same attention, every key in one
    gather."""
    rng = np.random.default_rng(seed)
    step = _step(rng, int(rng.integers(1, 10)), 8, 8, 2, empty_rows=seed % 2 == 1)
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, torch.float64, seed)
    ctx = np.array(step.context_lens)
    slots = torch.from_numpy(table[np.arange(ctx.size), ctx // 8] * 8 + ctx % 8)
    kc.view(-1, *kc.shape[2:])[slots], vc.view(-1, *vc.shape[2:])[slots] = k, v
    batch = build_unified_batch(step.query_lens, step.context_lens, table, 8, num_blocks=num_blocks,
                                options=LAYOUTS[seed % 3])
    out = attend_step(q, k, v, kc, vc, batch, 0.37, dense_decodes=True, self_slots=slots)
    assert decodes.decode_layout(batch) is not None
    assert_matches(out, reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37))


def _packed(kc, vc):
    """The caches as vLLM's per-layer memory holds them: one `[.., K | V]` tensor, two views of it."""
    kv = torch.cat([kc, vc], dim=-1)
    return kv[..., :kc.shape[-1]], kv[..., kc.shape[-1]:]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(8))
def test_packed_caches_gather_k_and_v_at_once(dtype, seed):
    """Caches that are views of one K | V memory (the server's) are gathered in one index: the same
    attention, with and without `self_slots`, ragged or equal contexts (no mask), rows with no cached key,
    MHA / GQA / MQA; every unread slot NaN / inf."""
    rng = np.random.default_rng(seed)
    hq, hkv = [(4, 4), (8, 2), (6, 1)][seed % 3]
    R, bs = int(rng.integers(1, 10)), int(rng.choice([4, 8]))
    step = _step(rng, R, bs, hq, hkv, empty_rows=seed % 4 == 1)
    if seed % 4 == 2:  # every row sees as many keys: the route runs without a mask
        step.context_lens = [step.context_lens[0]] * R
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, dtype, seed)
    self_slots = None
    if seed % 2 == 0:  # the server's way: the new K/V written to their slots first
        ctx = np.array(step.context_lens)
        self_slots = torch.from_numpy(table[np.arange(R), ctx // bs] * bs + ctx % bs)
        kc.view(-1, *kc.shape[2:])[self_slots], vc.view(-1, *vc.shape[2:])[self_slots] = k, v
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
    pk, pv = _packed(kc, vc)
    assert decodes.packed_kv(pk, pv) is not None
    batch = build_unified_batch(step.query_lens, step.context_lens, table, bs, num_blocks=num_blocks,
                                options=LAYOUTS[seed % 3])
    out = attend_step(q, k, v, pk, pv, batch, 0.37, dense_decodes=True, self_slots=self_slots)
    layout = decodes.decode_layout(batch)
    assert layout is not None
    assert layout.full == (seed % 4 == 2 or step.context_lens == [step.context_lens[0]] * R)
    assert_matches(out, ref)
    again = attend_step(q, k, v, pk, pv, batch, 0.37, dense_decodes=True, self_slots=self_slots)  # the step's index
    assert torch.equal(out, again)


def test_packed_kv_takes_only_one_k_then_v_memory():
    kv = torch.randn(3, 4, 2, 16)
    k, v = kv[..., :8], kv[..., 8:]
    got = decodes.packed_kv(k, v)
    assert torch.equal(got, kv.reshape(12, 2, 16))
    assert decodes.packed_kv(v, k) is None  # values before keys
    assert decodes.packed_kv(k, k) is None
    assert decodes.packed_kv(k.clone(), v.clone()) is None  # two memories
    assert decodes.packed_kv(kv[..., :8], kv[..., 10:]) is None  # a gap between K and V
    mla = torch.randn(3, 4, 1, 24)  # values the first dims of the keys: no K | V layout
    assert decodes.packed_kv(mla, mla[..., :16]) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(8))
def test_decodes_beside_prompts(dtype, seed):
    """A step of decodes and prompts on the prompt route (a server's steady state): the decodes on the
    dense route, the prompts' rows from the prompt route; ragged contexts, chunks with a context, one-token
    prompts, MHA / GQA / MQA, packed caches and `self_slots` (every new token written first) or not; every
    unread slot NaN / inf."""
    rng = np.random.default_rng(seed)
    hq, hkv = [(4, 4), (8, 2), (6, 1)][seed % 3]
    bs = int(rng.choice([4, 8]))
    R = int(rng.integers(2, 9))
    q_lens = np.where(rng.random(R) < 0.3, rng.integers(2, 12, R), 1)
    q_lens[0] = int(rng.integers(2, 12))  # at least one prompt
    ctx = rng.integers(2 * bs + 1, 5 * bs, R)
    ctx[q_lens > 1] = np.where(rng.random(int((q_lens > 1).sum())) < 0.5, 0, rng.integers(1, 3 * bs))[:(q_lens > 1).sum()]
    if seed % 4 == 3:
        q_lens[-1], ctx[-1] = 1, 0  # a one-token prompt, on the prompt route beside the others
    step = Step(q_lens.tolist(), ctx.tolist(), bs, num_qo_heads=hq, num_kv_heads=hkv, head_dim=8)
    table, num_blocks = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, num_blocks, dtype, seed)
    self_slots = None
    if seed % 2 == 0:  # the server's way: every new token's K/V written to its slot first
        req = np.repeat(np.arange(R), q_lens)
        pos = ctx[req] + np.arange(q_lens.sum()) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        self_slots = torch.from_numpy(table[req, pos // bs] * bs + pos % bs)
        kc.view(-1, *kc.shape[2:])[self_slots], vc.view(-1, *vc.shape[2:])[self_slots] = k, v
        kc, vc = _packed(kc, vc)
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, bs, num_blocks=num_blocks,
                                options=LAYOUTS[seed % 3])
    assert batch.bucket.num_prompts and batch.phase[:2] == "--"
    out = attend_step(q, k, v, kc, vc, batch, 0.37, dense_decodes=True, self_slots=self_slots)
    layout = decodes.decode_layout(batch)
    assert layout is not None and layout.tokens is not None  # the dense route ran, on the decodes alone
    prompt_tokens = set(batch.plan.prompt_rows[batch.plan.prompt_rows < q.shape[0]].tolist())
    assert set(layout.tokens.tolist()) == set(range(q.shape[0])) - prompt_tokens
    assert_matches(out, ref)
