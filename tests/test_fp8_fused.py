"""fp8 KV caches on the fused routes (CUDA's): flash over `read_blocks`' gathers, and the Triton kernel.

Off CUDA, flash is the exact stand-in (tests/fused_standin.py) and the kernel runs under Triton's
interpreter in a process of its own (tests/unique_kernel_cases.py); queries are float64, so every
case is held to 1e-6 against the float64 reference over the dequantized cache. On CUDA the same
kernel cases run compiled, in bf16 (1e-2).
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch

import fused_standin
from conftest import (SMALL_TILES, SPECS, Step, assert_matches, make_block_table, make_tensors,
                      run_interpreted)
from test_fp8_kv_cache import FP8, SCALE_FORMS, _Conversions, _fp8_case
from vllm_gaudi_unified import PlanOptions, attention, build_unified_batch, unified_attention
from vllm_gaudi_unified.paths import fused, unique
from vllm_gaudi_unified.paths.kv_quant import quantize
from vllm_gaudi_unified.reference import reference_attention

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def routes(monkeypatch):
    """Flash (the stand-in) wherever it applies, fused unique from block size 1, the kernel route off
    unless a test turns it on; records which unique route ran."""
    seen = []
    monkeypatch.setattr(fused, "FLASH", lambda *a, **kw: seen.append("flash") or fused_standin.flash(*a, **kw))
    monkeypatch.setattr(fused, "FUSED_UNIQUE_MIN_BLOCK_SIZE", 1)
    monkeypatch.setattr(attention, "kernel_for", lambda batch, q, cap: "flash" if cap is None else None)
    monkeypatch.setattr(attention, "kernel_unique_applies", lambda kc, vc: False)
    for name in ("kernel_unique_partial", "fused_unique_partial", "unique_partial"):
        inner = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _n=name, _f=inner, **kw: seen.append(_n) or _f(*a, **kw))
    return seen


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("spec_name", ["seed", "decode", "chunked_prefill", "prefix_caching", "parallel_sampling",
                                       "ragged_partial", "gqa", "mqa"])
def test_flash_paths_read_fp8_through_read_blocks(routes, fmt, spec_name):
    """Shared and unique flash paths over fp8 blocks dequantized after the gather (or slice)."""
    step = SPECS[spec_name]
    for i, (k_form, layout) in enumerate([("per_slot_head", "gather"), ("float", "slice"), ("per_channel", "gather")]):
        v_form = SCALE_FORMS[(SCALE_FORMS.index(k_form) + 2) % len(SCALE_FORMS)]
        q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8[fmt], k_form, v_form, seed=i)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                    options=replace(SMALL_TILES, unique_layout=layout))
        assert batch.plan.shared_prefix_visible or batch.phase[1] == "-"
        out = unified_attention(q, k, v, kq, vq, batch, 0.37, k_scale=ks, v_scale=vs)
        assert_matches(out, reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.37))
        assert "fused_unique_partial" in routes if batch.phase[2] == "u" else "unique_partial" not in routes
        # shared and unique through flash, and the prompt route where its prompts are ragged
        assert routes.count("flash") == sum(p != "-" for p in batch.phase) + batch.plan.prompt_ragged
        routes.clear()


@pytest.mark.parametrize("layout", ["slice", "gather"])
def test_flash_routes_make_no_full_cache_copy(routes, layout):
    """As test_fp8_kv_cache's probe, on the flash routes: every fp8 conversion is of gathered blocks."""
    step = SPECS["seed"]
    table, nb = make_block_table(step, np.random.default_rng(0))
    big = 4096
    q, k, v, kc, vc = make_tensors(step, table, nb, torch.float64)
    kq = torch.zeros(big, *kc.shape[1:], dtype=torch.float8_e4m3fn)
    vq = torch.zeros_like(kq)
    kq[:nb], vq[:nb] = quantize(torch.nan_to_num(kc), kq.dtype), quantize(torch.nan_to_num(vc), vq.dtype)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=big,
                                options=PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8,
                                                    unique_layout=layout))
    with _Conversions() as seen:
        unified_attention(q, k, v, kq, vq, batch, 0.5, k_scale=0.5, v_scale=2.0)
    assert [r for r in routes if r != "flash"] == ["fused_unique_partial"] and seen.numels
    assert max(seen.numels) <= kq[0].numel() * max(nb, batch.bucket.num_shared_blocks), seen.numels


