"""Serving overhead on vLLM's CPU platform (issue 24, item 6): TPOT of the plugin against vLLM's own CPU attention.

The tiny model of the issue (a random-weight Llama, `tests/vllm_helpers.py`'s GQA model: 8 query heads,
2 KV heads, head_dim 32, 2 layers), 64 prompts of 128 random tokens, 32 output tokens each (ignore_eos),
at most 8 running at once (`max_num_seqs` 8: the issue's concurrency 8), greedy.

Offline, not `vllm bench serve`: one engine in this process (`LLM`, VLLM_ENABLE_V1_MULTIPROCESSING=0),
stepped by hand with every request queued up front, so the timings hold no HTTP, tokenizer or client
time (those are the same for both backends; this measures what the backends change). Per request, as
`vllm bench serve` defines them: TTFT (queued to first token), TPOT ((last token - first token) /
(tokens - 1)); per step, the wall time of `LLMEngine.step`, and of the decode-only steps.

Each backend runs in its own engine process (vLLM keeps global state per process), all started
first; then their timed passes alternate, `--rounds` each, so all see the same load (this host is
shared); the table gives medians over rounds. The decode-step p50 is the steadiest number on a
shared host; TPOT (a mean over a request's steps) takes every stall of the host with it.

    python -m benchmarks.serving_cpu [--rounds 2] [--json out.json] [--profile out.prof] [--compare DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vllm_gaudi_unified.files import output_path, write_text
from vllm_gaudi_unified.tools.cli import Parser

ROOT = Path(__file__).resolve().parents[1]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 64, 128, 32, 8
BLOCK_SIZE = 128
SIDES = {"vLLM CPU attention": {}, "plugin (VLLM_GAUDI_UNIFIED=1)": {"VLLM_GAUDI_UNIFIED": "1"}}


def run_engine(model: str, dtype: str, profile: str | None) -> dict:
    """One engine, all prompts; timings per request and per step."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_helpers import keep_vllm_gaudi_out

    keep_vllm_gaudi_out()
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype, seed=0,
              max_model_len=INPUT_LEN + OUTPUT_LEN + BLOCK_SIZE, block_size=BLOCK_SIZE, max_num_seqs=CONCURRENCY,
              max_num_batched_tokens=2048, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True, detokenize=False)

    def one_pass(n: int, tag: str):
        queued = {}
        for i in range(n):
            rid = f"{tag}{i}"
            engine.add_request(rid, {"prompt_token_ids": rng.integers(3, 500, INPUT_LEN).tolist()}, params)
            queued[rid] = time.perf_counter()
        first, last, count, steps = {}, {}, {}, []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            t1 = time.perf_counter()
            new_first = 0
            for o in outs:
                n_tok = len(o.outputs[0].token_ids)
                if o.request_id not in first and n_tok:
                    first[o.request_id] = t1
                    new_first += 1
                last[o.request_id], count[o.request_id] = t1, n_tok
            steps.append((t1 - t0, new_first))
        return queued, first, last, count, steps

    one_pass(CONCURRENCY, "warm")  # first steps allocate and compile nothing after this
    for n, line in enumerate(sys.stdin):  # one timed pass per path the parent sends; an empty line ends
        path = line.strip()
        if not path:
            break
        prof = None
        if profile and n == 0:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        queued, first, last, count, steps = one_pass(NUM_PROMPTS, f"r{n}_")
        total = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)
        ttft = [first[r] - queued[r] for r in queued]
        tpot = [(last[r] - first[r]) / (count[r] - 1) for r in queued if count[r] > 1]
        decode_steps = [s for s, new in steps if new == 0]
        result = {"total_s": total, "req_per_s": NUM_PROMPTS / total, "tpot_ms": [1e3 * x for x in tpot],
                  "ttft_ms": [1e3 * x for x in ttft], "step_ms": [1e3 * s for s, _ in steps],
                  "decode_step_ms": [1e3 * s for s in decode_steps], "load_average": os.getloadavg()[0]}
        Path(path + ".tmp").write_text(json.dumps(result))
        os.replace(path + ".tmp", path)


