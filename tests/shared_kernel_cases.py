"""Small groups' shared tiles through the unique path's Triton kernel (`unique.kernel_takes_shared`).

On CPU `test_shared_kernel.py` runs this file in a process of its own with TRITON_INTERPRET=1 (Triton
reads it when first imported), float64 queries against the float64 reference (1e-6), then fp16 (1e-2:
the interpreter's bf16 products are wrong, see unique_kernel_cases.py); on CUDA the same cases run
compiled in bf16 (1e-2). Flash is the exact stand-in off CUDA. Every case: a shuffled block table whose
unreadable slots hold NaN/inf, groups sharing full prefix blocks, ragged own lengths with partial last
blocks, GQA; each checks which route ran (the kernel with the shared cells, no shared path, or the
shared path when the tiles have more rows than `KERNEL_SHARED_MAX_ROWS`).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import SMALL_TILES, Step, assert_matches, make_block_table, make_tensors  # noqa: E402

from vllm_gaudi_unified import Bucket, attention, build_unified_batch, unified_attention  # noqa: E402
from vllm_gaudi_unified.paths import unique  # noqa: E402
from vllm_gaudi_unified.reference import reference_attention  # noqa: E402
from unique_kernel_cases import kernel_routes  # noqa: E402

#: (name, step, tile rows, constants of `unique`, shared cells through the kernel?)
CASES = [
    # parallel sampling: 4 samples over 3 shared blocks, own lengths 1..9 past it (partial last blocks)
    ("sampling", Step([1] * 4, [13, 14, 17, 21], 4, prefix_groups=[([0, 1, 2, 3], 3)], num_qo_heads=8,
                      num_kv_heads=2), 4, {}, True),
    # two groups and a lone decode; many splits per token (split keys 8, occupancy rule on)
    ("two_groups", Step([1] * 9, [17, 19, 24, 33, 40, 35, 34, 37, 5], 8,
                        prefix_groups=[([0, 1, 2], 2), ([3, 4, 5, 6, 7], 4)], num_qo_heads=6, num_kv_heads=3),
     8, {"KERNEL_SPLIT_KEYS": 8, "KERNEL_MIN_PROGRAMS": 1 << 12, "KERNEL_MIN_SHARED_SPLIT_KEYS": 4}, True),
    # a group larger than the tile rows: two row chunks, the second with padding rows; the slots ordered past
    # `unique_kernel.token_slots`' bound (the concatenation and `token_order`)
    ("row_chunks", Step([1] * 6, [9, 12, 12, 16, 10, 13], 4, prefix_groups=[([0, 1, 2, 3, 4, 5], 2)],
                        num_qo_heads=4, num_kv_heads=1), 4, {"SCAN_ORDER_MAX_WORK": 0}, True),
    # a prompt beside the group (csu): its own chunk's shared cells go through the kernel too
    ("with_prompt", Step([5, 1, 1, 1], [8, 11, 9, 14], 4, prefix_groups=[([0, 1, 2, 3], 2)]), 4, {}, True),
    # the unique slots as the cache slice `[0, num_unique_blocks)` (block id = slot), beside the shared cells
    ("slice", Step([1] * 4, [13, 14, 17, 21], 4, prefix_groups=[([0, 1, 2, 3], 3)], num_qo_heads=8,
                   num_kv_heads=2), 4, {"layout": "slice"}, True),
    # tiles of more rows than the kernel takes: the shared path (flash) as before
    ("large_group", Step([1] * 4, [13, 14, 17, 21], 4, prefix_groups=[([0, 1, 2, 3], 3)]), 4,
     {"KERNEL_SHARED_MAX_ROWS": 2}, False),
]


def check(device: str, query_dtype: torch.dtype, set_attr=setattr) -> int:
    """Every case (then every case in a padded bucket) in `query_dtype`, and in fp16 off CUDA / bf16 on
    it; returns the count. `set_attr`: pytest's `monkeypatch.setattr` inside a test process."""
    kernel_routes(device, set_attr)
    calls = []
    inner = unique.kernel_unique_partial
    set_attr(attention, "kernel_unique_partial",
             lambda *a, shared=False, **kw: calls.append(("kernel", shared)) or inner(*a, shared=shared, **kw))
    for name in ("fused_shared_partial", "shared_partial"):
        f = getattr(attention, name)
        set_attr(attention, name, lambda *a, _f=f, **kw: calls.append(("shared", False)) or _f(*a, **kw))
    names = ("KERNEL_SPLIT_KEYS", "KERNEL_MIN_PROGRAMS", "KERNEL_MIN_SHARED_SPLIT_KEYS", "KERNEL_SHARED_MAX_ROWS",
             "SCAN_ORDER_MAX_WORK")
    defaults = {k: getattr(unique, k) for k in names}
    low = torch.float16 if device == "cpu" else torch.bfloat16
    done = 0
    for i, (name, step, rows, consts, in_kernel) in enumerate(CASES):
        for k, v in {**defaults, **consts}.items():
            if k != "layout":
                set_attr(unique, k, v)
        opts = replace(SMALL_TILES, shared_rows=rows, shared_rows_max=rows,
                       unique_layout=consts.get("layout", "gather"))
        table, nb = make_block_table(step, np.random.default_rng(i))
        nb += 8 * (opts.unique_layout == "slice")  # (room for the padded bucket's slice; unread blocks hold NaN/inf)
        tensors = make_tensors(step, table, nb, torch.float64, seed=i)
        plain = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                    options=opts)
        assert plain.phase[1] == "s" and plain.unique_layout == opts.unique_layout, (name, plain.phase)
        s = plain.shape
        big = Bucket(s.phase, s.query_len + 3, s.num_shared_blocks + opts.blocks_per_tile(step.block_size),
                     s.num_unique_blocks + 5, s.num_logits + 2, s.num_causal_tiles, *s.prompts)
        for dt, bucket in ((query_dtype, None), (query_dtype, big), (low, None)):
            x = [t.to(dt) for t in tensors]
            ref = reference_attention(*(t.double() for t in x), step.query_lens, step.context_lens, table, 0.37)
            batch = build_unified_batch(step.query_lens, step.context_lens, table, step.block_size, num_blocks=nb,
                                        options=opts, bucket=bucket, device=device)
            if in_kernel:
                same_slots(batch)
            before = len(calls)
            out = unified_attention(*(t.to(device) for t in x), batch, 0.37)
            ran = calls[before:]
            expect = [("kernel", True)] if in_kernel else [("shared", False), ("kernel", False)]
            assert ran == expect, (name, ran)
            assert out.dtype == dt
            assert_matches(out.cpu(), ref)
            done += 1
    for k, v in defaults.items():
        set_attr(unique, k, v)
    return done


def same_slots(batch) -> None:
    """`unique_kernel.token_slots` (one launch) gives the slots of `_slots_with_shared` in `token_order`'s order."""
    from vllm_gaudi_unified.paths import unique_kernel

    n = batch.bucket.query_len
    rows, *want = unique._slots_with_shared(batch, n)
    order, want_starts = unique.token_order(rows, n)
    chunk = unique_kernel.SLOTS_CHUNK
    for unique_kernel.SLOTS_CHUNK in (chunk, 16):  # one pass, then chunks of 16 slots (two passes)
        ids, lo, hi, starts = unique_kernel.token_slots(batch, n)
        assert torch.equal(starts.cpu(), want_starts.cpu()), (starts, want_starts)
        real = int(starts[n])
        for got, w in zip((ids, lo, hi), want):
            assert torch.equal(got[:real].cpu(), w[order[:real]].cpu())
    unique_kernel.SLOTS_CHUNK = chunk


if __name__ == "__main__":
    print("ok", check("cpu", torch.float64))
