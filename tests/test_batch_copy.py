"""A step's batch in one host-to-device copy (`UnifiedBatch.from_plans`, `copies.to_device`), and planning of
arrays already checked (`plan.plan_checked`): the same batches and plans as a copy per array and `plan_step`."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import SMALL_TILES, SPECS, make_block_table
from vllm_gaudi_unified import copies
from vllm_gaudi_unified.batch import InvariantBatch, StepBuffers, UnifiedBatch, _array_fields, build_unified_batch
from vllm_gaudi_unified.plan import InvariantPlan, PlanOptions, pad_plan, plan_checked, plan_step
from vllm_gaudi_unified.plan.arrays import validate

OPTIONS = {"tiles": SMALL_TILES, "gather": replace(SMALL_TILES, unique_layout="gather"),
           "invariant": PlanOptions(batch_invariant=True)}


@pytest.fixture
def packed(monkeypatch):
    """`to_device`'s one packed copy on the CPU too (as to a device): the tensors are views of one buffer."""
    monkeypatch.setattr(copies, "on_cpu", lambda device: False)


def _plan(name: str, options: str, pad: bool = False):
    step = SPECS[name]
    table, num_blocks = make_block_table(step, np.random.default_rng(0))
    plan = plan_step(step.query_lens, step.context_lens, table, step.block_size, num_blocks=num_blocks,
                     options=OPTIONS[options])
    if pad:
        s = plan.shape
        plan = pad_plan(plan, replace(s, query_len=s.query_len + 3, num_logits=s.num_logits + 1,
                                      num_causal_tiles=s.num_causal_tiles + 2 * bool(s.num_causal_tiles)))
    return plan


def _per_array(plan) -> dict:
    """A copy per array: each field of the plan as its own int64 tensor."""
    cls = InvariantBatch if isinstance(plan, InvariantPlan) else UnifiedBatch
    return {n: None if getattr(plan, n) is None else torch.from_numpy(np.ascontiguousarray(getattr(plan, n), np.int64))
            for n in _array_fields(cls)}


def _assert_fields(batch, plan) -> list:
    want = _per_array(plan)
    assert type(batch) is (InvariantBatch if plan.options.batch_invariant else UnifiedBatch)
    assert batch.plan is plan and tuple(want) == _array_fields(type(batch))
    got = []
    for name, w in want.items():
        t = getattr(batch, name)
        assert (t is None) == (w is None), name
        if t is not None:
            assert t.dtype == torch.int64 and t.shape == w.shape and torch.equal(t, w), name
            got.append(t)
    return got


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("name", ["seed", "decode", "prefill", "chunked_prefill", "prefix_caching", "ragged_partial"])
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
def test_a_whole_step_in_one_copy_equals_a_copy_per_array(packed, name, options, pad):
    plan = _plan(name, options, pad)
    batch = UnifiedBatch.from_plan(plan, "cpu")
    tensors = _assert_fields(batch, plan)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one buffer, one copy
    assert all(t.storage_offset() % copies.ALIGN == 0 and t.is_contiguous() for t in tensors)


@pytest.mark.parametrize("options", list(OPTIONS))
def test_on_the_cpu_the_batch_is_the_plans_arrays(options):
    """No copy at all on the CPU: each tensor shares the plan's int64 array."""
    plan = _plan("seed", options)
    for device in (None, "cpu", torch.device("cpu")):
        batch = UnifiedBatch.from_plan(plan, device)
        _assert_fields(batch, plan)
        for name in _array_fields(type(batch)):
            a = getattr(plan, name)
            if a is not None and a.size and a.dtype == np.int64 and a.flags.c_contiguous:
                assert getattr(batch, name).data_ptr() == a.ctypes.data, name


def test_the_meta_device_gets_every_field_in_its_shape():
    plans = [_plan("seed", "tiles"), _plan("ragged_partial", "invariant", pad=True)]
    rows = np.arange(5, dtype=np.int64)
    batches, (extra,) = UnifiedBatch.from_plans(plans, "meta", (rows,))
    assert extra.device.type == "meta" and extra.shape == (5,)
    for batch, plan in zip(batches, plans):
        assert batch.device.type == "meta"
        for name, want in _per_array(plan).items():
            t = getattr(batch, name)
            assert (t is None) == (want is None) and (t is None or (t.shape == want.shape and t.dtype == torch.int64))


