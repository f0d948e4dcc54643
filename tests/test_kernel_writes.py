"""torch.compile's view of what each user Triton kernel of the CUDA route writes.

Inductor takes the arguments its IR analysis of a user Triton kernel finds written
(`triton_kernel_wrap.identify_accessed_tensors`, `identify_mutated_tensors` in older torch) as mutated: it
clones them and copies them back into the graph's inputs. On CUDA the batch's index arrays are views of one
device buffer, so an argument found written that is (or shares storage with) one of the batch's tensors
corrupts the step. Each kernel is launched here as the route launches it on representative steps (the launch
intercepted, its arguments recorded; the surrounding torch code on CPU tensors; no GPU: a `GPUTarget` stands
in for the device, the analysis reads the target only) and its found-written set must be exactly its output
arguments (`WRITES`), none of them the batch's.

Not here: the Gluon MLA kernels (`mla_gluon.py`, `mla_gluon_seesaw.py`): `mla_decode.gluon_applies` keeps
them off while torch compiles, so inductor never analyses them.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch

import fused_standin
from conftest import SMALL_TILES, SPECS, Step, make_block_table, make_tensors

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its CUDA backend writes the kernels' IR)")

_COMBINE = lambda a: {"out_ptr"} if a["FINAL"] else {"out_ptr", "om_ptr", "ol_ptr"}  # noqa: E731
#: Each kernel's output arguments for a launch's arguments: all that torch.compile may take as written (`FINAL`:
#: the normalized rows only).
WRITES = {
    "unique_kernel": lambda a: {"out_ptr"} if a["FINAL"] else {"acc_ptr", "m_ptr", "l_ptr"},
    "order_kernel": lambda a: {"order_ptr", "starts_ptr"},
    "slots_kernel": lambda a: {"ids_ptr", "lo_ptr", "hi_ptr", "starts_ptr"},
    "mla_kernel": lambda a: {"acc_ptr"} if a["FINAL"] else {"acc_ptr", "m_ptr", "l_ptr"},
    "split_combine": _COMBINE,
    "ordered_combine": _COMBINE,
}
KERNELS = {"unique_kernel": ("unique_kernel", "order_kernel", "slots_kernel"),
           "mla_kernel": ("mla_kernel", "split_combine", "ordered_combine")}


def _unique_step(step: Step, opts, splits_keys=None, fp8: bool = False, shared=None, chunk=None, listed=False):
    """A GQA/MQA step through `unified_attention` with the kernel on the unique path (flash's exact stand-in
    elsewhere): the launches of `kernel_unique_partial` (and `token_slots`, `combine_splits`)."""
    from vllm_gaudi_unified import attention, build_unified_batch, unified_attention
    from vllm_gaudi_unified.paths import fused, unique

    patches = [(attention, "kernel_for", lambda batch, q, cap: "flash" if cap is None else None),
               (attention, "kernel_unique_applies", lambda kc, vc: True), (fused, "FLASH", fused_standin.flash),
               (unique, "KERNEL_KEYS", 16)]
    if splits_keys:
        patches.append((unique, "KERNEL_SPLIT_KEYS", splits_keys))
    if shared is not None:  # (the slots in token order by `token_slots`, else sorted after `_slots_with_shared`)
        patches.append((unique, "SCAN_ORDER_MAX_WORK", unique.SCAN_ORDER_MAX_WORK if shared else 0))
    if chunk:  # (`token_slots` in chunks: a counting pass, then a writing pass)
        from vllm_gaudi_unified.paths import unique_kernel

        patches.append((unique_kernel, "SLOTS_CHUNK", chunk))
    if listed:  # (the scan's order, as on CUDA: the unit starts listed, a program per unit, `WORK`)
        patches.append((unique, "token_order", lambda rows, n, seg=None, units=1: unique.scan_token_order(
            rows, n, seg, units)))
    table, nb = make_block_table(step, np.random.default_rng(3))
    q, k, v, kc, vc = make_tensors(step, table, nb, torch.float32, seed=3)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=opts)
    scales = {}
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        scales = {"k_scale": torch.rand(nb, step.block_size, step.num_kv_heads, 1) + 0.5,
                  "v_scale": torch.rand(nb, 1, 1, step.head_dim) + 0.5}
    return batch, patches, lambda: unified_attention(q, k, v, kc, vc, batch, 0.37, **scales)


def _scan_step(units: int):
    """`unique.scan_token_order` (the CUDA route's sort of the slots by token) on a batch's unique rows; with
    `units`, the unit starts of its requests (`token_seg_start`) listed too."""
    from vllm_gaudi_unified import build_unified_batch
    from vllm_gaudi_unified.paths import unique

    step = Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8)
    table, nb = make_block_table(step, np.random.default_rng(3))
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=replace(SMALL_TILES, unique_tokens=4))
    n = batch.bucket.query_len
    return batch, [], lambda: unique.scan_token_order(batch.unique_rows, n, batch.token_seg_start if units > 1
                                                      else None, units)


def _invariant_step(final: bool = False):
    """The batch-invariant fast route (`invariant_fast._slots_partial`: the kernel in position-fixed splits, then
    `ordered_combine`) on a verify unit beside decodes and a longer context."""
    from test_batch_invariance import INVARIANT

    from vllm_gaudi_unified.paths import invariant_fast
    from vllm_gaudi_unified.plan import invariant as plan_invariant

    step = Step([3, 1, 5, 1], [30, 6, 9, 13], 4, num_qo_heads=6, num_kv_heads=1)
    if final:  # (decodes and a unit only, the kernel's rows the step's: the combine's final rows)
        step = Step([1, 3, 1], [30, 6, 13], 4, num_qo_heads=6, num_kv_heads=1)
    patches = [(invariant_fast, "applies", lambda batch, q, kc, vc, cap: cap is None),
                (plan_invariant, "SPLIT_KEYS", 8), (plan_invariant, "SPLIT_HEAD_KEYS", 4)]
    return _rebuild(step, INVARIANT, patches)


def _rebuild(step, opts, patches):
    """(The invariant plan reads `plan_invariant`'s split constants: the batch is built under the patches.)"""
    return _built_under(patches, lambda: _unique_step(step, opts))


def _built_under(patches, build):
    saved = [(m, k, getattr(m, k)) for m, k, _ in patches]
    for m, k, v in patches:
        setattr(m, k, v)
    try:
        batch, more, launch = build()
    finally:
        for m, k, v in reversed(saved):
            setattr(m, k, v)
    return batch, patches + more, launch


def _mla_invariant_step():
    """The batch-invariant MLA route (`mla_invariant.decode_rows`: the kernel over the tokens' position-fixed
    splits, `TOKENS`, then `ordered_combine`) on decodes of several splits beside a prompt and a verify unit."""
    import mla_invariant_cases as cases

    from vllm_gaudi_unified import build_unified_batch
    from vllm_gaudi_unified.mla import absorb_query, mla_attention
    from vllm_gaudi_unified.paths import mla_decode
    from vllm_gaudi_unified.plan import invariant as plan_invariant

    def build():
        reqs, table, nb, q_nope, q_pe, latent, cache, w_uk, _ = cases.world((1, 70), [(1, 200), (5, 0), (3, 12)], 1,
                                                                             16, torch.float32)
        ql, cl = [q for q, _ in reqs], [c for _, c in reqs]
        batch = build_unified_batch(ql, cl, table, 16, num_blocks=nb, options=cases.OPTIONS)
        query, lat, cache = (x.float() for x in (absorb_query(q_nope, q_pe, w_uk), latent, cache))
        return batch, [], lambda: mla_attention(query, lat, cache, batch, 0.1, cases.L)

    # (key tiles and rope dims of 16: Triton 3.6 compiles no `tl.dot` over fewer, and an analysis that cannot
    # compile the kernel takes every argument as written)
    return _built_under([(mla_decode, "mla_unique_route", lambda *a: "kernel"), (mla_decode, "MLA_KEYS", 16),
                         (plan_invariant, "SPLIT_KEYS", 32), (cases, "R", 16)], build)


def _mla_step(step: Step, opts, consts: dict):
    """MLA through `mla_attention` with the unique pairs on `mla_kernel` (`kernel_mla_partial`)."""
    from test_mla import L, absorb_query, mla_tensors

    from vllm_gaudi_unified import attention, build_unified_batch
    from vllm_gaudi_unified.mla import mla_attention
    from vllm_gaudi_unified.paths import mla_decode

    table, nb, q_nope, q_pe, w_uk, _, latent, cache = mla_tensors(step, torch.float32, 0, True)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                options=opts)
    query = absorb_query(q_nope, q_pe, w_uk)
    patches = [(attention, "mla_unique_route", lambda *a: "kernel")] + [(mla_decode, k, v) for k, v in consts.items()]
    return batch, patches, lambda: mla_attention(query, latent, cache, batch, 0.1, L)


MLA_VERIFY = replace(SMALL_TILES, causal_tile=4, shared_rows=4, shared_rows_max=4, shared_tile_keys=8,
                     unique_tokens=4)
#: step name -> (its launches, the kernels it must launch)
STEPS = {
    "decode_final": (lambda: _unique_step(SPECS["decode"], SMALL_TILES), {"unique_kernel"}),
    "decode_splits_combine": (lambda: _unique_step(SPECS["decode"], SMALL_TILES, splits_keys=8),
                              {"unique_kernel", "split_combine"}),
    "decode_fp8_scales": (lambda: _unique_step(SPECS["decode"], SMALL_TILES, fp8=True, splits_keys=8),
                          {"unique_kernel", "split_combine"}),
    "verify_units_new_keys": (lambda: _unique_step(Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8),
                                                   replace(SMALL_TILES, unique_tokens=4), splits_keys=8),
                              {"unique_kernel", "split_combine"}),
    "sampling_shared_in_order": (lambda: _unique_step(
        Step([1] * 6, [13, 14, 17, 21, 12, 30], 4, prefix_groups=[([0, 1, 2, 3, 4], 3)], num_qo_heads=8,
             num_kv_heads=2), replace(SMALL_TILES, shared_rows=4, shared_rows_max=4, unique_layout="gather"),
        shared=True), {"slots_kernel", "unique_kernel"}),
    "sampling_shared_chunks": (lambda: _unique_step(
        Step([1] * 6, [13, 14, 17, 21, 12, 30], 4, prefix_groups=[([0, 1, 2, 3, 4], 3)], num_qo_heads=8,
             num_kv_heads=2), replace(SMALL_TILES, shared_rows=4, shared_rows_max=4), shared=True, chunk=16,
        splits_keys=8), {"slots_kernel", "unique_kernel", "split_combine"}),
    "verify_units_listed": (lambda: _unique_step(Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8),
                                                 replace(SMALL_TILES, unique_tokens=4), listed=True),
                            {"order_kernel", "unique_kernel"}),
    "sampling_shared_sorted": (lambda: _unique_step(
        Step([1] * 6, [13, 14, 17, 21, 12, 30], 4, prefix_groups=[([0, 1, 2, 3, 4], 3)], num_qo_heads=8,
             num_kv_heads=2), replace(SMALL_TILES, shared_rows=4, shared_rows_max=4), shared=False,
        splits_keys=8), {"unique_kernel", "split_combine"}),
    "scan_order": (lambda: _scan_step(1), {"order_kernel"}),
    "scan_order_units": (lambda: _scan_step(4), {"order_kernel"}),
    "batch_invariant": (_invariant_step, {"unique_kernel", "ordered_combine"}),
    "batch_invariant_final": (lambda: _invariant_step(final=True), {"unique_kernel", "ordered_combine"}),
    "mla_batch_invariant": (_mla_invariant_step, {"mla_kernel", "ordered_combine"}),
    "mla_decode": (lambda: _mla_step(SPECS["decode"], SMALL_TILES, {"MLA_KEYS": 16, "MLA_SPLIT_KEYS": 8}),
                   {"mla_kernel", "split_combine"}),
    "mla_decode_final": (lambda: _mla_step(SPECS["decode"], SMALL_TILES, {}), {"mla_kernel"}),
    "mla_sampling_shared": (lambda: _mla_step(SPECS["parallel_sampling"], replace(SMALL_TILES, unique_layout="gather"),
                                              {"MLA_KEYS": 16}), {"mla_kernel"}),
    "mla_verify": (lambda: _mla_step(Step([1, 3, 4, 2, 1], [13, 30, 7, 1, 2], 8), MLA_VERIFY, {"MLA_SPLIT_KEYS": 8}),
                   {"mla_kernel", "split_combine"}),
}

