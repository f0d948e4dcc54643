"""A bad new key or value of a prompt without context reaches exactly the rows it should, on every route.

Prompts without context off a Gaudi rely on the causal SDPA call hiding later keys' scores by selection
(`paths/prompts.py: causal_selects`, `_causal_keys`): a bad key goes in as NaN, its value as zero. Here 4
prompts of 512 tokens (32 / 8 / 128 heads, bf16, every cache slot NaN) get a NaN or inf key or value at
token 100 of prompt 1, KV head 3; the rows 100.. of that prompt, that KV head's query heads, must come out
NaN and every other row as in the clean call. Both routes, eager and compiled (`graphs.compiled_attention`),
on CUDA (the device's SDPA kernels decide it); on the CPU the eager form (compiling there takes minutes).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.graphs import clear, compiled_attention
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.reference import reference_attention

P, LEN, HQ, HKV, D, BS = 4, 512, 32, 8, 128, 128
BAD = [("key", float("nan")), ("value", float("nan")), ("value", float("inf")), ("key", float("inf"))]


@pytest.mark.parametrize("form", ["eager", "compiled"])
@pytest.mark.parametrize("route", ["cuda", "gaudi"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_bad_new_key_reaches_only_the_rows_that_see_it(device, route, form):
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
            batch = build_unified_batch(ql, cl, table, BS, num_blocks=nb, device=dev)
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
