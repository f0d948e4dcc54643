"""Cases for the unique path's Triton kernel (paths/unique_kernel.py), shared by two tests.

On CPU `test_fp8_fused.py` runs this file in a process of its own with TRITON_INTERPRET=1 (Triton
reads it when it is first imported, so the interpreter cannot be switched on inside the test
process), float64 queries, against the float64 reference over the dequantized cache at 1e-6. On
CUDA the same cases run in bf16 through the compiled kernel (1e-2). Every case routes the unique
path through the kernel (and the others through flash: the exact stand-in on CPU), on a shuffled
block table whose unreadable slots hold NaN/inf bytes (and NaN per-block scales). The cases with a
shared prefix (SMALL_TILES' 4-row tiles) send their shared tiles through the kernel too
(`unique.kernel_takes_shared`; tests/shared_kernel_cases.py checks that route on its own).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fused_standin  # noqa: E402
from conftest import SMALL_TILES, SPECS, Step, assert_matches  # noqa: E402
from test_fp8_kv_cache import FP8, SCALE_FORMS, _fp8_case  # noqa: E402

from vllm_gaudi_unified import Bucket, attention, build_unified_batch, unified_attention  # noqa: E402
from vllm_gaudi_unified.paths import fused, unique  # noqa: E402
from vllm_gaudi_unified.paths.kv_quant import quantize  # noqa: E402
from vllm_gaudi_unified.reference import reference_attention  # noqa: E402

#: (spec, fmt, k scale form, layout, window, kernel constants). Block sizes 4 and 8 with 16 keys a
#: step: several blocks per step; a block size of 32: one block over two steps; split keys 8: many
#: splits per token, most of them empty for short contexts.
CASES = [
    ("decode", "e4m3", "float", "slice", None, {}),
    ("decode", "e5m2", "per_slot_head", "gather", None, {"KERNEL_SPLIT_KEYS": 8}),
    ("decode", "e4m3", "per_channel", "gather", 5, {}),
    ("seed", "e5m2", "tensor", "gather", None, {}),
    ("seed", "e4m3", "per_block", "slice", None, {"KERNEL_SPLIT_KEYS": 8}),
    ("gqa", "e4m3", "none", "gather", None, {}),
    ("mqa", "e5m2", "per_slot_head", "gather", None, {}),
    ("prefix_caching", "e4m3", "per_channel", "gather", None, {"KERNEL_SPLIT_KEYS": 16}),
    ("parallel_sampling", "e5m2", "float", "slice", None, {}),
    ("ragged_partial", "e4m3", "per_slot_head", "gather", 6, {"KERNEL_SPLIT_KEYS": 8}),
    ("long_blocks", "e4m3", "per_block", "gather", None, {"KERNEL_SPLIT_KEYS": 32}),
]
SPECS_HERE = dict(SPECS, long_blocks=Step([1, 1, 2], [70, 33, 64], 32, num_qo_heads=8, num_kv_heads=2))
#: Verify steps on the unique units (`PlanOptions.unique_tokens`): (step, fmt, k scale form, layout, units,
#: kernel constants). Ragged drafts, GQA/MQA, partial blocks, many splits; parallel sampling with drafts (its
#: prefix's shared tiles join the kernel, the units then one slot per token); a prompt and a long chunk beside.
VERIFY_CASES = [
    (Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8), "e4m3", "per_slot_head", "gather", 4, {"KERNEL_SPLIT_KEYS": 8}),
    (Step([4, 4, 4], [13, 30, 9], 4, num_qo_heads=8, num_kv_heads=2), "e5m2", "float", "slice", 4, {}),
    (Step([3, 4, 2], [6, 11, 17], 4, num_qo_heads=6, num_kv_heads=1), "e4m3", "per_block", "gather", 8, {}),
    (Step([4, 2, 3, 4], [13, 13, 14, 13], 4, prefix_groups=[([0, 1, 2, 3], 3)]), "e4m3", "none", "gather", 4, {}),
    (Step([9, 3, 1, 4, 12], [0, 21, 9, 5, 16], 4), "e5m2", "tensor", "slice", 4, {"KERNEL_SPLIT_KEYS": 16}),
    # a 37-token prompt on the causal tiles beside verify requests, its pairs in the kernel too (the tokens
    # past its first unit one program each, over several steps of new keys)
    (Step([37, 3, 4, 1], [0, 21, 9, 5], 4), "e4m3", "per_block", "gather", 4, {"prompt_route": "tiles"}),
]


def kernel_routes(device: str, set_attr=setattr) -> None:
    """Flash (its exact stand-in off CUDA) wherever it applies, the Triton kernel on the unique path, 16 keys
    a program (several programs per token even in small cases)."""
    set_attr(attention, "kernel_for", lambda batch, q, cap: "flash" if cap is None else None)
    set_attr(attention, "kernel_unique_applies", lambda kc, vc: True)
    if device == "cpu":
        set_attr(fused, "FLASH", fused_standin.flash)
    set_attr(unique, "KERNEL_KEYS", 16)


def scan_order_matches(device: str) -> None:
    """`unique.scan_token_order` (one Triton scan) is the stable sort by token: every slot once, a token's slots in
    index order from its start; padding slots (row n) last; more slots than one scan chunk, tokens without
    slots, a single slot."""
    g = torch.Generator().manual_seed(5)
    for s, n in ((2500, 37), (7, 300), (1, 1), (1030, 4)):
        rows = torch.randint(0, n + 1, (s,), generator=g).to(device)
        order, starts = unique.scan_token_order(rows, n)
        want = torch.sort(rows.cpu(), stable=True).indices
        assert torch.equal(order.cpu(), want), (s, n)
        assert torch.equal(starts.cpu(), torch.searchsorted(rows.cpu()[want], torch.arange(n + 1))), (s, n)
    # units of 4: requests of 1-9 new tokens, then 3 padding tokens (each its own): the unit starts listed after
    # the starts, in token order, their count last
    lens = np.array([1, 3, 4, 9, 2, 5])
    seg = np.concatenate([np.repeat(np.cumsum(lens) - lens, lens), np.arange(lens.sum(), lens.sum() + 3)])
    n = seg.size
    rows = torch.randint(0, n + 1, (50,), generator=g).to(device)
    order, starts = unique.scan_token_order(rows, n, torch.as_tensor(seg).to(device), 4)
    t = np.arange(n)
    listed = t[(seg == t) | (t - seg >= 4)]
    assert starts.shape[0] == 2 * n + 2 and starts[-1].item() == listed.size
    assert np.array_equal(starts[n + 1:n + 1 + listed.size].cpu().numpy(), listed)
    assert torch.equal(order.cpu(), torch.sort(rows.cpu(), stable=True).indices)


def check(device: str, query_dtype: torch.dtype, set_attr=setattr) -> int:
    """Every case, then unquantized caches through the kernel (the query's dtype, fp16, bf16 on CUDA), then
    a padded bucket; returns the count.
    Flash (the exact stand-in off CUDA) on every path that takes it, the kernel on the unique path;
    `set_attr`: pytest's `monkeypatch.setattr` inside a test process."""
    scan_order_matches(device)
    kernel_routes(device, set_attr)
    calls = []
    inner = unique.kernel_unique_partial
    # (each call records whether the units took the step's self and causal pairs: `units_take_new_pairs`)
    finals = []  # (and whether it wrote the step's final rows: the only path, `final`)
    set_attr(attention, "kernel_unique_partial",
             lambda *a, **kw: calls.append(kw.get("new") is not None) or finals.append(kw.get("final", False))
             or inner(*a, **kw))
    defaults = {k: getattr(unique, k) for k in ("KERNEL_SPLIT_KEYS",)}
    done = 0
    for i, (name, fmt, k_form, layout, window, consts) in enumerate(CASES):
        for k, v in {**defaults, **consts}.items():
            set_attr(unique, k, v)
        v_form = SCALE_FORMS[(SCALE_FORMS.index(k_form) + 1) % len(SCALE_FORMS)]
        step = SPECS_HERE[name]
        q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8[fmt], k_form, v_form, seed=i,
                                                               query_dtype=query_dtype)
        opts = replace(SMALL_TILES, unique_layout=layout)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                    options=opts, sliding_window=window, device=device)
        assert batch.phase[2] == "u", (name, batch.phase)
        dev = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        before = len(calls)
        out = unified_attention(*map(dev, (q, k, v, kq, vq)), batch, 0.37, k_scale=dev(ks), v_scale=dev(vs))
        assert len(calls) > before, name
        # a decode step's self pairs in the kernel (no causal tiles; with the shared tiles these cases' 4-row
        # tiles send to it too)
        assert calls[-1] == (batch.phase[0] == "-"), (name, batch.phase)
        assert finals[-1] == (calls[-1] and batch.bucket.num_prompts == 0), name  # (then its rows are the only ones)
        ref = reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.37,
                                  sliding_window=window)
        assert_matches(out.cpu(), ref)
        done += 1
    takes, plain = unique.units_take_new_pairs, unique.token_order
    for i, (step, fmt, k_form, layout, units, consts) in enumerate(VERIFY_CASES):
        # every other case with the unit starts listed (a program per unit: the scan, on the CPU too), the others
        # with a program per token (as where the scan does not apply)
        set_attr(unique, "token_order", lambda rows, n, seg=None, units=1, listed=i % 2 == 0: (
            unique.scan_token_order(rows, n, seg, units) if listed and rows.numel() else plain(rows, n)))
        consts = dict(consts)
        route = consts.pop("prompt_route", "dense")
        # on the tiles, long requests too (`units_take_new_pairs` keeps the kernel's units to dense steps)
        set_attr(attention, "units_take_new_pairs",
                 takes if route == "dense" else lambda b, kernel: b.plan.unique_units > 1 and kernel)
        for k, v in {**defaults, **consts}.items():
            set_attr(unique, k, v)
        v_form = SCALE_FORMS[(SCALE_FORMS.index(k_form) + 1) % len(SCALE_FORMS)]
        q, k, v, kq, vq, ks, vs, kd, vd, table, nb = _fp8_case(step, FP8[fmt], k_form, v_form, seed=50 + i,
                                                               query_dtype=query_dtype)
        opts = replace(SMALL_TILES, unique_layout=layout, unique_tokens=units, prompt_route=route)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                    options=opts, device=device)
        assert batch.phase[2] == "u" and batch.plan.unique_units == units, batch.phase
        dev = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        before = len(calls)
        out = unified_attention(*map(dev, (q, k, v, kq, vq)), batch, 0.37, k_scale=dev(ks), v_scale=dev(vs))
        assert len(calls) > before, i
        # the units take their requests' new pairs, but where the shared tiles join the kernel (one slot a token)
        assert calls[-1] == (batch.phase[1] != "s"), (i, batch.phase)
        assert finals[-1] == (calls[-1] and batch.bucket.num_prompts == 0), (i, batch.phase)
        ref = reference_attention(q, k, v, kd, vd, step.query_lens, step.context_lens, table, 0.37)
        assert_matches(out.cpu(), ref)
        done += 1
    for k, v in defaults.items():
        set_attr(unique, k, v)
    set_attr(attention, "units_take_new_pairs", takes)
    set_attr(unique, "token_order", plain)
    # Unquantized caches through the kernel: the query's dtype, and the 16-bit ones the route takes on CUDA
    # (products in that dtype, fp32 statistics: 1e-2 against the reference over the rounded inputs); then a
    # bucket with padding slots (rows past the tokens sort last and are never read).
    from conftest import make_block_table, make_tensors

    step = SPECS["ragged_partial"]
    table, nb = make_block_table(step, np.random.default_rng(9))
    q, k, v, kc, vc = make_tensors(step, table, nb, torch.float64, seed=9)
    plain = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=SMALL_TILES)
    s = plain.shape
    big = Bucket("csu", s.query_len + 5, s.num_shared_blocks + 2 * SMALL_TILES.blocks_per_tile(step.block_size),
                 s.num_unique_blocks + 7, s.num_logits + 2, s.num_causal_tiles + 3, *s.prompts)
    # bf16 on CUDA only: Triton's interpreter computes bf16 products wrong (seen with 3.9: scores of 1e9
    # where fp16 and fp32 match the torch path), while the compiled kernel matches the reference.
    for dt in (torch.float16,) + ((torch.bfloat16,) if device != "cpu" else ()):
        low = [x.to(dt) for x in (q, k, v, kc, vc)]
        ref = reference_attention(*(x.double() for x in low), step.query_lens, step.context_lens, table, 0.37)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                    options=SMALL_TILES, device=device)
        before = len(calls)
        out = unified_attention(*(x.to(device) for x in low), batch, 0.37)
        assert len(calls) > before and out.dtype == dt
        assert_matches(out.cpu(), ref)
        done += 1
    ref = reference_attention(q, k, v, kc, vc, step.query_lens, step.context_lens, table, 0.37)
    for cache_dtype, bucket in ((query_dtype, None), (torch.float8_e4m3fn, big)):
        kx, vx = (c.to(query_dtype) if cache_dtype == query_dtype else quantize(c, cache_dtype) for c in (kc, vc))
        if cache_dtype != query_dtype:  # the reference over the dequantized cache
            ref = reference_attention(q, k, v, kx.double(), vx.double(), step.query_lens, step.context_lens, table,
                                      0.37)
        batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                    options=SMALL_TILES, bucket=bucket, device=device)
        before = len(calls)
        out = unified_attention(*(x.to(query_dtype).to(device) for x in (q, k, v)), kx.to(device), vx.to(device),
                                batch, 0.37)
        assert len(calls) > before and (bucket is None or batch.bucket == big)
        assert_matches(out.cpu(), ref)
        done += 1
    return done


if __name__ == "__main__":
    print("ok", check("cpu", torch.float64))
