"""The two routes' table: the Gaudi route beside vllm-gaudi's ops, the CUDA default beside Triton.

    python -m benchmarks.routes DIR/speed.json [...]   # markdown; a case comes from the last file with it

Reads the rows `benchmarks/speed.py` writes when run with
`--variants "gaudi=gaudi:1;pflash=prompt_flash:1"`: per scenario and block size, the peer (best
of its graph and compiled forms), vLLM's Triton kernel (`speed.TRITON_MS`, measured beside ours
by `benchmarks/triton_peer.py`), and ours on the Gaudi route and at the CUDA defaults
(and, where run, the prompt route through flash varlen, `attention.PROMPT_FLASH`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import scenarios as sc_mod
from benchmarks.speed import TRITON_MS, median_rows

#: The goals: Gaudi route / vllm-gaudi ops, CUDA default / Triton.
GAUDI_GOAL = {"chunked_2x2k_6k": 1.0, "prefill_4x2k": 1.0, "mixed": 0.5, "shared_prefix": 0.2,
              "parallel_sampling": 0.2, "decode_256x2k": 0.2, "decode_ragged": 0.2}
TRITON_GOAL = {"chunked_2x2k_6k": 0.35, "prefill_4x2k": 0.3, "mixed": 1.0, "shared_prefix": 0.5,
               "parallel_sampling": 1.0, "decode_256x2k": 1.1, "decode_ragged": 1.1}


def _best(rows):
    """Per case and variant the median of its rounds (`speed.median_rows`); the peer: the best of its forms."""
    best: dict = {}
    for key, r in median_rows(rows).items():
        if r["method"] == "peer":  # best of its forms
            key = key[:3] + ("best",)
            if key in best and best[key]["ms"] <= r["ms"]:
                continue
        best[key] = r
    return best


def _verdict(ratio, goal):
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x" + ("" if goal is None else f" ({'met' if ratio <= goal else 'MISSED'}: <= {goal})")


def table(rows: list[dict]) -> str:
    best = _best(rows)
    order = [s.name for s in sc_mod.scenarios()]
    cases = sorted({(k[0], k[1]) for k in best}, key=lambda c: (order.index(c[0]) if c[0] in order else 99, c[1]))
    f = lambda r: "-" if r is None else f"{r['ms']:.3f}"  # noqa: E731
    lines = ["| scenario | bs | vllm-gaudi ops | vLLM Triton (measured, triton_peer) | ours Gaudi route | Gaudi / ops (goal) "
             "| ours CUDA default | CUDA / Triton (goal) | CUDA, prompt route through flash varlen |",
             "|" + "---|" * 9]
    for sc, bs in cases:
        peer = best.get((sc, bs, "peer", "best"))
        gaudi, cuda = best.get((sc, bs, "ours", "gaudi")), best.get((sc, bs, "ours", "default"))
        pflash = best.get((sc, bs, "ours", "pflash"))
        tri = TRITON_MS.get(sc, (None, None))[{16: 0, 128: 1}[bs]] if bs in (16, 128) else None
        title = (gaudi or cuda or peer or {}).get("title", sc)
        g_ratio = gaudi["ms"] / peer["ms"] if gaudi and peer else None
        c_ratio = cuda["ms"] / tri if cuda and tri else None
        lines.append(f"| {title} | {bs} | {f(peer)} | {tri if tri else '-'} | {f(gaudi)} | "
                     f"{_verdict(g_ratio, GAUDI_GOAL.get(sc))} | {f(cuda)} | "
                     f"{_verdict(c_ratio, TRITON_GOAL.get(sc))} | {f(pflash)} |")
    return "\n".join(lines)


def latest_cases(runs: list[list[dict]]) -> list[dict]:
    """Rows of every (scenario, block size) from the last run that has it: ratios stay within one run."""
    out: dict = {}
    for rows in runs:
        cases: dict = {}
        for r in rows:
            cases.setdefault((r["scenario"], r["block_size"]), []).append(r)
        out.update(cases)
    return [r for rows in out.values() for r in rows]


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    print(table(latest_cases([json.loads(Path(p).read_text())["rows"] for p in paths])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
