"""What fused attention would give MLA's latent products at DeepSeek-V3 shapes (CUDA): a probe, not a route.

`python -m benchmarks.mla_fused_probe --out FILE.json`. The latent routes (`paths/mla_decode.py`,
`paths/mla_shared.py`) run each product and every softmax pass as separate torch ops; this times the same
products fused, on tensors laid out once beforehand, to say how much of the gap to the floor a fused kernel
would close (docs/benchmarks.md, MLA):

* `mem_efficient`: torch's memory-efficient attention (`aten._efficient_attention_forward`, the CUTLASS
  kernel: any head dim, values narrower than keys, the log-sum-exp the merge needs), one head whose query
  rows are the 128 heads of a token (MLA's latent is one KV head: FlashMLA's layout);
* `compiled`: `mla_shared.latent_attend` under torch.compile (static shapes): its elementwise passes
  fused, what a graph compiler does with the same ops (an HPU's does);
* `eager`: `latent_attend` as the routes run it, both softmaxes.

Cases: 128 decodes x 4096 keys (the keys gathered per request first: the gather is timed apart), and the
shared prefix, 64 tokens x 128 heads = 8192 rows against one 4096-key prefix (a view, no gather).
Errors: max |out - float32 reference| over the rows checked.
"""
from __future__ import annotations

import json

import torch

from benchmarks.mla_decode import H, L, R, SCALE, matmul_rate, read_bandwidth, timed
from vllm_gaudi_unified.paths import mla_shared
from vllm_gaudi_unified.files import output_path
from vllm_gaudi_unified.tools.cli import Parser


def mem_efficient(q, kv):
    """q `[B, M, D]` (rows: heads), kv `[B, K, D]` -> (out `[B, M, L]`, lse `[B, 1, M]`): one head."""
    out, lse = torch.ops.aten._efficient_attention_forward(
        q[:, :, None], kv[:, :, None], kv[:, :, None, :L], None, None, None, None, None, 0.0, 0, True,
        scale=SCALE)[:2]
    return out[:, :, 0], lse


def reference(q, kv, rows):
    return torch.stack([torch.softmax(q[b].float() @ kv[b].float().T * SCALE, -1) @ kv[b, :, :L].float()
                        for b in rows])


def probe(name, q, kv, gather_ms, rows, report):
    ref = reference(q, kv, rows)
    entry = {"rows": q.shape[0] * q.shape[1], "keys_per_row": kv.shape[1], "gather_ms": gather_ms,
             "flops": 2 * q.shape[0] * q.shape[1] * kv.shape[1] * (L + R + L)}
    err = lambda out: (out[rows].float() - ref).abs().max().item()

    def latent(softmax):
        def run():
            saved, mla_shared.LATENT_SOFTMAX = mla_shared.LATENT_SOFTMAX, softmax
            try:
                return mla_shared.latent_attend(q, kv, None, L, SCALE)
            finally:
                mla_shared.LATENT_SOFTMAX = saved
        return run

    compiled = torch.compile(mla_shared.latent_attend, dynamic=False, fullgraph=True)
    runs = {"eager_compute_softmax": lambda: latent("compute")(),
            "eager_product_softmax": lambda: latent("product")(),
            "compiled_compute_softmax": lambda: compiled(q, kv, None, L, SCALE),
            "mem_efficient": lambda: mem_efficient(q, kv)}
    for key, fn in runs.items():
        try:
            out = fn()
            acc = out[0] / out[2][..., None] if key != "mem_efficient" else out[0]
            entry[f"{key}_max_err"] = err(acc)
            entry[f"{key}_ms"] = timed(fn)
            entry[f"{key}_TFLOPs"] = entry["flops"] / (entry[f"{key}_ms"] * 1e-3) / 1e12
        except Exception as exc:  # reported, not hidden
            entry[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:400]
    report[name] = entry
    print(name, json.dumps(entry), flush=True)


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--out", type=output_path, required=True)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "read_bandwidth_GBps": read_bandwidth() / 1e9,
              "matmul_TFLOPs": matmul_rate() / 1e12}
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    # 128 decodes x 4096 keys: blocks of 128 slots, each request's 32 blocks at random places
    cache = torch.randn(128 * 32 + 1, 128, L + R, generator=g, **bf)
    table = torch.randperm(128 * 32, generator=g, device="cuda").view(128, 32) + 1
    slots = (table[:, :, None] * 128 + torch.arange(128, device="cuda")).view(128, -1)
    flat = cache.view(-1, L + R)
    gather_ms = timed(lambda: flat[slots])
    q = torch.randn(128, H, L + R, generator=g, **bf)
    probe("decode_128x4k", q, flat[slots], gather_ms, [0, 1, 64, 127], report)
    # the shared prefix: 64 tokens x 128 heads as 8192 rows, one 4096-key prefix (no gather)
    prefix = torch.randn(1, 4096, L + R, generator=g, **bf)
    q = torch.randn(1, 64 * H, L + R, generator=g, **bf)
    probe("shared_prefix_8192x4096", q, prefix, 0.0, [0], report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
