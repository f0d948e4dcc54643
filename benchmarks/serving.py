"""Serving overhead on vLLM's CPU platform, measured with `vllm bench serve`.

The plugin (`vllm-gaudi-unified serve MODEL`, VLLM_GAUDI_UNIFIED=1) against vLLM's own CPU attention
(the same command with VLLM_GAUDI_UNIFIED=0: vLLM's CPU platform picks CPU_ATTN; the server's log line
naming the backend is kept in the results), side by side in one run: for each of `--rounds` rounds the
two servers are started one after the other on 127.0.0.1 (never both at once), each answers one
`vllm-gaudi-unified vllm bench serve` run and is stopped.

The model is a tiny one (`tests/vllm_helpers.py`'s GQA Llama, random weights: hidden 256,
8 query heads, 2 KV heads, head_dim 32, 2 layers, vocabulary 512, float32), with a word-level
tokenizer over its vocabulary saved beside it (`tests/vllm_models.py`), so that server and client
run offline. Load: vLLM's random dataset, 128 input / 32 output tokens (ignore_eos), 64 prompts,
at most 8 in flight (concurrency 8), request rate unbounded, after `--warmups` warm-up
requests (the same for both sides: the first requests of a fresh server pay one-time costs). Server: eager, block 128,
no prefix caching, `max_num_seqs` 8, the engine's OpenMP threads bound to `--cpus` (default one
core: the host is shared).

    python -m benchmarks.serving [--rounds 2] [--json out.json] [--cpus 0] [--warmups 8]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_gaudi_unified.files import output_path, write_text
from vllm_gaudi_unified.tools.cli import Parser

ROOT = Path(__file__).resolve().parents[1]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 64, 128, 32, 8
SIDES = {"vLLM CPU attention": "0", "plugin": "1"}  # VLLM_GAUDI_UNIFIED of each server
METRICS = ("median_tpot_ms", "p90_tpot_ms", "mean_tpot_ms", "median_itl_ms", "median_ttft_ms", "p90_ttft_ms",
           "mean_e2el_ms", "request_throughput", "output_throughput", "duration")
#: The lines that say which attention ran: the plugin logs its backend; vLLM's CPU platform logs no backend
#: name, but its KV cache layout LBHNC is the one CPU_ATTN takes (the plugin's is LBNHC).
BACKEND_LINE = re.compile(r"unified attention backend|KV cache layout|Using \S+ backend")
KEPT = ("ttfts", "itls", "output_lens", "input_lens")  # per request, from --save-detailed


def make_model(path: str) -> str:
    """The tiny GQA Llama with a word-level tokenizer beside it (no download)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_helpers import MODELS, make_tiny_llama
    from vllm_models import _add_tokenizer

    make_tiny_llama(path, **MODELS["gqa"])
    _add_tokenizer(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(plugin: str, cpus: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_GAUDI_UNIFIED")}
    env.update(VLLM_GAUDI_UNIFIED=plugin, VLLM_CPU_OMP_THREADS_BIND=cpus, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def _wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before /health (log: {log})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not healthy within {timeout:.0f} s (log: {log})")
        time.sleep(1.0)


def _stop(server: subprocess.Popen) -> None:
    """SIGINT to the server's process group, SIGKILL after 60 s."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def serve_and_bench(model: str, plugin: str, work: Path, tag: str, cpus: str, timeout: float, warmups: int) -> dict:
    """Start one server, run `vllm bench serve` against it, stop it; the bench's result plus log lines."""
    port = _free_port()
    log = work / f"{tag}.server.log"
    env = _env(plugin, cpus)
    serve = [sys.executable, "-m", "vllm_gaudi_unified", "serve", model, "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--max-model-len", "512", "--block-size", "128", "--enforce-eager",
             "--max-num-seqs", str(CONCURRENCY), "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching",
             "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"]
    bench = [sys.executable, "-m", "vllm_gaudi_unified", "vllm", "bench", "serve", "--backend", "vllm",
             "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model,
             "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len",
             str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", str(CONCURRENCY),
             "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
             "--metric-percentiles", "50,90",
             "--num-warmups", str(warmups), "--disable-tqdm", "--save-result", "--save-detailed",
             "--result-dir", str(work), "--result-filename", f"{tag}.json"]
    with open(log, "w") as f:
        server = subprocess.Popen(serve, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        t0 = time.monotonic()
        _wait_healthy(server, port, log, timeout)
        startup_s = time.monotonic() - t0
        load_before = os.getloadavg()[0]
        client_env = dict(env, VLLM_GAUDI_UNIFIED="0")
        with open(work / f"{tag}.bench.log", "w") as f:
            proc = subprocess.run(bench, stdout=f, stderr=subprocess.STDOUT, env=client_env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve exited with {proc.returncode} (log: {work / (tag + '.bench.log')})")
        load_after = os.getloadavg()[0]
    finally:
        _stop(server)
    result = {k: v for k, v in json.loads((work / f"{tag}.json").read_text()).items()
              if not isinstance(v, list) or k in KEPT}  # no generated texts, no per-request errors ("")
    for key in ("model_id", "tokenizer_id"):  # this run's temporary folder
        result.pop(key, None)
    lines = [ln.strip()[-200:] for ln in log.read_text(errors="replace").splitlines() if BACKEND_LINE.search(ln)]
    return {"result": result, "backend_log_lines": lines[:8], "startup_s": startup_s,
            "load_average": [load_before, load_after]}


def _row(r: dict) -> dict:
    return {k: float(r["result"][k]) for k in METRICS if k in r["result"]}


def paired_ratios(runs: dict) -> dict:
    """Median over rounds of plugin / vLLM within each round (a round's two runs share the host's load
    more closely than the medians over all rounds do); a round whose vLLM value is 0 is left out."""
    import numpy as np

    out = {}
    for name, key in (("tpot_p50", "median_tpot_ms"), ("tpot_mean", "mean_tpot_ms"),
                      ("latency_mean", "mean_e2el_ms"), ("duration", "duration")):
        r = [_row(p)[key] / _row(v)[key] for v, p in zip(runs["vLLM CPU attention"], runs["plugin"])
             if _row(v).get(key)]
        if r:
            out[name] = float(np.median(r))
    return out


def main(argv=None) -> int:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each serves and benches both sides (default 2)")
    ap.add_argument("--model", default=None, help="model directory with a tokenizer (default: the tiny GQA Llama, "
                                                  "made now)")
    ap.add_argument("--cpus", default="0", help="VLLM_CPU_OMP_THREADS_BIND of the engines (default 0: one core)")
    ap.add_argument("--warmups", type=int, default=CONCURRENCY,
                    help=f"`vllm bench serve --num-warmups` before each timed run (default {CONCURRENCY})")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each server start and bench run")
    ap.add_argument("--json", type=output_path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.warmups < 0:
        ap.error(f"--warmups must be >= 0, got {args.warmups}")
    work = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    model = args.model or make_model(str(work / "model"))
    runs: dict[str, list] = {side: [] for side in SIDES}
    for i in range(args.rounds):  # alternate, so both sides see the same load
        for side, plugin in SIDES.items():
            r = serve_and_bench(model, plugin, work, f"r{i}_{'plugin' if plugin == '1' else 'vllm'}", args.cpus,
                                args.timeout, args.warmups)
            runs[side].append(r)
            print(f"round {i} {side}: {_row(r)} load {r['load_average']}", flush=True)
    import numpy as np

    table = {side: {k: float(np.median([_row(r)[k] for r in rs])) for k in _row(rs[0])} for side, rs in runs.items()}
    ref, plug = table["vLLM CPU attention"], table["plugin"]
    print(f"medians over {args.rounds} rounds; load average now {os.getloadavg()}")
    print("| backend | TPOT p50 (ms) | TPOT p90 | TPOT mean | ITL p50 (ms) | TTFT p50 (ms) | TTFT p90 | "
          "latency mean (ms) | req/s | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for side, t in table.items():
        print(f"| {side} | {t['median_tpot_ms']:.2f} | {t['p90_tpot_ms']:.2f} | {t['mean_tpot_ms']:.2f} | "
              f"{t['median_itl_ms']:.2f} | {t['median_ttft_ms']:.1f} | {t['p90_ttft_ms']:.1f} | "
              f"{t['mean_e2el_ms']:.0f} | "
              f"{t['request_throughput']:.2f} | {t['output_throughput']:.1f} |")
    ratios = {"tpot_p50": plug["median_tpot_ms"] / ref["median_tpot_ms"],
              "tpot_mean": plug["mean_tpot_ms"] / ref["mean_tpot_ms"],
              "itl_p50": plug["median_itl_ms"] / ref["median_itl_ms"],
              "ttft_p50": plug["median_ttft_ms"] / ref["median_ttft_ms"],
              "latency_mean": plug["mean_e2el_ms"] / ref["mean_e2el_ms"],
              "req_per_s": plug["request_throughput"] / ref["request_throughput"]}
    print("plugin / vLLM CPU attention: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    paired = paired_ratios(runs)
    print("median over rounds of each round's plugin / vLLM (the two sides of a round ran a minute apart): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in paired.items()))
    if args.json:
        write_text(args.json, json.dumps({"table": table, "ratios": ratios, "paired_ratios": paired, "runs": runs,
                                          "cpus": args.cpus, "load_average_end": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
