"""MLA's unique routes (`paths/mla_decode.py`) against the dense MLA reference: the torch route (one gather,
two batched matmuls: what the Gaudi route and the CPU run for decode steps) and the Triton kernel (the
interpreter on the CPU, compiled on CUDA). Ragged decodes, shared prefixes, tokens without cached keys,
shuffled block tables, NaN in every unreadable slot, padded buckets."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SPECS, Step, assert_matches, run_interpreted
from test_mla import MODES, H, L, mla_case
from vllm_gaudi_unified import Bucket, attention
from vllm_gaudi_unified.mla import latent_views, mla_attention
from vllm_gaudi_unified.paths import mla_decode
from vllm_gaudi_unified.paths.decodes import decode_layout
from vllm_gaudi_unified.reference import reference_attention

HAS_TRITON = importlib.util.find_spec("triton") is not None

#: Decode steps within the dense layout's padding bound (phases with SMALL_TILES in the comments).
DECODES = {
    "even": Step([1] * 4, [13, 16, 11, 15], 4),  # --u, partial last blocks
    "shared_prefix": SPECS["parallel_sampling"],  # -su: the prefix on the shared path, the rest here
    "no_cached_key": Step([1] * 4, [0, 9, 6, 8], 4),  # a token that sees only itself
    "block_8": Step([1] * 3, [30, 25, 17], 8),
    "one": Step([1], [7], 4),
    "uniform": Step([1] * 3, [8, 8, 8], 4),  # no key masked: the mask pass is skipped
}


@pytest.fixture
def routes(monkeypatch):
    """The unique route each call took."""
    taken = []
    real = attention.mla_unique_route

    def spy(*args):
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(attention, "mla_unique_route", spy)
    return taken


@pytest.mark.parametrize("mode", ["default", "gather"])
@pytest.mark.parametrize("name", sorted(DECODES))
def test_dense_route_float64(name, mode, routes):
    """The torch route equals the expanded MLA reference (float64, 1e-6)."""
    out, ref, batch, _ = mla_case(DECODES[name], options=MODES[mode])
    assert "u" in batch.phase and routes == ["dense"]
    assert_matches(out, ref)


def bf16_latent_route(step: Step, routes: list) -> list:
    """One bf16 call in latent space, checked against the reference over the same bf16 latents (1e-2);
    returns the routes it took (`routes`: the test's route spy)."""
    _, _, batch, (query, latent, cache, table, scale) = mla_case(step, dtype=torch.bfloat16)
    routes.clear()
    lat = mla_attention(query, latent, cache, batch, scale, L)
    assert lat.dtype == torch.bfloat16 and lat.shape == (sum(step.query_lens), H, L)
    k, v = latent_views(latent, L)
    kc, vc = latent_views(cache, L)
    assert_matches(lat, reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, scale))
    return list(routes)


@pytest.mark.parametrize("name", sorted(DECODES))
def test_dense_route_bf16(name, routes):
    """bf16 in latent space against the reference over the same bf16 latents (1e-2)."""
    assert bf16_latent_route(DECODES[name], routes) == ["dense"]


def test_dense_route_padded_bucket(routes):
    """A bucket with more query rows and unique slots than the step: the padding rows stay out."""
    step = DECODES["even"]
    _, _, batch, _ = mla_case(step, options=MODES["gather"])
    s = batch.shape
    big = Bucket(s.phase, s.query_len + 3, s.num_shared_blocks, s.num_unique_blocks + 5, s.num_logits + 3,
                 s.num_causal_tiles, 0, 0, 0)
    out, ref, pbatch, _ = mla_case(step, options=MODES["gather"], bucket=big)
    assert pbatch.bucket == big and routes[-1] == "dense"
    assert_matches(out, ref)


