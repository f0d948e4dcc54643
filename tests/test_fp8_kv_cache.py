"""fp8 KV caches in the core: every path reads quantized blocks and dequantizes after its gather.

The reference is the dense float64 reference over the *dequantized* cache
(`stored * scale`, computed exactly in float64), so with float64 queries the
only differences left are summation order (1e-6), and with bf16 the usual 1e-2.
Scales in every form `paths/kv_quant.py` accepts: a float, a one-element tensor,
per block, per (slot, KV head) as vllm-gaudi's dynamic `k_scales`, per (block,
KV head, channel) as its `v_scales[1]`. Unreadable slots hold NaN bytes and, for
per-block scales, NaN scales, so reading one would show.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SMALL_TILES, SPECS, assert_matches, make_block_table, make_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_gaudi_unified import PlanOptions, build_unified_batch, unified_attention
from vllm_gaudi_unified.paths import prompts
from vllm_gaudi_unified.paths.kv_quant import FP8_DTYPES, dequantize, quantize
from vllm_gaudi_unified.reference import reference_attention

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE_FORMS = ("none", "float", "tensor", "per_block", "per_slot_head", "per_channel")


def _scale(form: str, cache_shape, gen: torch.Generator):
    nb, bs, hkv, d = cache_shape
    shapes = {"per_block": (nb, 1, 1, 1), "per_slot_head": (nb, bs, hkv, 1), "per_channel": (nb, 1, hkv, d)}
    if form == "none":
        return None
    if form == "float":
        return 0.37
    if form == "tensor":
        return torch.tensor([1.7], dtype=torch.float32)
    return (0.25 + torch.rand(shapes[form], generator=gen)).to(torch.float32)


def _fp8_case(step, fp8, k_form, v_form, seed=0, options=SMALL_TILES, query_dtype=torch.float64):
    """(q, k, v, fp8 key/value caches, scales, float64 dequantized caches, table) with poisoned dead slots."""
    rng = np.random.default_rng(seed)
    table, nb = make_block_table(step, rng)
    q, k, v, kc, vc = make_tensors(step, table, nb, torch.float64, seed)
    gen = torch.Generator().manual_seed(seed)
    ks, vs = _scale(k_form, kc.shape, gen), _scale(v_form, vc.shape, gen)
    dead = torch.isnan(kc)  # make_tensors poisoned every slot no request may read
    kq = quantize(kc, fp8, 1.0 if ks is None else ks)  # NaN / inf slots stay NaN / inf (or NaN: e4m3 has no inf)
    vq = quantize(vc, fp8, 1.0 if vs is None else vs)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    if isinstance(ks, torch.Tensor) and ks.numel() > 1:  # a dead block's scale is poisoned too
        ks[dead.all(-1).all(-1).all(-1)] = float("nan")
    return (q.to(query_dtype), k.to(query_dtype), v.to(query_dtype), kq, vq, ks, vs, kd, vd, table, nb)


@pytest.mark.parametrize("split", [None, True], ids=["default", "split"])
@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("spec_name", ["seed", "decode", "chunked_prefill", "prefix_caching", "gqa"])
def test_every_path_against_the_dequantized_reference(fmt, spec_name, split, monkeypatch):
    """`split`: the prompt route's split form on these small grids too (`prompts.SPLIT_CONTEXT`), its
    context and new keys read from the fp8 cache as two parts (`prompts._keys(split=True)`)."""
    step = SPECS[spec_name]
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8[fmt], "per_slot_head", "float")
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=SMALL_TILES)
    monkeypatch.setattr(prompts, "SPLIT_CONTEXT", split)
    ran = []
    real = prompts._split_rows
    monkeypatch.setattr(prompts, "_split_rows", lambda *a: ran.append(1) or real(*a))
    out = unified_attention(q, k, v, kq, vq, batch, 0.37, k_scale=ks, v_scale=vs)
    assert bool(ran) == bool(split and prompts.split_context(batch))
    ref = reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.37)
    assert_matches(out, ref)


@pytest.mark.parametrize("k_form", SCALE_FORMS)
@pytest.mark.parametrize("layout", ["slice", "gather"])
def test_scale_forms_and_unique_layouts(k_form, layout):
    """Each scale form on K (V gets the next form), both unique layouts; the 'seed' step has all three paths."""
    v_form = SCALE_FORMS[(SCALE_FORMS.index(k_form) + 1) % len(SCALE_FORMS)]
    step = SPECS["seed"]
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8["e4m3"], k_form, v_form, seed=3)
    opts = PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8, unique_layout=layout)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=opts)
    assert batch.phase == "csu" and batch.unique_layout == layout
    out = unified_attention(q, k, v, kq, vq, batch, 0.5, k_scale=ks, v_scale=vs)
    assert_matches(out, reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.5))


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_batch_invariant_mode_reads_fp8(fmt):
    step = SPECS["prefix_caching"]
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8[fmt], "per_block", "per_channel", seed=5)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=PlanOptions(batch_invariant=True, invariant_rows=2, invariant_chunk=4))
    out = unified_attention(q, k, v, kq, vq, batch, 0.4, k_scale=ks, v_scale=vs)
    assert_matches(out, reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.4))


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_bf16_queries_over_fp8_cache(fmt):
    step = SPECS["ragged_partial"]
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8[fmt], "float", "per_slot_head",
                                                           query_dtype=torch.bfloat16)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=SMALL_TILES)
    out = unified_attention(q, k, v, kq, vq, batch, 0.4, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.bfloat16
    assert_matches(out, reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.4))


class _Conversions(TorchDispatchMode):
    """Records the element count of every tensor converted out of an fp8 dtype."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype in FP8.values() and func.overloadpacket in (
                torch.ops.aten._to_copy, torch.ops.aten.to, torch.ops.aten.copy_):
            self.numels.append(x.numel())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["slice", "gather"])