def test_several_plans_and_host_arrays_ride_one_copy(packed):
    plans = [_plan("seed", "tiles"), _plan("decode", "invariant"), _plan("prefill", "gather", pad=True)]
    odd = [np.arange(12, dtype=np.int32).reshape(3, 4).T,  # int32, not contiguous
           np.array([True, False, True]), np.zeros((0, 3), np.int64), np.arange(7)[::2]]
    batches, extra = UnifiedBatch.from_plans(plans, "cpu", odd)
    tensors = [t for b, p in zip(batches, plans) for t in _assert_fields(b, p)]
    for got, want in zip(extra, odd):
        assert got.dtype == torch.int64 and got.shape == want.shape and np.array_equal(got.numpy(), want)
    assert len({t.untyped_storage().data_ptr() for t in tensors + list(extra)}) == 1
    assert all(t.storage_offset() % copies.ALIGN == 0 for t in tensors + list(extra))


def test_a_split_step_is_one_copy_too(packed):
    """A step over a plan's gather cap: its pieces in one copy, each as its own per-array batch."""
    from vllm_gaudi_unified.plan.split import GatherCap, split_plan

    step = SPECS["decode"]
    table, num_blocks = make_block_table(step, np.random.default_rng(0))
    opts = OPTIONS["gather"]
    whole = plan_step(step.query_lens, step.context_lens, table, step.block_size, options=opts)
    cap = GatherCap(None, max(2, whole.shape.num_unique_blocks // 3))
    bucket = _Capped(cap)
    batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, options=opts,
                                bucket=bucket, device="cpu")
    assert batch.pieces
    tensors = [t for b in (batch, *batch.pieces) for t in _assert_fields(b, b.plan)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert len(split_plan(whole, cap)) == 1 + len(batch.pieces)


class _Capped:
    """A bucket plan of one bucket (each piece padded to its own shape) with a gather cap."""

    def __init__(self, cap):
        self.gather_cap = cap

    def find(self, shape):
        return shape


def test_bad_input_to_the_copy_errors_clearly():
    plan = _plan("seed", "tiles")
    with pytest.raises(ValueError, match="plans must be StepPlans .*got dict"):
        UnifiedBatch.from_plans([{}])
    with pytest.raises(ValueError, match="extra arrays must be numpy integer arrays, got float64"):
        UnifiedBatch.from_plans([plan], None, [np.zeros(3)])
    with pytest.raises(ValueError, match="extra arrays must be numpy integer arrays"):
        UnifiedBatch.from_plans([plan], None, [[1, 2]])
    with pytest.raises(ValueError, match="device 'nope' is not a torch device"):
        UnifiedBatch.from_plan(plan, "nope")


@pytest.mark.parametrize("options", [None, *OPTIONS.values()], ids=["default", *OPTIONS])
@pytest.mark.parametrize("name", ["seed", "chunked_prefill", "prefix_caching", "ragged_partial", "long_causal"])
def test_plan_checked_is_plan_step(name, options):
    """The same planner and the same plan, whole and for a subset of the requests (its own arrays)."""
    step = SPECS[name]
    table, num_blocks = make_block_table(step, np.random.default_rng(1))
    q, c, bs = np.asarray(step.query_lens), np.asarray(step.context_lens), step.block_size
    checked = validate(q, c, table, bs, None, num_blocks)
    keep = np.arange(q.size) % 2 == 0
    for rows in (None, keep, ~keep, np.array([q.size - 1, 0])):
        if rows is not None and not q[rows].size:
            continue
        got = plan_checked(checked, bs, rows=rows, num_blocks=num_blocks, options=options)
        sel = slice(None) if rows is None else rows
        want = plan_step(q[sel], c[sel], table[sel], bs, num_blocks=num_blocks, options=options)
        assert type(got) is type(want) and got.shape == want.shape and got.bucket == want.bucket
        for n in _array_fields(InvariantBatch if isinstance(want, InvariantPlan) else UnifiedBatch):
            a, b = getattr(got, n), getattr(want, n)
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), n


def test_plan_checked_encoder_only_and_bad_input():
    q, c = np.array([3, 5]), np.zeros(2, np.int64)
    table = np.zeros((2, 0), np.int64)
    checked = validate(q, c, table, 4, None, None)
    got, want = (plan_checked(checked, 4, causal=False), plan_step(q, c, table, 4, causal=False))
    assert got.bidirectional and got.shape == want.shape and np.array_equal(got.causal_q_start, want.causal_q_start)
    with pytest.raises(ValueError, match="rows select no request"):
        plan_checked(checked, 4, rows=np.zeros(2, bool))
    with pytest.raises(ValueError, match="options must be a PlanOptions or None"):
        plan_checked(checked, 4, options="tiles")
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        plan_checked(checked, 0)


class _Copies(torch.overrides.TorchFunctionMode):
    """Counts `Tensor.copy_` calls (the host-to-device copies of a batch built into buffers)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.Tensor.copy_
        return func(*args, **(kwargs or {}))


def _step_batches(buffers, names, options):
    """(batch into `buffers`, batch without) of each step, checked before the next build into the buffers."""
    for name in names:
        step = SPECS[name]
        table, num_blocks = make_block_table(step, np.random.default_rng(2))
        args = (step.query_lens, step.context_lens, table, step.block_size)
        with _Copies() as copied:
            kept = build_unified_batch(*args, num_blocks=num_blocks, options=OPTIONS[options], buffers=buffers)
        fresh = build_unified_batch(*args, num_blocks=num_blocks, options=OPTIONS[options])
        yield kept, fresh, copied.count


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("reserve", [False, True], ids=["growing", "reserved"])
def test_steps_built_into_buffers_are_one_copy_into_one_block_and_equal_those_built_without(options, reserve):
    """Off the host (`copy=True`: the device path on the CPU), step after step: every field of the batch
    equals the batch built without buffers; its tensors are views of the one device block at aligned offsets,
    filled by one copy. Without a reservation the blocks grow (new addresses); a smaller step after a bigger
    one, steps with empty arrays (an invariant plan's routes, a step without causal tiles) stay exact."""
    names = ["prefill", "long_causal", "decode", "seed", "parallel_sampling", "ragged_partial", "seed"]
    sizes = {"token_seg_start": 64, "shared_lo": 1 << 18} if reserve else None  # (room for every step's arrays)
    buffers = StepBuffers("cpu", reserve=sizes, copy=True)
    blocks, empties = set(), 0
    for kept, fresh, copies_made in _step_batches(buffers, names, options):
        tensors = _assert_fields(kept, kept.plan)
        assert copies_made == 1
        for name in _array_fields(type(kept)):
            x, y = getattr(kept, name), getattr(fresh, name)
            assert (x is None) == (y is None) and (x is None or (x.shape == y.shape and torch.equal(x, y))), name
        block = buffers.blocks.block
        assert all(t.untyped_storage().data_ptr() == block.data_ptr() and t.storage_offset() % copies.ALIGN == 0
                   for t in tensors if t.numel())
        empties += any(not t.numel() for t in tensors)
        blocks.add(block.data_ptr())
    assert empties and (len(blocks) == 1) == reserve


def test_a_kept_copy_grows_past_its_reservation_and_falls_back_to_pageable_memory():
    """`pin` where no pinned memory exists: pageable blocks. An array beyond the reservation lays out new,
    larger blocks; the arrays stay exact, and the next step of the same shapes keeps the new addresses."""
    kept = copies.KeptCopy(torch.device("cpu"), pin=True, reserve=[16, 4])
    assert kept.pin == torch.cuda.is_available() and kept.block.numel() == 32
    small = [np.arange(5, dtype=np.int32), np.zeros((0, 2), np.int64)]
    big = [np.arange(80).reshape(8, 10)[:, ::2], None]  # (40 elements, not contiguous)
    addresses = []
    for i, arrays in enumerate((small, big, big, small, big, small)):
        if i == 4:
            kept.MAX_LAYOUTS = 1  # (then each step lays its views out again: the same offsets)
        got = kept(arrays)
        for a, t in zip(arrays, got):
            assert (t is None) == (a is None) and (a is None or (t.dtype == torch.int64 and np.array_equal(t.numpy(), a)))
        addresses.append(got[0].data_ptr())
    assert kept.block.numel() == 64 and addresses[0] != addresses[1] == addresses[2] == addresses[3] == addresses[5]
    kept.wait()
