"""MLA's bucket-shaped unique route (`paths/mla_chunks.py`: what an HPU and the Gaudi route run) against the
dense MLA reference, forced on the CPU (the route picks it off the CPU only): decodes and mixed steps, ragged
contexts, partial last blocks, shuffled block tables, NaN in every unreadable slot, padded buckets, chunks of
one block up to whole contexts, and two different steps through one compiled function of their bucket."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SPECS, Step, assert_matches
from test_mla import MODES, H, L, R, mla_case, mla_tensors
from test_mla_decode import DECODES, bf16_latent_route
from vllm_gaudi_unified import Bucket, attention, build_unified_batch
from vllm_gaudi_unified.merge import normalize
from vllm_gaudi_unified.mla import absorb_query, latent_views
from vllm_gaudi_unified.paths import mla_chunks, mla_decode
from vllm_gaudi_unified.reference import reference_attention

#: Every MLA step of the shared specs with unique pairs, and the decode steps of test_mla_decode.py.
STEPS = {**{f"decode_{k}": v for k, v in DECODES.items()},
         **{k: SPECS[k] for k in ("seed", "decode", "prefix_caching", "parallel_sampling", "ragged_partial",
                                  "long_causal")}}


@pytest.fixture
def routes(monkeypatch):
    """The route as it would be off the CPU ('chunks' wherever a latent route applies), each call's kept."""
    taken = []
    real = attention.mla_unique_route

    def off_cpu(batch, query, *args):
        taken.append(real(batch, query.to("meta"), *args))
        return taken[-1]

    monkeypatch.setattr(attention, "mla_unique_route", off_cpu)
    return taken


@pytest.mark.parametrize("keys", [1, 8, 4096])  # one block per chunk (any block size) .. whole contexts
@pytest.mark.parametrize("mode", ["default", "gather"])
@pytest.mark.parametrize("name", sorted(STEPS))
def test_chunks_float64(name, mode, keys, routes, monkeypatch):
    """Equal to the expanded MLA reference (float64, 1e-6), whatever the chunk size."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", keys)
    out, ref, batch, _ = mla_case(STEPS[name], options=MODES[mode])
    assert "u" in batch.phase and routes == ["chunks"]
    assert_matches(out, ref)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_chunks_bf16(name, routes):
    """bf16 in latent space against the reference over the same bf16 latents (1e-2)."""
    assert bf16_latent_route(STEPS[name], routes) == ["chunks"]


@pytest.mark.parametrize("mode", ["default", "gather"])
def test_chunks_padded_bucket(mode, routes, monkeypatch):
    """More query rows, requests and unique slots than the step: the padding stays out, and the chunk count
    is the bucket's bound."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", 8)
    step = DECODES["even"]
    _, _, batch, (_, _, cache, _, _) = mla_case(step, options=MODES[mode])
    s = batch.shape
    extra = min(5, cache.shape[0] - s.num_unique_blocks)  # (a slice stays within the cache: its dead slots pad)
    big = Bucket(s.phase, s.query_len + 3, s.num_shared_blocks, s.num_unique_blocks + extra, s.num_logits + 3,
                 s.num_causal_tiles, 0, 0, 0)
    out, ref, pbatch, _ = mla_case(step, options=MODES[mode], bucket=big)
    assert pbatch.bucket == big and routes[-1] == "chunks"
    assert_matches(out, ref)
    keys, visible, token = mla_chunks.chunk_layout(pbatch, big.query_len, step.block_size, torch.device("cpu"))
    u = pbatch.unique_rows.shape[0]
    assert keys.shape == visible.shape == (mla_chunks.num_chunks(u, big.query_len, 2), 8) and u >= s.num_unique_blocks
    assert int(visible.sum()) == sum(step.context_lens)  # every cached key once, nothing else


def test_the_chunk_bound_is_reached(routes, monkeypatch):
    """Every token's last chunk holds one slot (3 blocks a token, chunks of 2): the step fills the bound
    `num_chunks` exactly, with every cached key seen once, and matches the reference (float64, 1e-6)."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", 8)
    step = Step([1] * 4, [12, 10, 11, 9], 4)  # 3 blocks each (the new token's slot in the last one)
    out, ref, batch, _ = mla_case(step, options=MODES["gather"])
    assert routes[-1] == "chunks" and batch.unique_rows.shape[0] == 12
    assert_matches(out, ref)
    keys, visible, token = mla_chunks.chunk_layout(batch, 4, step.block_size, torch.device("cpu"))
    assert keys.shape[0] == mla_chunks.num_chunks(12, 4, 2) == 8 and bool((token < 4).all())
    assert int(visible.sum()) == sum(step.context_lens)


def test_route_off_the_cpu():
    """'chunks' off the CPU without the CUDA kernel; the CPU keeps 'dense' for its decode steps."""
    _, _, batch, (query, latent, cache, _, _) = mla_case(DECODES["even"])
    kc, vc = latent_views(cache, L)
    assert mla_decode.mla_unique_route(batch, query, kc, vc, None, None, None) == "dense"
    assert mla_decode.mla_unique_route(batch, query.to("meta"), kc, vc, None, None, None) == "chunks"
    assert mla_decode.mla_unique_route(batch, query.to("meta"), kc, vc, 5.0, None, None) is None


def _bucketed_case(step: Step, bucket, seed, dtype=torch.float64):
    """A step's latent inputs on a fixed cache size, padded to `bucket`, and its latent-space reference."""
    table, num_blocks, q_nope, q_pe, w_uk, _, latent, cache = mla_tensors(step, dtype, seed)
    query = absorb_query(q_nope, q_pe, w_uk)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=num_blocks,
                                options=MODES["gather"], bucket=bucket)
    scale = 0.25
    k, v = latent_views(latent, L)
    kc, vc = latent_views(cache, L)
    ref = reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, scale)
    return (query, k, v, kc, vc, batch, scale), ref