#: What a step's launch of a kernel shows (its arguments): that the step is the form it is named for.
SHOWS = {
    ("decode_final", "unique_kernel"): {"FINAL": True, "NEW_KEYS": 16},
    ("decode_splits_combine", "unique_kernel"): {"FINAL": False, "SPLITS": 8},
    ("decode_fp8_scales", "unique_kernel"): {"K_SCALES": 1, "V_SCALES": 2},
    ("verify_units_new_keys", "unique_kernel"): {"UNITS": 4, "NEW_KEYS": 16, "SPLITS": 4},
    ("verify_units_listed", "unique_kernel"): {"UNITS": 4, "WORK": True},
    ("verify_units_listed", "order_kernel"): {"UNITS": 4},
    ("sampling_shared_in_order", "slots_kernel"): {"ONE": True},
    ("sampling_shared_in_order", "unique_kernel"): {"SORTED": True},
    ("sampling_shared_chunks", "slots_kernel"): {"ONE": False},
    ("sampling_shared_sorted", "unique_kernel"): {"SORTED": False, "SLICE": False},
    ("scan_order_units", "order_kernel"): {"UNITS": 4},
    ("batch_invariant", "unique_kernel"): {"SPLIT_KEYS": 4, "UNITS": 3},
    ("batch_invariant", "ordered_combine"): {"FINAL": False},
    ("batch_invariant_final", "ordered_combine"): {"FINAL": True},
    ("mla_batch_invariant", "mla_kernel"): {"TOKENS": True, "SPLIT_KEYS": 16},
    ("mla_batch_invariant", "ordered_combine"): {"TOKENS": True, "FINAL": True},
    ("mla_decode", "mla_kernel"): {"FINAL": False, "SELF": True},
    ("mla_decode_final", "mla_kernel"): {"FINAL": True},
    ("mla_sampling_shared", "mla_kernel"): {"SLICE": False},
    ("mla_verify", "mla_kernel"): {"UNITS": 4, "UNIT_ROWS": True},
}


