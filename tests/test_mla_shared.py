"""MLA's latent shared route (`paths/mla_shared.py`) against the dense MLA reference and the generic shared tiles:
shared prefixes of decodes, chunks over their context on the tiles, ragged steps, shuffled tables, NaN in
every unreadable slot, a non-finite value some rows of a tile see (those rows alone carry it), bf16."""
from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SPECS, Step, assert_matches
from test_mla import MODES, H, L, mla_case
from vllm_gaudi_unified import PlanOptions, attention
from vllm_gaudi_unified.merge import merge_rows, normalize
from vllm_gaudi_unified.mla import latent_views, mla_attention
from vllm_gaudi_unified.paths import mla_shared
from vllm_gaudi_unified.paths.shared import shared_partial
from vllm_gaudi_unified.reference import reference_attention

TILES = PlanOptions(causal_tile=4, shared_rows=2, shared_tile_keys=8, prompt_route="tiles")
#: steps with shared tiles: decodes over a prefix, chunks over their own context (the tiles route)
SHARED = {"parallel_sampling": (SPECS["parallel_sampling"], "default"), "seed": (SPECS["seed"], "gather"),
          "prefix_caching": (SPECS["prefix_caching"], "default"), "chunked_tiles": (SPECS["chunked_prefill"], "tiles"),
          "prefix_tiles": (SPECS["prefix_caching"], "tiles"), "ragged_tiles": (SPECS["ragged_partial"], "tiles"),
          "big_group": (Step([1] * 9, [21] * 9, 4, prefix_groups=[(list(range(9)), 5)]), "gather")}
OPTIONS = dict(MODES, tiles=TILES)


@pytest.fixture
def taken(monkeypatch):
    """How many times the latent shared route ran."""
    calls = []
    real = mla_shared.latent_shared_partial

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(attention, "latent_shared_partial", spy)
    return calls


@pytest.mark.parametrize("name", sorted(SHARED))
def test_float64(name, taken):
    """Latent shared route, then W_UV, equals the expanded reference (float64, 1e-6), NaN in unread slots."""
    step, mode = SHARED[name]
    out, ref, batch, _ = mla_case(step, options=OPTIONS[mode])
    assert "s" in batch.phase and taken
    assert_matches(out, ref)


@pytest.mark.parametrize("softmax", ["compute", "product"])
@pytest.mark.parametrize("name", sorted(SHARED))
def test_bf16(name, softmax, taken, monkeypatch):
    """bf16 in latent space within 1e-2 of the reference, `latent_attend`'s softmax either way."""
    monkeypatch.setattr(mla_shared, "LATENT_SOFTMAX", softmax)
    step, mode = SHARED[name]
    _, _, batch, (query, latent, cache, table, scale) = mla_case(step, dtype=torch.bfloat16, options=OPTIONS[mode])
    taken.clear()
    lat = mla_attention(query, latent, cache, batch, scale, L)
    k, v = latent_views(latent, L)
    kc, vc = latent_views(cache, L)
    assert taken and lat.dtype == torch.bfloat16
    assert_matches(lat, reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens, table, scale))


def _partials(step, options, poison_seen=False, dtype=torch.float64, seed=0):
    """(latent route, generic tiles) normalised shared rows of a step; `poison_seen`: a NaN in one visible
    slot of the first shared tile, read by some of its rows."""
    _, _, batch, (query, _, cache, _, scale) = mla_case(step, dtype=dtype, options=options, seed=seed)
    kc, vc = latent_views(cache, L)
    if poison_seen:
        blk = int(batch.shared_blocks[0, 0])
        slot = int(batch.shared_lo[0, 0, 0])
        cache[blk, slot, 3] = float("nan")
    a = mla_shared.latent_shared_partial(query, kc, L, batch, scale)
    b = shared_partial(query, kc, vc, batch, scale, None)  # the tiles' rows, merged here
    return normalize(a), merge_rows([b], query.shape[0]), batch