def test_unique_route_choice(routes, monkeypatch):
    """4 of `_run_paths`: the kernel for fp8, bf16 and fp16 caches with flash and Triton; flash's unique
    path (over read_blocks) without Triton, and for fp32/fp64 caches (the kernel's dot would be tf32); the
    tiles without flash."""
    step = SPECS["decode"]
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8["e4m3"], "float", "float")
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb)
    monkeypatch.setattr(attention, "kernel_unique_applies", unique.kernel_unique_applies)
    # The route is what is checked here, not the kernel (tests below): record it, return only the self pairs
    # it takes for a decode (`unique.units_take_new_pairs`).
    from vllm_gaudi_unified.paths.causal import self_partial

    monkeypatch.setattr(attention, "kernel_unique_partial", lambda q, kc, vc, b, scale, *a, new=None, **kw:
                        routes.append("kernel") or self_partial(q, *new, scale, None))
    for triton_there in (True, False):
        monkeypatch.setattr(unique, "triton_importable", lambda t=triton_there: t)
        unified_attention(q, k, v, kq, vq, batch, 0.37, k_scale=ks, v_scale=vs)
        unified_attention(*(x.to(torch.bfloat16) for x in (q, k, v, kd, vd)), batch, 0.37)
    assert not unique.kernel_unique_applies(kq[..., ::2], vq[..., ::2])  # channels not consecutive
    monkeypatch.setattr(unique, "triton_importable", lambda: True)
    for dtype in (torch.float16, torch.float32, torch.float64):  # the fixture's kernel_for: flash for any dtype
        unified_attention(*(x.to(dtype) for x in (q, k, v, kd, vd)), batch, 0.37)
    monkeypatch.setattr(attention, "kernel_for", lambda batch, q, cap: None)
    unified_attention(q, k, v, kq, vq, batch, 0.37, k_scale=ks, v_scale=vs)
    unified_attention(*(x.to(torch.bfloat16) for x in (q, k, v, kd, vd)), batch, 0.37)
    assert [r for r in routes if r != "flash"] == ["kernel", "kernel", "fused_unique_partial", "fused_unique_partial",
                                                   "kernel", "fused_unique_partial", "fused_unique_partial",
                                                   "unique_partial", "unique_partial"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_unique_kernel_interpreted():
    """The Triton kernel's body under the interpreter, float64, every case of unique_kernel_cases.py."""
    words = run_interpreted("unique_kernel_cases.py")
    import unique_kernel_cases

    assert words == ["ok", str(len(unique_kernel_cases.CASES) + len(unique_kernel_cases.VERIFY_CASES) + 3)]


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
def test_unique_kernel_on_cuda(monkeypatch):
    """The compiled kernel, bf16 queries over fp8 (and bf16) caches, the same cases (1e-2)."""
    import unique_kernel_cases

    cases = unique_kernel_cases
    assert cases.check("cuda", torch.bfloat16, monkeypatch.setattr) == len(cases.CASES) + len(cases.VERIFY_CASES) + 4


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
@pytest.mark.parametrize("cache", ["bfloat16", "float16", "e4m3"])
def test_default_route_compiled_on_cuda(cache):
    """The default route of a 16-bit or fp8 cache on CUDA is the kernel, eager and under torch.compile
    (`graphs.compiled_attention`, what the benchmarks' `compiled` variant runs): both match the reference
    over the (dequantized) cache, unreadable slots poisoned; a step with every path (csu)."""
    from vllm_gaudi_unified.graphs import clear, compiled_attention

    step = Step(*(getattr(SPECS["prefix_caching"], f) for f in ("query_lens", "context_lens", "block_size",
                                                         "prefix_groups")), num_qo_heads=8, num_kv_heads=2,
                head_dim=64)
    dtype = torch.float16 if cache == "float16" else torch.bfloat16
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8.get(cache, torch.float8_e4m3fn), "float",
                                                           "float", query_dtype=dtype)
    kx, vx, kw = (kq, vq, dict(k_scale=ks, v_scale=vs)) if cache in FP8 else (kd.to(dtype), vd.to(dtype), {})
    ref = reference_attention(q.double(), k.double(), v.double(), kx.double() if cache not in FP8 else kd,
                              vx.double() if cache not in FP8 else vd, step.query_lens, step.context_lens, table, 0.37)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                device="cuda")
    dev = [x.cuda() for x in (q, k, v, kx, vx)]
    assert batch.phase[2] == "u" and unique.kernel_unique_applies(dev[3], dev[4])
    assert attention.kernel_for(batch, dev[0], None) == "flash"
    clear()
    for fn in (unified_attention, compiled_attention):
        assert_matches(fn(*dev, batch, 0.37, **kw).cpu(), ref)
    clear()


