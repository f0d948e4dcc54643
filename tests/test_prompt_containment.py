"""A bad new key or value of a prompt without context reaches exactly the rows it should, on every route.

Prompts without context off a Gaudi rely on the causal SDPA call hiding later keys' scores by selection
(`paths/prompts.py: causal_selects`, `_causal_keys`): a bad key goes in as NaN, its value as zero. Here 4
prompts of 512 tokens (32 / 8 / 128 heads, bf16, every cache slot NaN) get a NaN or inf key or value at
token 100 of prompt 1, KV head 3; the rows 100.. of that prompt, that KV head's query heads, must come out
NaN and every other row as in the clean call. Both routes, eager and compiled (`graphs.compiled_attention`),
on CUDA (the device's SDPA kernels decide it); on the CPU the eager form (compiling there takes minutes).
In both modes: the batch-invariant mode's own calls (one per prompt, `invariant.own_rows`) contain bad
values the same way where the call selects (`fused.poison_keys`).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from vllm_gaudi_unified import PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.graphs import clear, compiled_attention
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.reference import reference_attention

P, LEN, HQ, HKV, D, BS = 4, 512, 32, 8, 128, 128
BAD = [("key", float("nan")), ("value", float("nan")), ("value", float("inf")), ("key", float("inf"))]


@pytest.mark.parametrize("mode", ["default", "invariant"])
@pytest.mark.parametrize("form", ["eager", "compiled"])
@pytest.mark.parametrize("route", ["cuda", "gaudi"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_bad_new_key_reaches_only_the_rows_that_see_it(device, route, form, mode):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA kernels' containment runs on the GPU machine")
    if device == "cpu" and form == "compiled":
        pytest.skip("compiling these shapes on the CPU takes minutes; the eager form runs here")
    dev = torch.device(device)
    ql, cl = [LEN] * P, [0] * P
    nb = P * (LEN // BS) + 1
    table = np.arange(1, nb).reshape(P, -1).astype(np.int64)
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = rand(P * LEN, HQ, D), rand(P * LEN, HKV, D), rand(P * LEN, HKV, D)
    kc = torch.full((nb, BS, HKV, D), float("nan"), device=dev, dtype=torch.bfloat16)
    vc, scale = kc.clone(), D ** -0.5
    ref = reference_attention(*(x.double().cpu() for x in (q, k, v, kc, vc)), ql, cl, table, scale)
    j, heads = LEN + 100, slice(3 * HQ // HKV, 4 * HQ // HKV)
    expect = torch.zeros((P * LEN, HQ), dtype=torch.bool, device=dev)
    expect[j:2 * LEN, heads] = True
    fn = unified_attention if form == "eager" else compiled_attention
    try:
        with fused.gaudi_route() if route == "gaudi" else contextlib.nullcontext():
            clear()
            batch = build_unified_batch(ql, cl, table, BS, num_blocks=nb, device=dev,
                                        options=PlanOptions(batch_invariant=mode == "invariant"))
            clean = fn(q, k, v, kc, vc, batch, scale).clone()
            torch.testing.assert_close(clean.double().cpu(), ref, atol=1e-2, rtol=1e-2)
            for which, value in BAD:
                kk, vv = k.clone(), v.clone()
                (kk if which == "key" else vv)[j, 3, 7] = value
                bad = fn(q, kk, vv, kc, vc, batch, scale)
                nan = torch.isnan(bad).any(-1)
                assert torch.equal(nan, expect), f"{which} {value}: {int(nan.sum())} NaN rows, {int(expect.sum())} expected"
                assert torch.equal(bad[~expect], clean[~expect]), f"{which} {value}: a row that cannot see it changed"
    finally:
        clear()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_bad_new_key_of_a_chunk_on_its_own_calls(device):
    """The invariant mode's split form (a chunk over its context: a context call and a causal new-key call,
    merged by their LSE): a bad new key or value at token 10 of the chunk, KV head 1, makes exactly that
    head's rows 10.. NaN (through the new-key call's rows and LSE); the rows of the prompt beside it, of the
    decode, and of the chunk's other heads and earlier rows keep their clean bits."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA kernels' containment runs on the GPU machine")
    ql, cl, bs = [40, 24, 1], [37, 0, 20], 16
    table = np.array([[1, 2, 3], [0, 0, 0], [4, 5, 0]])
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    q, k, v, kc, vc = rand(65, 8, 64), rand(65, 2, 64), rand(65, 2, 64), rand(6, bs, 2, 64), rand(6, bs, 2, 64)
    batch = build_unified_batch(ql, cl, table, bs, num_blocks=6, options=PlanOptions(batch_invariant=True),
                                device=device)
    assert [c[:3] for c in batch.plan.calls] == [(0, 40, 37), (40, 24, 0)]
    clean = unified_attention(q, k, v, kc, vc, batch, 0.125)
    expect = torch.zeros(clean.shape[:2], dtype=torch.bool, device=device)
    expect[10:40, 4:8] = True
    for which, value in BAD:
        kk, vv = k.clone(), v.clone()
        (kk if which == "key" else vv)[10, 1, 5] = value
        bad = unified_attention(q, kk, vv, kc, vc, batch, 0.125)
        assert torch.equal(torch.isnan(bad).any(-1), expect), f"{which} {value}"
        assert torch.equal(bad[~expect], clean[~expect]), f"{which} {value}: a row that cannot see it changed"
