"""The batch-invariant fast route (paths/invariant_fast.py) off the GPU: the Triton kernel under its
interpreter, flash as the exact stand-in (tests/fused_standin.py), float64.

Run by `test_batch_invariance.py::test_fast_route_interpreted` in a process of its own with
TRITON_INTERPRET=1 (Triton reads it when first imported). Checks the route's plumbing: every named
scenario, the target alone = inside its batch bitwise (with several position-fixed splits per token:
`SPLIT_KEYS` 8, `SPLIT_HEAD_KEYS` 4, `KEYS` 4), and the batch against the float64 dense reference (1e-6).
On CUDA the same scenarios run through the compiled kernel and the real flash in bf16
(`test_invariant_mode_scenarios`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fused_standin  # noqa: E402
from test_batch_invariance import (INVARIANT, SCENARIOS, Req, World, _block_table, _tensors,  # noqa: E402
                                   assert_same_bits, run_world)

from vllm_gaudi_unified import build_unified_batch, unified_attention  # noqa: E402
from vllm_gaudi_unified.paths import fused, invariant_fast, unique  # noqa: E402
from vllm_gaudi_unified.plan import invariant as plan_invariant  # noqa: E402
from vllm_gaudi_unified.reference import reference_attention  # noqa: E402


#: Worlds of the fast route's own: the programs that take their request's new keys (one-token requests, units)
#: beside the ones that do not (a windowed chunk's tokens have slots but their new keys in a flash segment).
FAST_WORLDS = {
    "window_decode": World(Req(1, 22), others=(Req(13, 22), Req(1, 5), Req(2, 7)), position=1, sliding_window=9),
    "window_chunk_beside_decodes": World(Req(13, 22), others=(Req(1, 22), Req(1, 5), Req(2, 7)), position=2,
                                         sliding_window=9),
    "lone_token": World(Req(1, 0), others=(Req(1, 40), Req(3, 12), Req(6, 30), Req(2, 0)), position=2,
                        pad=(3, 2, 1, 0, 2)),
    # One split per token and nothing else in the step: the kernel's final rows (alone), against the same rows
    # folded and normalized next to a longer context (several splits) or a flash segment.
    "final_decode": World(Req(1, 6), others=(Req(1, 5), Req(3, 7), Req(1, 40)), position=1, pad=(2, 0, 0, 0, 1)),
    "final_unit": World(Req(3, 7), others=(Req(1, 6), Req(4, 0), Req(1, 40)), position=1),
    "final_batch": World(Req(1, 6), others=(Req(1, 5), Req(2, 3)), pad=(3, 0, 0, 0, 2)),
    # One KV head: splits of `SPLIT_HEAD_KEYS` keys (an MQA verify step in 8 splits), folded by the ordered
    # combine into final rows alone, into a Partial beside a flash segment (a chunk of 5 over a context).
    "mqa_unit_splits": World(Req(3, 30), others=(Req(1, 6), Req(5, 9), Req(1, 13)), position=1, num_qo_heads=6,
                             num_kv_heads=1, pad=(2, 0, 0, 0, 1)),
}


def check(set_attr=setattr) -> int:
    calls = []
    inner = invariant_fast.fast_partial
    set_attr(invariant_fast, "applies", lambda batch, q, kc, vc, cap: cap is None)
    set_attr(invariant_fast, "fast_partial", lambda *a, **kw: calls.append(1) or inner(*a, **kw))
    set_attr(fused, "FLASH", fused_standin.flash)
    set_attr(unique, "KERNEL_KEYS", 4)
    set_attr(plan_invariant, "SPLIT_KEYS", 8)
    set_attr(plan_invariant, "SPLIT_HEAD_KEYS", 4)  # (one KV head: splits of 4 keys)
    done = 0
    for name, world in {**SCENARIOS, **FAST_WORLDS}.items():
        before = len(calls)
        assert_same_bits(*run_world(world, INVARIANT, torch.float64))
        assert len(calls) > before or world.soft_cap is not None, name
        table, num_blocks = _block_table(world, np.random.default_rng(world.seed))
        q, k, v, kc, vc, sinks, _ = _tensors(world, table, num_blocks, torch.float64, "cpu")
        ql, cl = [r.query_len for r in world.requests], [r.context_len for r in world.requests]
        batch = build_unified_batch(ql, cl, table, world.block_size, sliding_window=world.sliding_window,
                                    num_blocks=num_blocks, options=INVARIANT)
        out = unified_attention(q, k, v, kc, vc, batch, 0.37, logits_soft_cap=world.soft_cap, sinks=sinks)
        ref = reference_attention(q, k, v, kc, vc, ql, cl, table, 0.37, sliding_window=world.sliding_window,
                                  logits_soft_cap=world.soft_cap, sinks=sinks)
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        done += 1
    return done


if __name__ == "__main__":
    print("ok", check())
