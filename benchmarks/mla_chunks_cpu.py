"""MLA decode's unique routes on the CPU, side by side in one run: the dense route (`mla_decode.py`, what the
CPU picks), the chunks route (`mla_chunks.py`, what an HPU and the Gaudi route pick) and the generic tiles.

`python -m benchmarks.mla_chunks_cpu --out FILE.json [--heads 16 --requests 16 --seq 1024 --block-size 128]`.
Wall-clock median of `--iters` steps after 2 warm-ups (`torch.get_num_threads()` threads), bf16 latents of
512 + 64, and the max error against a float32 dense reference over every request."""
from __future__ import annotations

import json
import math
import statistics
import time
from unittest import mock

import torch

from vllm_gaudi_unified import attention, build_unified_batch
from vllm_gaudi_unified.mla import mla_attention
from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.tools.cli import Parser

L, R = 512, 64


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--out", type=output_path, required=True)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    a = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    bs, n, h = a.block_size, a.requests, a.heads
    per = math.ceil(a.seq / bs)
    ids = torch.randperm(n * per, generator=g) + 1
    table = ids.view(n, per).tolist()
    cache = torch.randn(n * per + 1, bs, L + R, generator=g).to(torch.bfloat16)
    q = torch.randn(n, h, L + R, generator=g).to(torch.bfloat16)
    latent = torch.stack([cache[table[r][(a.seq - 1) // bs], (a.seq - 1) % bs] for r in range(n)])
    batch = build_unified_batch([1] * n, [a.seq - 1] * n, table, bs)
    scale = 192 ** -0.5
    ref = []
    for r in range(n):
        kv = cache[torch.tensor(table[r])].flatten(0, 1)[: a.seq].float()
        ref.append(torch.softmax(q[r].float() @ kv.T * scale, -1) @ kv[:, :L])
    ref = torch.stack(ref)
    real = attention.mla_unique_route
    routes = {"dense": lambda b, qq, *x: real(b, qq, *x), "chunks": lambda b, qq, *x: real(b, qq.to("meta"), *x),
              "tiles": lambda *x: None}
    report = {"threads": torch.get_num_threads(), "heads": h, "requests": n, "seq": a.seq, "block_size": bs,
              "bucket": str(batch.bucket)}
    for name, route in routes.items():
        taken = []
        with mock.patch.object(attention, "mla_unique_route", lambda *x: taken.append(route(*x)) or taken[-1]):
            step = lambda: mla_attention(q, latent, cache, batch, scale, L)
            err = (step().float() - ref).abs().max().item()
            for _ in range(2):
                step()
            times = []
            for _ in range(a.iters):
                t = time.perf_counter()
                step()
                times.append((time.perf_counter() - t) * 1e3)
        report[name] = {"route_taken": taken[0], "ms": statistics.median(times), "max_err": err}
        print(name, report[name], flush=True)
    with atomic_write(a.out) as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