def _hopper_backend() -> bool:
    """Triton with its CUDA backend (ptxas included): the kernel compiles for sm_90 without a GPU."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton, or a build without the CUDA backend
        return False
    return True


@pytest.mark.skipif(not (HAS_TRITON and _hopper_backend()), reason="needs Triton's CUDA backend")
@pytest.mark.parametrize("cache, k_scales", [("bf16", 0), ("fp8e4nv", 1), ("fp8e5", 2)])
def test_unique_kernel_compiles_as_torch_compile_launches_it(cache, k_scales):
    """Compiled for Hopper on the CPU, with the float arguments typed fp64 as Inductor passes them
    (`graphs.compiled_attention`) and fp32 as a plain launch does: the loop-carried statistics keep the
    accumulator's dtype in both (fp64 scores once made Triton refuse the kernel under torch.compile)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_gaudi_unified.paths.unique_kernel import unique_kernel

    names = list(inspect.signature(unique_kernel.fn).parameters)
    const = dict(HQ=32, G=4, ROWS=16, D=128, D_PAD=128, BS=16, KEYS=128, SPLITS=2, SLICE=False,
                 K_SCALES=k_scales, V_SCALES=0, SPLIT_KEYS=8192 if k_scales else 0,  # the invariant mode's splits
                 UNITS=1 + k_scales,  # a decode's and a verify step's units, with their new keys
                 NEW_KEYS=16, NEW_SELECT=bool(k_scales),  # (the invariant mode's choice of programs)
                 FINAL=not k_scales, EXACT_DIV=not k_scales,  # (a decode step's final rows, IEEE-divided)
                 SORTED=bool(k_scales),  # (the invariant mode's slots, in token order from the planner)
                 WORK=bool(k_scales))  # (a verify step's programs over the listed unit starts)
    for scalar in ("fp64", "fp32"):
        types = dict(q_ptr="*bf16", k_ptr=f"*{cache}", v_ptr=f"*{cache}", ks_ptr="*fp32", vs_ptr="*fp32",
                     order_ptr="*i64", starts_ptr="*i64", ids_ptr="*i64", lo_ptr="*i64", hi_ptr="*i64", seg_ptr="*i64",
                     acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", score_scale=scalar, v_scale=scalar,
                     kn_ptr="*bf16", vn_ptr="*bf16", new_scale=scalar, new_v=scalar, take_ptr="*i32", out_ptr="*bf16")
        sig = {n: types.get(n, "constexpr" if n in const else "i32") for n in names}
        src = ASTSource(fn=unique_kernel, signature=sig, constexprs={(names.index(n),): x for n, x in const.items()})
        assert "mma" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