def test_routes_are_chosen_by_their_conditions(routes):
    """Not a decode step (prompts in it), or past the padding bound (very ragged): the tiles, still exact.
    A soft cap or an fp8 scale: no latent route at all."""
    for name in ("seed", "decode"):  # csu; --u with contexts 1..64 (padding > 2x)
        out, ref, _, _ = mla_case(SPECS[name])
        assert_matches(out, ref)
    assert routes == [None, None]
    _, _, batch, (query, latent, cache, _, _) = mla_case(DECODES["even"])
    kc, vc = latent_views(cache, L)
    args = (batch, query, kc, vc)
    assert mla_decode.mla_unique_route(*args, None, None, None) == "dense"
    assert mla_decode.mla_unique_route(*args, 5.0, None, None) is None
    assert mla_decode.mla_unique_route(*args, None, 0.5, None) is None
    copy = vc.clone()  # values not a view of the keys: the generic paths
    assert mla_decode.mla_unique_route(batch, query, kc, copy, None, None, None) is None
    # Off the CPU (an HPU's graphs, the Gaudi route's stand-in) the bucket-shaped chunks (test_mla_chunks.py):
    # the dense route's table follows the step, and a graph captured at warmup would replay it for later steps.
    meta = query.to("meta")
    assert mla_decode.mla_unique_route(batch, meta, kc, vc, None, None, None) == "chunks"


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_mla_kernel_interpreted():
    """The Triton kernel's body under the interpreter, float64 (1e-6), every case of mla_kernel_cases.py."""
    words = run_interpreted("mla_kernel_cases.py")
    import mla_kernel_cases

    assert words == ["ok", str(len(mla_kernel_cases.CASES))]


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
def test_mla_kernel_on_cuda():
    """The compiled kernel, bf16, the same cases (1e-2), and the route it takes by itself on CUDA."""
    import mla_kernel_cases

    assert mla_kernel_cases.run("cuda") == len(mla_kernel_cases.CASES)
    _, _, batch, (query, latent, cache, _, _) = mla_case(DECODES["even"], dtype=torch.bfloat16)
    kc, vc = latent_views(cache.cuda(), L)
    assert mla_decode.mla_unique_route(batch.to("cuda"), query.cuda(), kc, vc, None, None, None) == "kernel"


def gluon_on_hopper() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and mla_decode._gluon() is not None)


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
def test_mla_gluon_on_hopper():
    """The one-stream Gluon kernel (`mla_gluon.py`, sm_90), bf16 at 128 heads against the reference (1e-2), every
    case of mla_gluon_cases.CASES; without the own pairs against the Triton kernel's Partial. Elsewhere it never
    applies."""
    if not gluon_on_hopper():
        q = torch.zeros(1, 128, 576, dtype=torch.bfloat16, device="cuda")
        cache = torch.zeros(2, 128, 576, dtype=torch.bfloat16, device="cuda")
        assert not mla_decode.gluon_applies(q, cache, 512)
        pytest.skip("needs an sm_90 GPU and Triton with Gluon")
    import mla_gluon_cases

    assert mla_gluon_cases.run() == len(mla_gluon_cases.CASES)


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
def test_mla_gluon_seesaw_on_hopper():
    """FlashMLA's seesaw schedule in Gluon (`mla_gluon_seesaw.py`, sm_90), the same checks over
    mla_gluon_cases.SEESAW_CASES (bf16 1e-2 against the reference, NaN in unread slots, with and without own pairs)."""
    if not gluon_on_hopper():
        pytest.skip("needs an sm_90 GPU and Triton with Gluon")
    import mla_gluon_cases

    assert mla_gluon_cases.run(mla_gluon_cases.SEESAW_CASES) == len(mla_gluon_cases.SEESAW_CASES)


def test_gluon_not_taken_off_cuda(monkeypatch):
    """Switched on, the Gluon kernel still applies only to CUDA tensors (the CPU and other devices keep their
    routes), and the switch off keeps the Triton kernel everywhere."""
    monkeypatch.setattr(mla_decode, "MLA_GLUON", True)
    q = torch.zeros(1, 128, 576, dtype=torch.bfloat16)
    assert not mla_decode.gluon_applies(q, torch.zeros(2, 128, 576, dtype=torch.bfloat16), 512)
    monkeypatch.setattr(mla_decode, "MLA_GLUON", False)
    assert not mla_decode.gluon_applies(q.to("meta"), torch.zeros(2, 128, 576, dtype=torch.bfloat16,
                                                                   device="meta"), 512)


