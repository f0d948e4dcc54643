"""MLA prompt steps at DeepSeek-V3 shapes (128 heads, latent 512 + rope 64, nope 128, values 128, bf16): the
latent form against the expanded form, both through the real code path.

`python -m benchmarks.mla_prompt --out FILE.json` (CUDA; `--device cpu --heads 4 --scale-down 16`: a smoke
run). Scenarios (each one step, planned by `build_unified_batch`):

* `prompt_2048`: one 2048-token prompt, no context;
* `chunk_2048_over_4096`: a 2048-token chunk over 4096 cached tokens of its own;
* `mixed_64x4k+2048`: 64 decodes over 4096 tokens each, then one 2048-token prompt (vLLM's order).

Forms: `latent`: every row through `mla.mla_attention` (query absorbed through W_UK, the prompt route over
the 576-dim latent), its output then through W_UV (what the plugin ran before); `expanded`: the prompt
route's rows through `mla_prompts.mla_prompt_rows` (context and new latents through kv_b_proj, one fused
SDPA call, keys 192 / values 128), the other rows latent (`prompt_route=False`) then W_UV: what the plugin
runs now (`vllm_plugin/mla_backend.py`). The query absorption is timed in both (the latent form's cost).
Times: CUDA events, median of 10 after 3 warm-ups. `max_diff`: max |expanded - latent| over the step's
outputs (bf16; outputs ~1).
"""
from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from benchmarks.timing import time_ms
from vllm_gaudi_unified import build_unified_batch
from vllm_gaudi_unified.mla import absorb_query, expand_output, mla_attention
from vllm_gaudi_unified.mla_prompts import expanded_first, mla_prompt_rows
from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.tools.cli import Parser

L, R, P, V, BS = 512, 64, 128, 128, 128
SCALE = (P + R) ** -0.5


def scenario(query_lens, context_lens, heads, device):
    """A step (decodes first, prompts last), its tensors and both forms as functions."""
    g = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    table, nxt = [], 1
    for q, c in zip(query_lens, context_lens):
        n = math.ceil((q + c) / BS)
        table.append(list(range(nxt, nxt + n)))
        nxt += n
    width = max(map(len, table))
    table = [t + [0] * (width - len(t)) for t in table]
    cache = torch.randn(nxt, BS, L + R, generator=g, **bf)
    t = sum(query_lens)
    latent = torch.randn(t, L + R, generator=g, **bf)
    q_nope, q_pe = torch.randn(t, heads, P, generator=g, **bf), torch.randn(t, heads, R, generator=g, **bf)
    w_uk = torch.randn(heads, P, L, generator=g, **bf) * L ** -0.5
    w_uv = torch.randn(heads, L, V, generator=g, **bf) * L ** -0.5
    weight = torch.cat([w_uk, w_uv.transpose(1, 2)], 1).reshape(-1, L).contiguous()  # kv_b_proj [H*(P+V), L]
    batch = build_unified_batch(query_lens, context_lens, table, BS, device=device)
    first = expanded_first(batch)
    assert first is not None, "the scenario's prompt rows must be the step's last tokens"
    rows = batch.bucket.query_len
    pad = lambda x: F.pad(x, (0,) * (2 * x.dim() - 2) + (0, rows - x.shape[0]))  # noqa: E731  (the bucket rows)
    q_full, lat = pad(torch.cat([q_nope, q_pe], -1)), pad(latent)

    def latent_form():
        q = pad(absorb_query(q_nope, q_pe, w_uk))
        return expand_output(mla_attention(q, lat, cache, batch, SCALE, L, checked=True)[:t], w_uv)

    def expanded_form():
        out = torch.empty(t, heads, V, **bf)
        if first:
            q = pad(absorb_query(q_nope[:first], q_pe[:first], w_uk))
            dec = mla_attention(q, lat, cache, batch, SCALE, L, checked=True, prompt_route=False)[:first]
            out[:first] = expand_output(dec, w_uv)
        out[first:] = mla_prompt_rows(q_full[first:], lat[first:], cache, batch, SCALE, L,
                                      lambda c: F.linear(c, weight), first=first)[: t - first]
        return out
    return dict(batch=batch, first=first, latent=latent_form, expanded=expanded_form)


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--out", type=output_path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--scale-down", type=int, default=1, help="divide every length by this (smoke runs)")
    args = parser.parse_args()
    s = args.scale_down
    cases = {"prompt_2048": ([2048 // s], [0]),
             "chunk_2048_over_4096": ([2048 // s], [4096 // s]),
             "mixed_64x4k+2048": ([1] * 64 + [2048 // s], [4096 // s - 1] * 64 + [0])}
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "heads": args.heads}
    for name, (q, c) in cases.items():
        sc = scenario(q, c, args.heads, args.device)
        with torch.no_grad():
            diff = (sc["expanded"]().float() - sc["latent"]().float()).abs().max().item()
            entry = {"bucket": str(sc["batch"].bucket), "first_expanded_row": sc["first"],
                     "latent_ms": time_ms(sc["latent"], torch.device(args.device), reps=10),
                     "expanded_ms": time_ms(sc["expanded"], torch.device(args.device), reps=10),
                     "max_diff": diff}
        entry["speedup"] = entry["latent_ms"] / entry["expanded_ms"]
        report[name] = entry
        print(name, json.dumps(entry), flush=True)
        with atomic_write(args.out) as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