def _joint_bucket(steps):
    shapes = [build_unified_batch(s.query_lens, s.context_lens, mla_tensors(s, seed=i)[0], s.block_size,
                                  num_blocks=s.num_blocks, options=MODES["gather"]).shape for i, s in enumerate(steps)]
    top = lambda f: max(getattr(x, f) for x in shapes)
    return Bucket("--u", top("query_len"), 0, top("num_unique_blocks"), top("num_logits"), 0, 0, 0, 0)


#: What the chunks route reads of a batch (a graph's replay sees these buffers refilled by the next step).
UNIQUE = ("unique_rows", "unique_blocks", "unique_lo", "unique_hi")
TWO_STEPS = [Step([1] * 3, [13, 2, 9], 4, num_blocks=24), Step([1] * 3, [1, 22, 7], 4, num_blocks=24)]


def _route_inputs(step, bucket, seed, device):
    """(padded query, padded new latents, key cache, batch, scale) on `device`, and the latent reference."""
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    (query, k, _, kc, _, batch, scale), ref = _bucketed_case(step, bucket, seed, dtype)
    assert batch.bucket == bucket
    pad = (0, 0, 0, 0, 0, bucket.query_len - query.shape[0])
    q, key = (F.pad(x, pad).to(device) for x in (query, k))
    return (q, key, kc[:, :, 0].to(device), batch.to(device), scale), ref