def test_gluon_descriptors_kept_by_geometry():
    """The Gluon launch's kept TMA descriptors (`mla_gluon.cache_descriptors`): found again for the same cache,
    never for another address, shape, stride or box; the rows and boxes the launch needs; no reference to the
    cache kept (its memory is freed with it). Needs only Triton with Gluon (no GPU)."""
    import gc
    import weakref

    if mla_decode._gluon() is None:
        pytest.skip("needs Triton with Gluon")
    g = mla_decode._gluon()
    cache = torch.zeros(4, 128, 576, dtype=torch.bfloat16)
    kn, kr = g.cache_descriptors(cache, 512, 64)
    assert g.cache_descriptors(cache, 512, 64) == (kn, kr) and g.cache_descriptors(cache, 512, 64)[0] is kn
    assert (list(kn.shape), list(kn.strides), list(kn.block_shape)) == ([512, 512], [576, 1], [64, 512])
    assert (list(kr.shape), list(kr.block_shape)) == ([512, 64], [64, 64])
    assert (kn.base.data_ptr(), kr.base.data_ptr()) == (cache.data_ptr(), cache.data_ptr() + 1024)
    other = torch.zeros_like(cache)
    for c, dv, keys in ((other, 512, 64), (cache[:2], 512, 64), (cache[..., :544], 512, 64), (cache, 512, 32),
                        (torch.zeros(4, 128, 640, dtype=torch.bfloat16)[..., :576], 512, 64)):
        assert g.cache_descriptors(c, dv, keys)[0] is not kn
    assert g.cache_descriptors(cache, 512, 64, keep=False)[0] is not kn
    half, kr2 = g.cache_descriptors(cache, 512, 64, halves=True)  # (the seesaw kernel's boxes: a key of its own)
    assert half is not kn and list(half.block_shape) == [64, 256] and list(half.shape) == [512, 512]
    assert list(kr2.block_shape) == [64, 64] and g.cache_descriptors(cache, 512, 64, halves=True)[0] is half
    gone = weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_decode_steps(data, routes):
    """Random decode steps (ragged, a shared prefix or not, tokens without cached keys): whichever route the
    conditions pick matches the reference (float64, 1e-6), and the dense route runs whenever the padded
    table is within its bound (most of the drawn steps)."""
    n = data.draw(st.integers(1, 6))
    bs = data.draw(st.sampled_from([2, 4, 8]))
    ctx = data.draw(st.lists(st.integers(0, 33), min_size=n, max_size=n))
    groups = []
    if n >= 2 and min(ctx[:2]) >= bs and data.draw(st.booleans()):
        groups = [([0, 1], min(ctx[:2]) // bs)]
    step = Step([1] * n, ctx, bs, prefix_groups=groups)
    routes.clear()  # (the fixture lives across examples)
    mode = data.draw(st.sampled_from(["default", "gather"]))
    out, ref, batch, _ = mla_case(step, options=MODES[mode], seed=data.draw(st.integers(0, 99)))
    assert_matches(out, ref)
    if "u" in batch.phase:
        assert routes == ["dense" if decode_layout(batch) is not None else None]


def test_mla_splits_fill_the_sms_without_a_new_wave(monkeypatch):
    """`mla_splits`: by the keys alone where the step's programs fill the SMs (128 decodes x 4k at 128 heads:
    256 programs on 132 SMs), else the most splits that still fit the SMs once, each of at least
    `MLA_SPLIT_MIN_KEYS` keys, a power of two, at most `MLA_MAX_SPLITS`; off CUDA (or switched off) by the keys."""
    monkeypatch.setitem(mla_decode._SMS, 0, 132)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    cases = {(4096, 256): 1, (4352, 128): 1, (4096, 64): 2, (8192, 32): 4, (32768, 8): 16, (65536, 2): 32,
             (512, 8): 1, (3000, 8): 2, (40000, 300): 4}
    assert {c: mla_decode.mla_splits(*c, cuda) for c in cases} == cases
    assert mla_decode.mla_splits(32768, 8, cpu) == 2  # (by the keys: 16384 a split)
    monkeypatch.setattr(mla_decode, "MLA_FILL_SMS", False)
    assert mla_decode.mla_splits(32768, 8, cuda) == 2
