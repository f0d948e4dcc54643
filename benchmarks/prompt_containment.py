"""Whether a bad new key of a prompt without context reaches exactly the rows it should, on the device.

    python -m benchmarks.prompt_containment --out FILE.json [--device cuda|cpu]

Prompts without context off a Gaudi rely on the causal SDPA call hiding later keys' scores by selection
(`paths/prompts.py: causal_selects`, `_causal_keys`): a bad key goes in as NaN, its value as zero. Here 4
prompts of 512 tokens (32 / 8 / 128 heads, bf16, every cache slot NaN) get a NaN or inf key or value at
token 100 of prompt 1, KV head 3; the rows 100.. of that prompt, that KV head's query heads, must come out
NaN and every other row as in the clean call. Both routes, eager and compiled (`graphs.compiled_attention`).
"""
from __future__ import annotations

import contextlib
import json

import numpy as np
import torch

from vllm_gaudi_unified import build_unified_batch, unified_attention
from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.graphs import clear, compiled_attention
from vllm_gaudi_unified.paths import fused
from vllm_gaudi_unified.reference import reference_attention
from vllm_gaudi_unified.tools.cli import Parser

P, LEN, HQ, HKV, D, BS = 4, 512, 32, 8, 128, 128


def check(device: torch.device) -> list[dict]:
    ql, cl = [LEN] * P, [0] * P
    nb = P * (LEN // BS) + 1
    table = np.arange(1, nb).reshape(P, -1).astype(np.int64)
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = rand(P * LEN, HQ, D), rand(P * LEN, HKV, D), rand(P * LEN, HKV, D)
    kc = torch.full((nb, BS, HKV, D), float("nan"), device=device, dtype=torch.bfloat16)
    vc, scale = kc.clone(), D ** -0.5
    ref = reference_attention(*(x.double().cpu() for x in (q, k, v, kc, vc)), ql, cl, table, scale)
    j, heads = LEN + 100, slice(3 * HQ // HKV, 4 * HQ // HKV)
    expect = torch.zeros((P * LEN, HQ), dtype=torch.bool, device=device)
    expect[j:2 * LEN, heads] = True
    rows = []
    for route in ("cuda", "gaudi"):
        for form, fn in (("eager", unified_attention), ("compiled", compiled_attention)):
            with fused.gaudi_route() if route == "gaudi" else contextlib.nullcontext():
                clear()
                batch = build_unified_batch(ql, cl, table, BS, num_blocks=nb, device=device)
                clean = fn(q, k, v, kc, vc, batch, scale).clone()
                err = float((clean.double().cpu() - ref).abs().max())
                for which, value in (("key", float("nan")), ("value", float("nan")), ("value", float("inf")),
                                     ("key", float("inf"))):
                    kk, vv = k.clone(), v.clone()
                    (kk if which == "key" else vv)[j, 3, 7] = value
                    bad = fn(q, kk, vv, kc, vc, batch, scale)
                    nan = torch.isnan(bad).any(-1)
                    ok = bool((nan == expect).all()) and bool(torch.equal(bad[~expect], clean[~expect]))
                    rows.append(dict(route=route, form=form, bad=f"{which} {value}", ok=ok, clean_max_err=err,
                                     prompt_full=bool(batch.plan.prompt_full), nan_rows=int(nan.sum()),
                                     expected_nan_rows=int(expect.sum())))
                    print(rows[-1], flush=True)
    clear()
    return rows


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--out", type=output_path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = check(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with atomic_write(args.out) as f:
        json.dump({"device": name, "torch": torch.__version__, "rows": rows,
                   "all_ok": all(r["ok"] for r in rows)}, f, indent=1)
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