def _check(part, step, ref):
    """At the inputs' tolerance (`_route_inputs`: float64 on the CPU, 1e-6; bf16 on CUDA, 1e-2: the route's
    fp32 output rounded to bf16 as the layer's output is; `ref` is float64 either way)."""
    dtype = torch.float64 if part.acc.dtype == torch.float64 else torch.bfloat16
    assert_matches(normalize(part)[:len(step.query_lens)].cpu().to(dtype), ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_two_steps_one_compiled_bucket(device, monkeypatch):
    """Two different decode steps padded to one bucket run through one compiled route (torch.compile,
    dynamic=False, fullgraph: no graph break, no data-dependent Python; no recompile: as an HPU graph
    captured once per bucket replays it for every later step): both exact, the second also through the
    first step's batch with its buffers refilled in place. The chunk table is built inside."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", 8)
    bucket = _joint_bucket(TWO_STEPS)
    torch._dynamo.reset()  # dynamo keys its cache by the code object: the other device's run would count
    route = torch.compile(mla_chunks.chunks_mla_partial, dynamic=False, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        (q, key, kc, first, scale), ref = _route_inputs(TWO_STEPS[0], bucket, 0, device)
        _check(route(q, kc, L, first, scale, key), TWO_STEPS[0], ref)
        (q, key, kc, second, scale), ref = _route_inputs(TWO_STEPS[1], bucket, 1, device)
        _check(route(q, kc, L, second, scale, key), TWO_STEPS[1], ref)
        for name in UNIQUE:
            getattr(first, name).copy_(getattr(second, name))
        _check(route(q, kc, L, first, scale, key), TWO_STEPS[1], ref)


def test_eager_call_then_refilled_batch(monkeypatch):
    """Eager, one batch whose buffers are refilled by a later step of its bucket (what a graph captured after
    an eager call of the same batch would see): nothing kept from the first call, the second step exact."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", 8)
    bucket = _joint_bucket(TWO_STEPS)
    (q, key, kc, first, scale), ref = _route_inputs(TWO_STEPS[0], bucket, 0, "cpu")
    _check(mla_chunks.chunks_mla_partial(q, kc, L, first, scale, key), TWO_STEPS[0], ref)
    (q, key, kc, second, scale), ref = _route_inputs(TWO_STEPS[1], bucket, 1, "cpu")
    for name in UNIQUE:
        getattr(first, name).copy_(getattr(second, name))
    _check(mla_chunks.chunks_mla_partial(q, kc, L, first, scale, key), TWO_STEPS[1], ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_a_later_step(monkeypatch):
    """A CUDA graph of the route captured on one step, replayed after its buffers (batch, query, new latents,
    cache) were refilled with another step of the same bucket: the other step's result (bf16, 1e-2)."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", 8)
    bucket = _joint_bucket(TWO_STEPS)
    (q, key, kc, batch, scale), _ = _route_inputs(TWO_STEPS[0], bucket, 0, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mla_chunks.chunks_mla_partial(q, kc, L, batch, scale, key)  # (warm-up, off the graph)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        part = mla_chunks.chunks_mla_partial(q, kc, L, batch, scale, key)
    (q2, key2, kc2, batch2, _), ref = _route_inputs(TWO_STEPS[1], bucket, 1, "cuda")
    for dst, src in zip((q, key, kc), (q2, key2, kc2)):
        dst.copy_(src)
    for name in UNIQUE:
        getattr(batch, name).copy_(getattr(batch2, name))
    graph.replay()
    torch.cuda.synchronize()
    _check(part, TWO_STEPS[1], ref)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_steps(data, routes, monkeypatch):
    """Random steps (ragged decodes, a prompt among them, a shared prefix or not, tokens without cached keys,
    chunks of 1 to 8 blocks): the chunks route matches the reference (float64, 1e-6)."""
    n = data.draw(st.integers(1, 6))
    bs = data.draw(st.sampled_from([2, 4, 8]))
    ctx = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    qlens = [1] * n
    if data.draw(st.booleans()):
        qlens[-1] = data.draw(st.integers(1, 5))
    groups = []
    if n >= 2 and min(ctx[:2]) >= bs and data.draw(st.booleans()):
        groups = [([0, 1], min(ctx[:2]) // bs)]
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", bs * data.draw(st.sampled_from([1, 2, 3, 8])))
    routes.clear()
    mode = data.draw(st.sampled_from(["default", "gather"]))
    out, ref, batch, _ = mla_case(Step(qlens, ctx, bs, prefix_groups=groups), options=MODES[mode],
                                  seed=data.draw(st.integers(0, 99)))
    assert_matches(out, ref)
    assert routes == (["chunks"] if "u" in batch.phase else [])


def _direct(step: Step, seed: int, scales=(), own_scale=1.0, bucket=None):
    """The route called directly (float64): its Partial, the latent-space reference and the batch. `scales`
    multiplies the latents of token 0's context in runs of 2 blocks (one chunk at 8 keys over blocks of 4),
    `own_scale` every new latent: chunk maxima and own scores far apart."""
    table, num_blocks, q_nope, q_pe, w_uk, _, latent, cache = mla_tensors(step, torch.float64, seed)
    for j, f in enumerate(scales):
        cache[table[0, 2 * j:2 * j + 2]] *= f
    latent *= own_scale
    query = absorb_query(q_nope, q_pe, w_uk)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=num_blocks,
                                options=MODES["gather"], bucket=bucket)
    (k, v), (kc, vc) = latent_views(latent, L), latent_views(cache, L)
    ref = reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.25)
    pad = (0, 0, 0, 0, 0, batch.shape.query_len - query.shape[0])  # (the bucket's query rows)
    part = mla_chunks.chunks_mla_partial(F.pad(query, pad), kc[:, :, 0], L, batch, 0.25, F.pad(k, pad))
    return part, ref, batch


@pytest.mark.parametrize("own_scale", [1.0, 40.0])
def test_chunk_maxima_far_apart(own_scale, monkeypatch):
    """One token's chunks with scores hundreds to thousands apart (the lower ones' e^ on the token's max
    underflow to exactly 0), a token with no cached key (its own pair alone), and own keys above or below
    every cached score: exact in float64 (1e-6), the Partial's max the token's."""
    monkeypatch.setattr(mla_chunks, "MLA_CHUNK_KEYS", 8)
    step = Step([1, 1, 1], [40, 0, 17], 4, num_blocks=24)
    part, ref, _ = _direct(step, 3, scales=(1.0, 60.0, 0.01, 300.0, 5.0), own_scale=own_scale)
    assert_matches(normalize(part), ref)
    assert torch.isfinite(part.max).all() and (part.sum >= 1).all()  # the top key's own e^0 is in every sum


def test_every_chunk_padding():
    """A bucket with unique slots but a step with no cached key (every cache slot NaN): every chunk is
    padding; with the own keys each token is its own pair, without them every row is empty (max -inf,
    sum 0, acc 0), no NaN anywhere."""
    step = Step([1, 1], [0, 0], 4, num_blocks=8)
    bucket = Bucket("--u", 4, 0, 3, 4, 0, 0, 0, 0)
    part, ref, batch = _direct(step, 5, bucket=bucket)
    cache = latent_views(mla_tensors(step, seed=5)[-1], L)[0][:, :, 0]
    _, visible, token = mla_chunks.chunk_layout(batch, 4, 4, torch.device("cpu"))
    assert cache.isnan().all() and token.numel() > 0 and (token == 4).all() and not visible.any()
    assert_matches(normalize(part)[:2], ref)
    empty = mla_chunks.chunks_mla_partial(torch.randn(4, H, L + R, dtype=torch.float64), cache, L, batch, 0.25)
    assert (empty.max == float("-inf")).all() and (empty.sum == 0).all() and (empty.acc == 0).all()
