"""Small groups' shared tiles as further slots of the unique kernel (`unique.kernel_takes_shared`).

The kernel runs under Triton's interpreter in a process of its own (tests/shared_kernel_cases.py:
float64 against the float64 reference at 1e-6, fp16 at 1e-2) and compiled on CUDA (bf16, 1e-2). The
rest runs here: which tiles qualify, the slots handed to the kernel, the split rule, and that the
routes without the kernel (the Gaudi route, soft cap) still take the shared path.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch

import fused_standin
from conftest import SMALL_TILES, Step, assert_matches, make_block_table, make_tensors, \
    run_interpreted
from vllm_gaudi_unified import attention, build_unified_batch, unified_attention
from vllm_gaudi_unified.paths import fused, unique
from vllm_gaudi_unified.reference import reference_attention

HAS_TRITON = importlib.util.find_spec("triton") is not None
SAMPLING = Step([1] * 6, [13, 14, 17, 21, 12, 30], 4, prefix_groups=[([0, 1, 2, 3, 4], 3)], num_qo_heads=8,
                num_kv_heads=2)


def _batch(rows: int, step: Step = SAMPLING, bucket=None):
    table, nb = make_block_table(step, np.random.default_rng(3))
    opts = replace(SMALL_TILES, shared_rows=rows, shared_rows_max=rows, unique_layout="gather")
    return build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                               options=opts, bucket=bucket), table, nb


def test_kernel_takes_small_tiles_only(monkeypatch):
    """The rule reads the tiles' rows (a static shape of the bucket and options), nothing per step."""
    assert unique.kernel_takes_shared(_batch(4)[0])
    assert unique.kernel_takes_shared(_batch(16)[0])
    assert not unique.kernel_takes_shared(_batch(32)[0])
    monkeypatch.setattr(unique, "KERNEL_SHARED_MAX_ROWS", 2)
    assert not unique.kernel_takes_shared(_batch(4)[0])
    lone = Step([1, 1], [9, 5], 4)  # no shared tile
    assert not unique.kernel_takes_shared(_batch(4, lone)[0])


def test_slots_with_shared_are_the_pairs_each_row_sees():
    """Unique slots first, then one slot per (tile row, tile block) with a visible slot; every other
    cell (padding rows and columns) goes to row n, which the kernel never reads. Together: exactly
    the (token, block, lo, hi) pairs of the plan, each once."""
    batch, table, _ = _batch(4)
    n = batch.bucket.query_len
    rows, ids, lo, hi = unique._slots_with_shared(batch, n)
    u = batch.unique_rows.shape[0]
    assert torch.equal(rows[:u], batch.unique_rows) and torch.equal(ids[:u], batch.unique_blocks)
    real = rows < n
    assert bool((hi[real] > lo[real]).all()) and bool((hi[u:][~real[u:]] <= lo[u:][~real[u:]]).all())
    got = sorted(zip(rows[real].tolist(), ids[real].tolist(), lo[real].tolist(), hi[real].tolist()))
    want = []  # every (token, block, visible slots) of a decode step: its context blocks
    bs = SAMPLING.block_size
    for r, c in enumerate(SAMPLING.context_lens):
        for i in range(-(-c // bs)):
            want.append((r, int(table[r, i]), 0, min(bs, c - i * bs)))
    assert got == sorted(want)


def test_splits_rule():
    """`KERNEL_SPLIT_KEYS` keys a split; more splits while the launch is small, none under the minimum."""
    assert unique._splits(2048, 2048) == 1  # decode 256 x 2k, 8 KV heads: unchanged
    assert unique._splits(8192, 512) == 1  # decode 64 x 8k: 512 programs already
    assert unique._splits(2176, 128) == 4  # parallel sampling 16 x (2k + 64): 512 programs of 544 keys
    assert unique._splits(2176, 16) == 8  # heads 8/1/128, 16 programs: splits of 384 keys (three key tiles)
    shared = unique.KERNEL_MIN_SHARED_SPLIT_KEYS
    assert unique._splits(2176, 16, shared) == 32  # the same with shared cells: one key tile a split
    assert unique._splits(1024, 64) == 4  # 8 decodes x 1k: splits of two key tiles, not 8 of one
    assert unique._splits(128, 128, shared) == 1  # one block a token: one key tile, no split
    assert unique._splits(3 * 128, 16, shared) == 4  # three key tiles: 4 splits of one (the 4th empty), not 8
    assert unique._splits(40000, 8) == unique.KERNEL_MAX_SPLITS
    assert unique._splits(20000, 4096) == 4  # ceil(20000 / 8192) rounded up to a power of two


@pytest.mark.parametrize("route", ["gaudi", "soft_cap"])
def test_routes_without_the_kernel_keep_the_shared_path(monkeypatch, route):
    """No flash (the Gaudi route: `kernel_for` None) or a soft cap: the shared tiles run their own path
    and the kernel is never asked; float64 against the reference."""
    seen = []
    monkeypatch.setattr(fused, "FLASH", fused_standin.flash)
    monkeypatch.setattr(attention, "kernel_for",
                        lambda batch, q, cap: None if route == "gaudi" or cap is not None else "flash")
    monkeypatch.setattr(attention, "kernel_unique_applies", lambda kc, vc: True)
    monkeypatch.setattr(attention, "kernel_unique_partial", lambda *a, **kw: seen.append("kernel"))
    inner = attention.shared_partial
    monkeypatch.setattr(attention, "shared_partial", lambda *a, **kw: seen.append("shared") or inner(*a, **kw))
    batch, table, nb = _batch(4)
    q, k, v, kc, vc = make_tensors(SAMPLING, table, nb, torch.float64, seed=3)
    cap = 7.0 if route == "soft_cap" else None
    out = unified_attention(q, k, v, kc, vc, batch, 0.37, logits_soft_cap=cap)
    ref = reference_attention(q, k, v, kc, vc, SAMPLING.query_lens, SAMPLING.context_lens, table, 0.37,
                              logits_soft_cap=cap)
    assert "shared" in seen and "kernel" not in seen
    assert_matches(out, ref)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernel on the CPU)")
def test_shared_kernel_interpreted():
    """The kernel with the shared cells under the interpreter, every case of shared_kernel_cases.py."""
    words = run_interpreted("shared_kernel_cases.py")
    import shared_kernel_cases

    assert words == ["ok", str(3 * len(shared_kernel_cases.CASES))]


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
def test_shared_kernel_on_cuda(monkeypatch):
    """The compiled kernel, the same cases in bf16 (1e-2)."""
    import shared_kernel_cases

    assert shared_kernel_cases.check("cuda", torch.bfloat16, monkeypatch.setattr) == 3 * len(shared_kernel_cases.CASES)


@pytest.mark.parametrize("slots", [1, 7, 300, 1500])
def test_token_order_is_a_stable_sort(monkeypatch, slots):
    """By rank (up to `RANK_SORT_MAX_SLOTS`) or by sort: the same permutation as a stable sort by row,
    padding rows (n) last, and each token's first place in it."""
    rng = np.random.default_rng(slots)
    n = 40
    rows = torch.from_numpy(rng.integers(0, n + 1, slots))
    want = torch.from_numpy(np.argsort(rows.numpy(), kind="stable"))
    starts = torch.from_numpy(np.searchsorted(np.sort(rows.numpy()), np.arange(n + 1)))
    for rank_max in (unique.RANK_SORT_MAX_SLOTS, 0):
        monkeypatch.setattr(unique, "RANK_SORT_MAX_SLOTS", rank_max)
        order, got = unique.token_order(rows, n)
        assert torch.equal(order, want) and torch.equal(got, starts)