def _tensors_of(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor a batch holds (its fields, their plan and nested dataclasses, tuples and dicts)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (tuple, list)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("vllm_gaudi_unified"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in _tensors_of(x, seen)]


@functools.cache
def _launches(name: str):
    """(batch, [(kernel name, kernel, its arguments by name)]) of a step, every launch of the route's kernels
    intercepted; the outputs the launch leaves zero-filled (the torch code after it reads them)."""
    import triton
    from triton.backends.compiler import GPUTarget

    mods = {m: importlib.import_module(f"vllm_gaudi_unified.paths.{m}") for m in KERNELS}
    build, _ = STEPS[name]
    batch, patches, launch = build()
    launched = []

    def intercept(kname, kernel):
        def at(grid):
            def record(*a, **kw):
                args = {**dict(zip(kernel.arg_names, a)), **kw}
                launched.append((kname, kernel, args))
                for out in WRITES[kname](args):
                    if isinstance(args.get(out), torch.Tensor):
                        args[out].zero_()
            return record
        return type("Launch", (), {"__getitem__": lambda self, grid: at(grid)})()

    target = GPUTarget("cuda", 90, 32)
    patches = patches + [(triton.runtime.driver, "_active",
                          type("Target", (), {"get_current_target": lambda self: target})())]
    patches += [(mods[m], k, intercept(k, getattr(mods[m], k))) for m, ks in KERNELS.items() for k in ks]
    saved = [(m, k, getattr(m, k)) for m, k, _ in patches]
    try:
        for m, k, v in patches:
            setattr(m, k, v)
        launch()
        written = [(k, sorted(_found_written(kernel, args)), args) for k, kernel, args in launched]
    finally:
        for m, k, v in reversed(saved):
            setattr(m, k, v)
    return batch, written


def _found_written(kernel, args: dict) -> set[str]:
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    args = {k: v for k, v in args.items() if k not in ("num_warps", "num_stages")}
    if hasattr(wrap, "identify_accessed_tensors"):
        return {d.name for d in wrap.identify_accessed_tensors(kernel, args, {}).read_writes.writes}
    return set(wrap.identify_mutated_tensors(kernel, args, {}))


CASES = [(step, kernel) for step, (_, kernels) in STEPS.items() for kernel in sorted(kernels)]


@pytest.mark.parametrize("step,kernel", CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_compile_finds_each_kernel_writing_its_outputs_only(step, kernel):
    """Every launch of `kernel` in `step`: found written exactly its output arguments, none of them one of the
    batch's tensors or sharing storage with one."""
    batch, launched = _launches(step)
    mine = [(w, args) for k, w, args in launched if k == kernel]
    assert mine, f"{step} did not launch {kernel} (launched: {[k for k, _, _ in launched]})"
    shows = SHOWS.get((step, kernel), {})
    assert any(all(args.get(a) == v for a, v in shows.items()) for _, args in mine), (step, kernel, shows)
    batch_storage = {t.untyped_storage().data_ptr() for t in _tensors_of(batch) if t.numel()}
    assert len(batch_storage) > 3
    for written, args in mine:
        outputs = WRITES[kernel](args)
        assert set(written) == outputs, f"{kernel} in {step}: found written {written}, its outputs {sorted(outputs)}"
        shared = [a for a in written if args[a].untyped_storage().data_ptr() in batch_storage]
        assert not shared, f"{kernel} in {step} writes the batch's {shared}"


def test_every_route_kernel_is_checked():
    """Each kernel `WRITES` lists is launched by some step above, and every `triton.jit` kernel of the route's
    modules is in `WRITES`."""
    import triton

    assert {k for _, k in CASES} == set(WRITES)
    for m in KERNELS:
        mod = importlib.import_module(f"vllm_gaudi_unified.paths.{m}")
        kernels = {k for k, v in vars(mod).items() if isinstance(v, triton.runtime.JITFunction)
                   and not k.startswith("_")}
        assert kernels == set(KERNELS[m]), (m, kernels)
