"""Cases for MLA's Triton kernel (paths/mla_kernel.py), shared by two tests of test_mla_decode.py.

On CPU the test runs this file in a process of its own with TRITON_INTERPRET=1 (Triton reads it when
it is first imported), float64, against the expanded MLA reference at 1e-6; on CUDA the same cases
run compiled in bf16, in latent space against the reference at 1e-2. Every case routes the unique pairs
through the kernel (`mla_unique_route` -> 'kernel' for every latent cache), on shuffled block
tables whose unreadable slots hold NaN, in both unique layouts, with small kernel constants so that
tokens span several loop steps and several splits (most of them empty for short contexts).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import SPECS, Step, assert_matches  # noqa: E402
from test_mla import MODES, L, mla_case  # noqa: E402

from vllm_gaudi_unified import PlanOptions, attention  # noqa: E402
from vllm_gaudi_unified.merge import Final, Partial, fold_pairwise, normalize  # noqa: E402
from vllm_gaudi_unified.mla import latent_views, mla_attention  # noqa: E402
from vllm_gaudi_unified.reference import reference_attention  # noqa: E402
from vllm_gaudi_unified.paths import mla_decode  # noqa: E402

#: Plan options of a verify step: 1 + 3 tokens per request's unit.
VERIFY = PlanOptions(causal_tile=4, shared_rows=4, shared_rows_max=4, shared_tile_keys=8, unique_tokens=4)

#: (step, plan mode or options, kernel constants)
CASES = [
    (SPECS["decode"], "default", {}),
    (SPECS["decode"], "gather", {"MLA_KEYS": 16, "MLA_SPLIT_KEYS": 8}),
    (SPECS["decode"], "default", {"MLA_V_LOAD": 1, "MLA_SPLIT_KEYS": 16}),
    (SPECS["parallel_sampling"], "gather", {"MLA_V_LOAD": 1}),
    (SPECS["parallel_sampling"], "default", {"MLA_SPLIT_KEYS": 8}),
    (SPECS["seed"], "gather", {}),  # prompts and decodes in one step: the kernel takes any unique pairs
    (SPECS["ragged_partial"], "default", {"MLA_KEYS": 32, "MLA_SPLIT_KEYS": 16}),
    (Step([1] * 4, [0, 9, 3, 24], 4), "gather", {"MLA_SPLIT_KEYS": 4}),  # a token without cached keys
    # key tiles that lie in one slot (MLA_KEYS divides the block size: ONE_SLOT), partial and empty slots
    (Step([1] * 4, [40, 0, 33, 64], 16), "default", {"MLA_KEYS": 16, "MLA_SPLIT_KEYS": 32}),
    (Step([1] * 3, [70, 17, 50], 32), "gather", {"MLA_KEYS": 16}),
    (Step([1] * 3, [70, 17, 50], 32), "default", {"MLA_KEYS": 16, "MLA_ONE_SLOT": False, "MLA_Q_LOOP": False}),
    # the shared tiles as more slots of their rows (`mla_kernel_takes_shared`; also above): csu, -s-, a big group,
    # and the shared route beside the kernel (`MLA_KERNEL_SHARED` off)
    (SPECS["prefix_caching"], "gather", {}),
    (SPECS["seed"], "default", {"MLA_KEYS": 16}),
    (Step([1] * 9, [21] * 9, 4, prefix_groups=[(list(range(9)), 5)]), "gather", {}),
    (Step([1] * 3, [8, 8, 8], 4, prefix_groups=[([0, 1, 2], 2)]), "default", {}),
    (SPECS["parallel_sampling"], "default", {"MLA_KERNEL_SHARED": False}),
    (SPECS["prefix_caching"], "gather", {"MLA_KERNEL_SHARED": False}),
    # verify steps (`unique_tokens`): each request's unit a slot per token, the drafts' causal pairs inside the
    # kernel (`UNITS`) or folded in after it (`mla_drafts.py`): ragged drafts, partial blocks, a request with no
    # cached key, drafts over a shared prefix, a long chunk beside them on the causal tiles (the prompt route off)
    (Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8), VERIFY, {"MLA_SPLIT_KEYS": 8}),
    (Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8), VERIFY, {"MLA_KERNEL_DRAFTS": False}),
    (Step([2, 3, 1, 2], [13, 0, 30, 7], 8), replace(VERIFY, unique_tokens=3), {"MLA_SPLIT_KEYS": 8}),
    (Step([4, 2, 3, 4], [13, 13, 14, 13], 4, prefix_groups=[([0, 1, 2, 3], 3)]),
     replace(VERIFY, unique_layout="gather"), {}),
    (Step([9, 3, 1, 4, 12], [0, 21, 9, 5, 16], 4), replace(VERIFY, prompt_route="tiles"), {}),
]


def run(device: str = "cpu") -> int:
    """float64 on the CPU (the interpreter: expanded reference, 1e-6); bf16 on CUDA (latent space, 1e-2)."""
    real = attention.mla_unique_route
    calls = []

    def route(batch, query, key_cache, value_cache, cap, k_scale, v_scale):
        if query.device.type != device:  # (on CUDA: the CPU's run inside mla_case takes its own route)
            return real(batch, query, key_cache, value_cache, cap, k_scale, v_scale)
        calls.append(mla_decode.latent_cache(key_cache, value_cache) and cap is None)
        return "kernel" if calls[-1] else None

    attention.mla_unique_route = route
    real_shared, shared_calls = attention.latent_shared_partial, []

    def shared_route(q, *args):
        shared_calls.append(q.device.type == device)
        return real_shared(q, *args)

    attention.latent_shared_partial = shared_route
    real_kernel, forms = attention.kernel_mla_partial, []

    def kernel_route(q, *args, **kwargs):  # each Final (the step's only path) against its Partial normalized
        out = real_kernel(q, *args, **kwargs)
        forms.append(type(out).__name__)
        if isinstance(out, Final):
            p = real_kernel(q, *args, **dict(kwargs, final=False))
            tol = (1e-12, 0.0) if out.out.dtype == torch.float64 else (1e-3, 2 ** -7)  # (16-bit: one rounding)
            torch.testing.assert_close(out.out, normalize(p, out.out.dtype), atol=tol[0], rtol=tol[1])
        return out

    attention.kernel_mla_partial = kernel_route
    saved = {k: getattr(mla_decode, k)
             for k in ("MLA_KEYS", "MLA_SPLIT_KEYS", "MLA_V_LOAD", "MLA_ONE_SLOT", "MLA_Q_LOOP",
                       "MLA_KERNEL_SHARED", "MLA_KERNEL_DRAFTS")}
    try:
        for step, mode, consts in CASES:
            for k, v in consts.items():
                setattr(mla_decode, k, v)
            calls.clear()
            shared_calls.clear()
            if device == "cpu":
                out, ref, batch, _ = mla_case(step, options=MODES.get(mode, mode))
                assert_matches(out, ref)
            else:
                _, _, batch, (query, latent, cache, table, scale) = mla_case(step, dtype=torch.bfloat16,
                                                                             options=MODES.get(mode, mode))
                calls.clear()
                lat = mla_attention(query.to(device), latent.to(device), cache.to(device), batch.to(device), scale,
                                    L)
                k, v = latent_views(latent, L)
                kc, vc = latent_views(cache, L)
                assert_matches(lat.cpu(), reference_attention(query, k, v, kc, vc, step.query_lens,
                                                              step.context_lens, table, scale))
            assert calls and all(calls), f"the kernel did not run: {calls}"
            if batch.phase[1] == "s":  # the kernel took the shared tiles unless switched off
                assert any(shared_calls) == (not mla_decode.MLA_KERNEL_SHARED), (batch.phase, shared_calls)
            for k, v in saved.items():
                setattr(mla_decode, k, v)
        assert {"Final", "Partial"} <= set(forms), forms  # (one split and alone: Final; else Partial)
        combine_matches_the_merge(device)
    finally:
        attention.mla_unique_route = real
        attention.latent_shared_partial = real_shared
        attention.kernel_mla_partial = real_kernel
        for k, v in saved.items():
            setattr(mla_decode, k, v)
    return len(CASES)


def combine_matches_the_merge(device: str) -> None:
    """`unique.combine_splits` (one pass over a token's splits) against `merge.fold_pairwise` (the merge's own tree):
    a split that saw no key (max -inf) adds nothing even with NaN in its acc, a NaN max stays in its own row only;
    the merged Partial, and the Final rows against its normalization."""
    dt = torch.float64 if device == "cpu" else torch.float32
    g = torch.Generator().manual_seed(3)
    n, splits, hq, dv = 3, 4, 5, 24
    acc = torch.randn(n, splits, hq, dv, generator=g, dtype=dt)
    m, total = torch.randn(n, splits, hq, generator=g, dtype=dt), torch.rand(n, splits, hq, generator=g, dtype=dt)
    m[0, 1], acc[0, 1] = float("-inf"), float("nan")  # (a split without keys: garbage in its acc)
    m[1, :, 2] = float("-inf")  # (a head of a token that saw no key at all)
    total[1, :, 2] = 0
    m[2, 3, 4] = float("nan")  # (a bad value: its row only)
    acc, m, total = (x.to(device) for x in (acc, m, total))
    want = fold_pairwise(Partial(acc, m, total))
    got = mla_decode.combine_splits(acc, m, total, None)
    tol = dict(atol=1e-12 if device == "cpu" else 1e-5, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(got.acc, want.acc, **tol)
    torch.testing.assert_close(got.sum, want.sum, **tol)
    clean = ~torch.isnan(want.max)  # (the merge's max keeps the NaN, the kernel's max skips it: acc and sum keep it)
    torch.testing.assert_close(got.max[clean], want.max[clean], **tol)
    assert torch.isnan(got.acc[2, 4]).all() and torch.isnan(got.sum[2, 4])
    assert torch.isfinite(got.acc[:2]).all() and torch.isfinite(got.acc[2, :4]).all()
    rows = mla_decode.combine_splits(acc, m, total, dt)
    assert isinstance(rows, Final)
    torch.testing.assert_close(rows.out, normalize(want, dt), atol=1e-12 if device == "cpu" else 1e-5, rtol=1e-6,
                               equal_nan=True)


if __name__ == "__main__":
    print("ok", run())
