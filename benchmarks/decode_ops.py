"""The ops of one layer of the CPU dense decode route (`paths/decodes.py`), each timed alone, one thread.

At `decode_profile`'s shapes (8 decodes of ~141 keys, 8 query / 2 KV heads, head_dim 32, float32, block
128, the caches two views of one `[.., K | V]` memory as vLLM's): the gather of K and V as two
index ops over the non-contiguous views against one `index_select` of the packed memory, and SDPA with
`enable_gqa` against the query heads grouped per KV head; then the route as it runs (`dense_decodes`).

    python -m benchmarks.decode_ops
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from vllm_gaudi_unified import build_unified_batch
from vllm_gaudi_unified.paths import decodes

R, HQ, HKV, D, BS, CTX = 8, 8, 2, 32, 128, 140


def _us(fn, n: int = 2000) -> float:
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    kv = torch.randn(64, BS, HKV, 2 * D)
    kc, vc = kv[..., :D], kv[..., D:]
    table = rng.permutation(64)[: R * 2].reshape(R, 2)
    ctx = np.full(R, CTX)
    batch = build_unified_batch(np.ones(R, np.int64), ctx, table, BS)
    slots = torch.from_numpy(table[np.arange(R), ctx // BS] * BS + ctx % BS)
    q, k, v = torch.randn(R, HQ, D), torch.randn(R, HKV, D), torch.randn(R, HKV, D)
    layout = decodes.decode_layout(batch)
    index = layout.index(slots)
    L = index.numel() // R
    x = decodes.packed_kv(kc, vc).index_select(0, index).view(R, L, HKV, 2 * D).transpose(1, 2)
    kk, vv = x[..., :D], x[..., D:]
    mask = torch.zeros(R, 1, 1, L)
    rows = [
        ("gather K and V: two index ops over the views", lambda: (kc.reshape(-1, HKV, D)[index.view(R, L)],
                                                                  vc.reshape(-1, HKV, D)[index.view(R, L)])),
        ("gather K and V: one index_select of the packed memory",
         lambda: decodes.packed_kv(kc, vc).index_select(0, index)),
        ("SDPA, enable_gqa, mask", lambda: F.scaled_dot_product_attention(q[:, :, None], kk, vv, attn_mask=mask,
                                                                         scale=0.1, enable_gqa=True)),
        ("SDPA, query heads grouped per KV head, mask",
         lambda: F.scaled_dot_product_attention(q.unflatten(1, (HKV, HQ // HKV)), kk, vv, attn_mask=mask, scale=0.1)),
        ("SDPA, query heads grouped per KV head, no mask",
         lambda: F.scaled_dot_product_attention(q.unflatten(1, (HKV, HQ // HKV)), kk, vv, scale=0.1)),
        ("dense_decodes (the route, a layer)", lambda: decodes.dense_decodes(q, k, v, kc, vc, batch, 0.1, slots)),
    ]
    print("| op (one layer, one thread) | us |")
    print("|---|---|")
    for name, fn in rows:
        print(f"| {name} | {_us(fn):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