@pytest.mark.parametrize("name", sorted(SHARED))
def test_equals_the_generic_tiles(name):
    """Partial by partial (before the merge with the other paths): the generic shared tiles' rows, float64."""
    step, mode = SHARED[name]
    a, b, _ = _partials(step, OPTIONS[mode])
    torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_a_bad_value_stays_with_the_rows_that_see_it():
    """Tiles whose rows see different slots (hand-made: vLLM's plans share whole blocks), NaN in slots no row
    sees, and one NaN that one row of a tile sees: that row alone is NaN, the others equal a per-row dense
    computation (float64)."""
    g = torch.Generator().manual_seed(3)
    n, bs, d, blocks = 5, 4, L + 8, 6
    cache = torch.randn(blocks, bs, d, generator=g, dtype=torch.float64)
    q = torch.randn(n, H, d, generator=g, dtype=torch.float64)
    rows = torch.tensor([[0, 1, 2], [3, 4, n]])  # the second tile has a padding row
    tile_blocks = torch.tensor([[1, 2], [4, 5]])
    lo = torch.tensor([[[0, 0], [0, 0], [1, 0]], [[0, 0], [0, 0], [0, 0]]])
    hi = torch.tensor([[[4, 2], [4, 4], [3, 0]], [[4, 1], [2, 0], [0, 0]]])
    batch = SimpleNamespace(shared_rows=rows, shared_blocks=tile_blocks, shared_lo=lo, shared_hi=hi)
    seen = torch.zeros(blocks, bs, dtype=torch.bool)
    for t in range(2):
        for r in range(3):
            for c in range(2):
                seen[tile_blocks[t, c], lo[t, r, c]:hi[t, r, c]] = True
    cache[~seen] = float("nan")
    cache[2, 3, 5] = float("nan")  # tile 0, block 2, slot 3: seen by row 1 (token 1) only
    kc, _ = latent_views(cache, L)
    out = normalize(mla_shared.latent_shared_partial(q, kc, L, batch, 0.3))
    for t in range(2):
        for r in range(3):
            tok = int(rows[t, r])
            if tok == n:
                continue
            keys = torch.cat([cache[tile_blocks[t, c], lo[t, r, c]:hi[t, r, c]] for c in range(2)])
            p = torch.softmax(0.3 * q[tok] @ keys.T, -1)
            want = p @ keys[:, :L]
            if tok == 1:
                assert out[tok].isnan().all()
            else:
                torch.testing.assert_close(out[tok], want, atol=1e-12, rtol=1e-12)


def test_not_for_soft_cap_fp8_or_a_copied_value_cache():
    _, _, batch, (query, _, cache, _, _) = mla_case(SPECS["parallel_sampling"])
    kc, vc = latent_views(cache, L)
    assert mla_shared.mla_shared_applies(batch, kc, vc, None, None, None)
    assert not mla_shared.mla_shared_applies(batch, kc, vc, 5.0, None, None)
    assert not mla_shared.mla_shared_applies(batch, kc, vc, None, torch.tensor(1.0), None)
    assert not mla_shared.mla_shared_applies(batch, kc, vc.clone(), None, None, None)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_steps(data, taken):
    """Random ragged steps with a prefix group, decodes or chunks (the tiles route), random tile sizes:
    the whole step equals the reference (float64, 1e-6) whenever the route runs."""
    n = data.draw(st.integers(2, 6))
    bs = data.draw(st.sampled_from([2, 4, 8]))
    q = data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    ctx = data.draw(st.lists(st.integers(0, 33), min_size=n, max_size=n))
    members = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n)))
    shared = min(ctx[r] for r in members) // bs
    step = Step(q, ctx, bs, prefix_groups=[(members, shared)] if shared else [])
    options = PlanOptions(causal_tile=4, shared_rows=data.draw(st.sampled_from([1, 2, 8])),
                          shared_tile_keys=bs * data.draw(st.integers(1, 3)),
                          prompt_route=data.draw(st.sampled_from(["dense", "tiles"])))
    taken.clear()
    out, ref, batch, _ = mla_case(step, options=options, seed=data.draw(st.integers(0, 99)))
    assert_matches(out, ref)
    assert bool(taken) == ("s" in batch.phase)
    assert math.isfinite(float(out.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("softmax", ["compute", "product"])
@pytest.mark.parametrize("gaudi", [False, True], ids=["cuda_route", "gaudi_route"])
def test_on_cuda(gaudi, softmax, taken, monkeypatch):
    """bf16 on CUDA (1e-2 in latent space): every shared step above and the dense decode steps, on the CUDA
    route (the Triton kernel beside this route) and the Gaudi route (torch ops only: `mla_chunks.py`)."""
    from test_mla_decode import DECODES

    from vllm_gaudi_unified.paths import fused, mla_decode

    monkeypatch.setattr(mla_shared, "LATENT_SOFTMAX", softmax)
    # (on the CUDA route the MLA kernel takes the shared tiles by default: mla_kernel_cases.py checks it there)
    monkeypatch.setattr(mla_decode, "MLA_KERNEL_SHARED", False)
    cases = [SHARED[k] for k in sorted(SHARED)] + [(DECODES[k], "default") for k in sorted(DECODES)]
    with fused.gaudi_route() if gaudi else contextlib.nullcontext():
        for step, mode in cases:
            _, _, batch, (query, latent, cache, table, scale) = mla_case(step, dtype=torch.bfloat16,
                                                                         options=OPTIONS[mode])
            taken.clear()
            lat = mla_attention(query.cuda(), latent.cuda(), cache.cuda(), batch.to("cuda"), scale, L)
            assert bool(taken) == ("s" in batch.phase)
            k, v = latent_views(latent, L)
            kc, vc = latent_views(cache, L)
            assert_matches(lat.cpu(), reference_attention(query, k, v, kc, vc, step.query_lens, step.context_lens,
                                                          table, scale))
