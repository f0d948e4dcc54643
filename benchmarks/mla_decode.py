"""MLA decode at DeepSeek-V3 shapes (128 query heads, latent 512 + rope 64, bf16): unified attention in latent
space against the HBM floor of reading the latent cache once, and vllm-gaudi's `flat_pa_mla` run as torch ops
(loaded as `benchmarks/gaudi_peer.py` loads its ops.py). Also one prompt: latent form vs expanded form.

`python -m benchmarks.mla_decode --out FILE.json` (CUDA). Scenarios:

* `decode_128x4k`: 128 decodes, 4096 tokens each (context 4095 + the new token);
* `shared_64x4k+256`: 64 decodes whose first 4096 tokens are one shared prefix (the same 32 blocks),
  then 256 of their own (4352 each);
* `unshared_64x4352`: the same lengths with no block in common (what the prefix costs when it is not shared).

Floor: the latent bytes the step must read (each distinct cached block once) over the read bandwidth
measured in the same run (a sum over a 2 GiB bf16 tensor). Times: CUDA events, median of 20 after 3
warm-ups. Errors: max |out - float32 dense reference| over four requests.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from vllm_gaudi_unified import build_unified_batch
from vllm_gaudi_unified.mla import mla_attention

H, L, R, BS = 128, 512, 64, 128
SCALE = 192 ** -0.5  # DeepSeek-V3: (qk_nope 128 + rope 64) ** -0.5


def timed(fn, iters=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def read_bandwidth() -> float:
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    ms = timed(lambda: x.sum(), iters=10)
    return x.numel() * 2 / (ms * 1e-3)


def make_step(seq_lens, shared_blocks: int):
    """Block tables (request r: the shared blocks, then its own), the cache, queries, new latents."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n = len(seq_lens)
    own = [math.ceil(s / BS) - shared_blocks for s in seq_lens]
    table, nxt = [], 1 + shared_blocks
    for o in own:
        table.append(list(range(1, 1 + shared_blocks)) + list(range(nxt, nxt + o)))
        nxt += o
    width = max(map(len, table))
    table = [t + [0] * (width - len(t)) for t in table]
    cache = torch.randn(nxt, BS, L + R, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(n, H, L + R, generator=g, device="cuda", dtype=torch.bfloat16)
    latent = torch.empty(n, L + R, device="cuda", dtype=torch.bfloat16)
    for r, s in enumerate(seq_lens):  # the new token's latent is the one in its slot (written before attention)
        pos = s - 1
        latent[r] = cache[table[r][pos // BS], pos % BS]
    distinct = shared_blocks + sum(own)
    return table, cache, q, latent, distinct


def dense_reference(q, cache, table, seq_lens, rows):
    out = []
    for r in rows:
        blocks = torch.tensor(table[r][: math.ceil(seq_lens[r] / BS)], device="cuda")
        kv = cache[blocks].flatten(0, 1)[: seq_lens[r]].float()  # [S, L + R]
        p = torch.softmax(q[r].float() @ kv.T * SCALE, -1)
        out.append(p @ kv[:, :L])
    return torch.stack(out)


def gaudi_mla(q, cache, table, seq_lens):
    """vllm-gaudi's `ops.flat_pa_mla` with the decode metadata its runner builds (gaudi_peer helpers)."""
    from benchmarks import gaudi_peer as gp

    vg = gp.load_vllm_gaudi()
    blocks, groups, mapping, bias = gp.decode_metadata(table, seq_lens, BS, "cuda", q.dtype)
    args = gp._common_args(vg, SCALE, cache.view(-1, 1, L + R), None, blocks, BS)
    for k in ("fsdpa_op", "softmax_op", "sinks", "k_scales", "v_scales", "scale"):
        args.pop(k, None)

    def run():
        return vg.ops.flat_pa_mla(query=q, block_mapping=mapping, block_bias=bias, block_groups=groups, scale=SCALE,
                                  kv_lora_rank=L, **args)
    return run


def scenario(name, seq_lens, shared_blocks, bandwidth, report):
    table, cache, q, latent, distinct = make_step(seq_lens, shared_blocks)
    n = len(seq_lens)
    batch = build_unified_batch([1] * n, [s - 1 for s in seq_lens], table, BS, device="cuda")
    out = mla_attention(q, latent, cache, batch, SCALE, L)
    rows = [0, 1, n // 2, n - 1]
    ref = dense_reference(q, cache, table, seq_lens, rows)
    entry = {"requests": n, "seq_len": seq_lens[0], "phase": batch.phase, "bucket": str(batch.bucket),
             "latent_bytes_read_once": distinct * BS * (L + R) * 2,
             "unified_max_err": (out[rows].float() - ref).abs().max().item()}
    entry["floor_ms"] = entry["latent_bytes_read_once"] / bandwidth * 1e3
    entry["unified_ms"] = timed(lambda: mla_attention(q, latent, cache, batch, SCALE, L, checked=True))
    try:
        run = gaudi_mla(q, cache, table, seq_lens)
        entry["vllm_gaudi_max_err"] = (run()[rows].float() - ref).abs().max().item()
        entry["vllm_gaudi_ms"] = timed(run)
    except Exception as exc:  # reported, not hidden
        entry["vllm_gaudi_error"] = f"{type(exc).__name__}: {exc}"[:500]
    entry["unified_over_floor"] = entry["unified_ms"] / entry["floor_ms"]
    report[name] = entry
    print(name, json.dumps(entry), flush=True)
    del cache
    torch.cuda.empty_cache()


def prompt_forms(report, n=2048):
    """One prompt of n tokens, no context: attention in latent form (what the plugin runs) against the
    expanded form (per-head K 192 / V 128 through torch SDPA, plus the up-projection of the latents)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q_lat = torch.randn(n, H, L + R, generator=g, **bf)
    lat = torch.randn(n, L + R, generator=g, **bf)
    cache = torch.empty(1, BS, L + R, **bf)
    batch = build_unified_batch([n], [0], [[0]], BS, device="cuda")
    latent_ms = timed(lambda: mla_attention(q_lat, lat, cache, batch, SCALE, L), iters=5)
    w_kv = torch.randn(L, H * (128 + 128), generator=g, **bf) * 0.02
    q_exp = torch.randn(1, H, n, 192, generator=g, **bf)
    k_pe = torch.randn(1, 1, n, R, generator=g, **bf)

    def expanded():
        kv = (lat[:, :L] @ w_kv).view(n, H, 256).transpose(0, 1)[None]  # up-projection: [1, H, n, 256]
        k = torch.cat([kv[..., :128], k_pe.expand(1, H, n, R)], -1)
        return torch.nn.functional.scaled_dot_product_attention(q_exp, k, kv[..., 128:], is_causal=True, scale=SCALE)
    expanded_ms = timed(expanded, iters=5)
    report["prompt_2048"] = {"latent_ms": latent_ms, "expanded_ms": expanded_ms}
    print("prompt_2048", json.dumps(report["prompt_2048"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-prompt", action="store_true")
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    report = {"device": torch.cuda.get_device_name(), "read_bandwidth_GBps": bandwidth / 1e9}
    print(report, flush=True)
    scenario("decode_128x4k", [4096] * 128, 0, bandwidth, report)
    scenario("shared_64x4k+256", [4096 + 256] * 64, 4096 // BS, bandwidth, report)
    scenario("unshared_64x4352", [4096 + 256] * 64, 0, bandwidth, report)
    if not args.skip_prompt:
        prompt_forms(report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