def _summary(r: dict) -> dict:
    return {"tpot_p50_ms": float(np.median(r["tpot_ms"])), "tpot_p90_ms": float(np.percentile(r["tpot_ms"], 90)),
            "ttft_p50_ms": float(np.median(r["ttft_ms"])), "req_per_s": r["req_per_s"],
            "decode_step_p50_ms": float(np.median(r["decode_step_ms"])), "steps": len(r["step_ms"])}


def main(argv=None) -> int:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="runs per backend, alternating")
    ap.add_argument("--dtype", default="float32", help="model dtype (the tiny model is float32; bf16 matmuls are slow on CPUs without AVX-512 BF16)")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny GQA Llama, made now)")
    ap.add_argument("--json", type=output_path, default=None, help="write the results here")
    ap.add_argument("--only", choices=["vllm", "plugin"], default=None, help="run one backend only")
    ap.add_argument("--profile", default=None, help="cProfile the plugin's timed pass into this file")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="also run the plugin of another checkout (e.g. the commit before a change)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        run_engine(args.model, args.dtype, args.profile)
        return 0
    work = tempfile.mkdtemp(prefix="serving_cpu_")
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from vllm_helpers import MODELS, make_tiny_llama

        model = make_tiny_llama(os.path.join(work, "model"), **MODELS["gqa"])
    sides = {k: dict(v, PYTHONPATH=str(ROOT)) for k, v in SIDES.items()
             if args.only is None or ("plugin" in k) == (args.only == "plugin")}
    if args.compare:
        sides[f"plugin at {args.compare}"] = {"VLLM_GAUDI_UNIFIED": "1", "PYTHONPATH": str(Path(args.compare).resolve())}
    runs = {k: [] for k in sides}
    workers = {}
    for side, env in sides.items():  # every engine up at once; then their passes alternate
        cmd = [sys.executable, __file__, "--worker", "1", "--model", model, "--dtype", args.dtype]
        if args.profile and env.get("PYTHONPATH") == str(ROOT) and "VLLM_GAUDI_UNIFIED" in env:
            cmd += ["--profile", args.profile]
        environ = {k: v for k, v in os.environ.items() if k != "VLLM_GAUDI_UNIFIED"}
        environ.update(env)
        log = open(os.path.join(work, f"worker{len(workers)}.log"), "w")
        workers[side] = subprocess.Popen(cmd, env=environ, stdin=subprocess.PIPE, stdout=log, stderr=log, text=True)
    try:
        for i in range(args.rounds):
            for side, proc in workers.items():
                out = os.path.join(work, f"{i}_{list(sides).index(side)}.json")
                proc.stdin.write(out + "\n")
                proc.stdin.flush()
                while not os.path.exists(out):
                    if proc.poll() is not None:
                        raise RuntimeError(f"{side}: the engine exited with {proc.returncode} (log: {work})")
                    time.sleep(0.2)
                runs[side].append(json.loads(Path(out).read_text()))
                print(f"round {i} {side}: {_summary(runs[side][-1])}", flush=True)
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.stdin.write("\n")
                proc.stdin.flush()
        for proc in workers.values():
            proc.wait(timeout=120)
    table = {side: {k: float(np.median([_summary(r)[k] for r in rs])) for k in _summary(rs[0])}
             for side, rs in runs.items()}
    print(f"load average {os.getloadavg()[0]:.2f}; medians over {args.rounds} rounds")
    print("| backend | TPOT p50 (ms) | TPOT p90 | decode step p50 (ms) | TTFT p50 (ms) | req/s |")
    print("|---|---|---|---|---|---|")
    for side, t in table.items():
        print(f"| {side} | {t['tpot_p50_ms']:.2f} | {t['tpot_p90_ms']:.2f} | {t['decode_step_p50_ms']:.2f} | "
              f"{t['ttft_p50_ms']:.0f} | {t['req_per_s']:.1f} |")
    base = table.get("vLLM CPU attention")
    for side, t in table.items():
        if base and side != "vLLM CPU attention":
            print(f"{side} / vLLM CPU attention, TPOT p50: {t['tpot_p50_ms'] / base['tpot_p50_ms']:.2f}x, "
                  f"decode step p50: {t['decode_step_p50_ms'] / base['decode_step_p50_ms']:.2f}x")
    if args.json:
        write_text(args.json, json.dumps({"table": table, "runs": runs, "dtype": args.dtype,
                                          "load_average": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