def test_no_full_cache_dequantized_copy(layout):
    """A large cache of which the step reads a few blocks: every fp8 conversion is of gathered blocks
    (at most the step's bucket sizes), none of the whole cache."""
    step = SPECS["seed"]
    rng = np.random.default_rng(0)
    table, nb = make_block_table(step, rng)
    big = 4096  # blocks; the step's ids stay below nb (< 32)
    q, k, v, kc, vc = make_tensors(step, table, nb, torch.float64)
    kq = torch.zeros(big, *kc.shape[1:], dtype=torch.float8_e4m3fn)
    vq = torch.zeros_like(kq)
    kq[:nb], vq[:nb] = quantize(torch.nan_to_num(kc), kq.dtype), quantize(torch.nan_to_num(vc), vq.dtype)
    opts = PlanOptions(causal_tile=4, shared_rows=4, shared_tile_keys=8, unique_layout=layout)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=big,
                                options=opts)
    with _Conversions() as seen:
        unified_attention(q, k, v, kq, vq, batch, 0.5, k_scale=0.5, v_scale=2.0)
    per_block = kq[0].numel()
    assert seen.numels, "no fp8 conversion seen: the probe is not watching the paths"
    assert max(seen.numels) <= per_block * max(nb, batch.bucket.num_shared_blocks), seen.numels


@pytest.mark.parametrize("kw, match", [
    (dict(k_scale=0.5), "k_scale is given but the cache dtype is torch.float64"),
    (dict(v_scale=-1.0), "v_scale must be None, a finite positive float"),
    (dict(k_scale=torch.ones(3, 2)), r"k_scale shape \(3, 2\) must be one element"),
])
def test_scale_errors_name_the_field(kw, match):
    step = SPECS["decode"]
    table, nb = make_block_table(step, np.random.default_rng(0))
    q, k, v, kc, vc = make_tensors(step, table, nb)
    if "v_scale" in kw or "k_scale" in kw and isinstance(kw["k_scale"], torch.Tensor):
        kc, vc = quantize(torch.nan_to_num(kc), torch.float8_e4m3fn), quantize(torch.nan_to_num(vc), torch.float8_e4m3fn)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size)
    with pytest.raises(ValueError, match=match):
        unified_attention(q, k, v, kc, vc, batch, 0.5, **kw)


def test_quantize_rounding_and_names():
    x = torch.tensor([4.825, -4.825, 0.3, 1e-3, 0.0])
    nearest = quantize(x, torch.float8_e4m3fn).float()
    toward_zero = quantize(x, torch.float8_e4m3fn, rounding="toward_zero").float()
    assert nearest[0] == 5.0 and toward_zero[0] == 4.5 and toward_zero[1] == -4.5
    assert (toward_zero.abs() <= x.abs()).all() and ((toward_zero - x).abs() <= (x.abs() * 0.125 + 2 ** -9)).all()
    assert FP8_DTYPES["fp8"] is torch.float8_e4m3fn and FP8_DTYPES["fp8_e5m2"] is torch.float8_e5m2
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize(x, torch.float8_e4m3fn, rounding="up")


def test_split_step_reads_fp8_in_every_piece():
    """A step split under a bucket plan's gather cap (plan/split.py): each piece dequantizes its own blocks."""
    from dataclasses import replace

    from test_split import CASES, KB, CappedPlan

    from vllm_gaudi_unified.plan.split import GatherCap

    step = CASES["prefix_and_chunks"]
    q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8["e4m3"], "per_slot_head", "float", seed=4)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size,
                                options=replace(SMALL_TILES, unique_layout="gather"),
                                bucket=CappedPlan(GatherCap(KB, 3), True))
    assert batch.pieces
    out = unified_attention(q, k, v, kq, vq, batch, 0.37, k_scale=ks, v_scale=vs)
    assert_matches(out, reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.37))
