"""Remakes the tables of docs/benchmarks.md and docs/bucketing.md from the JSON in benchmarks/results/.

    python -m benchmarks.report            # rewrite the tables of docs/benchmarks.md and docs/bucketing.md
    python -m benchmarks.report --check    # exit 1 if a page differs from what the results give

The page's prose is written by hand; each table sits between `<!-- table:NAME -->` and `<!-- end -->` and is
made here, with the command that reproduces it, the device, the date and the commit. A results file that
records no commit (`commit`, at the top or in its `env`) or no date takes them from `results/provenance.json`
(git log: the commit that last wrote it).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from vllm_gaudi_unified.files import atomic_write

RESULTS = Path(__file__).parent / "results"
PAGES = tuple(Path(__file__).parent.parent / "docs" / f for f in ("benchmarks.md", "bucketing.md"))


def _load(name: str):
    return json.loads((RESULTS / name).read_text())


def recorded_commit(data) -> str | None:
    """The commit a results file records itself (top level or in its `env`), if any."""
    if isinstance(data, list):  # rows that each record the run's commit
        return (data[0].get("commit") or None) if data and isinstance(data[0], dict) else None
    if not isinstance(data, dict):
        return None
    return data.get("commit") or (data.get("env") or {}).get("commit")


def _source(name: str, command: str, device: str, date: str | None = None) -> str:
    """One line under a table: the command, the device, the date and the commit of one results file."""
    commit = recorded_commit(_load(name))
    prov = {} if commit else _load("provenance.json")[name]
    when = date or f"{prov['committed']} (commit time)"
    return (f"`{command}`: {device}, {when}, commit {commit or prov['commit']} "
            f"(results: `benchmarks/results/{name}`)")


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(*cols) -> list[str]:
    return [_row(*cols), "|" + "---|" * len(cols)]


def _f(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def planning_table() -> list[str]:
    d = _load("planning.json")
    pair = lambda r, k: f"{r[k + '_p50_us']:.0f} / {r[k + '_p90_us']:.0f}"  # noqa: E731
    out = _head("step", "plan_step, new arrays", "plan_step, PlanBuffers", "build_unified_batch, new arrays",
                "build_unified_batch, StepBuffers", "plan_step, PlanBuffers, CPU time", "bucket")
    out += [_row(r["scenario"], pair(r, "plan"), pair(r, "plan_kept"), pair(r, "batch"), pair(r, "batch_kept"),
                 pair(r, "plan_kept_cpu"), f"`{r['bucket']}`") for r in d["sides"]["this checkout"]]
    load = "-".join(f"{x:.1f}" for x in sorted(set(d["load_average"])))
    return out + ["", _source("planning.json", "python -m benchmarks.planning --repeat 400 --json FILE",
                              f"CPU host, 2 cores, load average {load}")]


#: The goals: Gaudi route / vllm-gaudi ops, CUDA default / Triton.
GAUDI_GOAL = {"chunked_2x2k_6k": 1.0, "prefill_4x2k": 1.0, "mixed": 0.5, "shared_prefix": 0.2,
              "parallel_sampling": 0.2, "decode_256x2k": 0.2, "decode_ragged": 0.2}
TRITON_GOAL = {"chunked_2x2k_6k": 0.35, "prefill_4x2k": 0.3, "mixed": 1.0, "shared_prefix": 0.5,
               "parallel_sampling": 1.0, "decode_256x2k": 1.1, "decode_ragged": 1.1}


def median_rows(rows: list[dict]) -> dict:
    """(scenario, block size, method, variant) -> the row of median time among that key's rounds (`--rounds`:
    rows with `round` 0, 1, ...; its `rounds_ms` lists them all). A later run of the same key (a row whose
    round does not follow the one before: another run, or a later file) replaces the earlier ones."""
    runs: dict = {}
    for r in [r for r in rows if r.get("ms") is not None]:
        key = (r["scenario"], r["block_size"], r["method"], r.get("variant"))
        if (run := runs.get(key)) is None or r.get("round", 0) <= run[-1].get("round", 0):
            run = runs[key] = []
        run.append(r)
    out = {}
    for key, run in runs.items():
        ranked = sorted(run, key=lambda r: r["ms"])
        out[key] = dict(ranked[(len(ranked) - 1) // 2], rounds_ms=[r["ms"] for r in run])
    return out


def _best(rows):
    """Per case and variant the median of its rounds (`median_rows`); the peer: the best of its forms."""
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


def latest_cases(runs: list[list[dict]]) -> list[dict]:
    """Rows of every (scenario, block size) from the last run that has it: ratios stay within one run."""
    out: dict = {}
    for rows in runs:
        cases: dict = {}
        for r in rows:
            cases.setdefault((r["scenario"], r["block_size"]), []).append(r)
        out.update(cases)
    return [r for rows in out.values() for r in rows]


def _speed_rows(names: list[str]) -> dict:
    return _best(latest_cases([_load(n)["rows"] for n in names]))


#: The device runner's run behind the speed table: every method and both routes in one process.
SPEED_RUN = "speed_h200/all_scenarios.json"


def speed_table() -> list[str]:
    from benchmarks import scenarios as sc_mod

    ours = _speed_rows([SPEED_RUN])
    order = [s.name for s in sc_mod.scenarios()]
    cases = sorted({k[:2] for k in ours}, key=lambda c: (order.index(c[0]) if c[0] in order else 99, c[1]))
    out = _head("scenario", "vllm-gaudi ops", "ours, Gaudi route", "Gaudi / ops (goal)", "vLLM Triton",
                "ours, CUDA route", "CUDA / Triton (goal)", "floor")
    for sc, bs in cases:
        peer, gaudi, cuda = (ours.get((sc, bs, m, v)) for m, v in (("peer", "best"), ("ours", "gaudi"),
                                                                   ("ours", "default")))
        t = ours.get((sc, bs, "triton", "graph"))
        ms = lambda r: r["ms"] if r else None  # noqa: E731
        ratio = lambda a, b: a["ms"] / b["ms"] if a and b else None  # noqa: E731
        out.append(_row((cuda or gaudi)["title"], _f(ms(peer)), _f(ms(gaudi)),
                        _verdict(ratio(gaudi, peer), GAUDI_GOAL.get(sc)), _f(ms(t)), _f(ms(cuda)),
                        _verdict(ratio(cuda, t), TRITON_GOAL.get(sc)), _f((cuda or gaudi)["floor_ms"])))
    env = _load(SPEED_RUN)["env"]
    dev = f"{env['device']}, torch {env['torch']}, Triton {env['triton']}"
    runs = [(SPEED_RUN, "python -m benchmarks.speed --out DIR --block-sizes 128 --scenarios all --peer-variants compiled")]
    return out + [""] + [f"- {_source(n, c, dev, _load(n)['env']['date'])}" for n, c in runs]


#: The padded routes of `benchmarks.trace_steps` (its PLAN_ROUTES: that module needs torch).
PADDED_ROUTES = ("gaudi_bucketed", "gaudi_bucketed_tiles", "gaudi_parts")


def trace_table() -> list[str]:
    names = {"chat": "trace_steps_h200/chat.json", "rag": "trace_steps_h200/rag.json"}
    data = {k: _load(n) for k, n in names.items()}
    out = _head("route", *(f"{k}: device ms" for k in names), *(f"{k}: steps slower than vllm-gaudi (exp)" for k in names),
                *(f"{k}: padded / unpadded" for k in names))
    rows = (("peer", "vllm-gaudi ops, unpadded"), ("peer_exp", "vllm-gaudi ops, padded to its `exp` buckets"),
            ("cuda", "ours, CUDA route"), ("gaudi", "ours, Gaudi route"),
            ("gaudi_bucketed", "ours, Gaudi route padded to the bucket plan"),
            ("gaudi_bucketed_tiles", "ours, Gaudi route, the plan's buckets on the tiled paths only"),
            ("gaudi_parts", "ours, Gaudi route in parts, padded to a plan of grid graphs (`--parts`)"))
    for key, name in rows:
        totals = [d["totals"] for d in data.values()]
        if not any(f"{key}_ms" in t for t in totals):  # a route the runs left out (`--plan-routes`)
            continue
        slower = [f"{t[f'{key}_steps_slower_than_peer']} ({t[f'{key}_steps_slower_than_peer_exp']})"
                  if f"{key}_steps_slower_than_peer" in t else "-" for t in totals]
        ratio = [f"{t[f'{key}_ms'] / t['gaudi_ms']:.2f}x" if key.startswith("gaudi_") else "-" for t in totals]
        out.append(_row(name, *(_f(t[f"{key}_ms"], 1) for t in totals), *slower, *ratio))
    lines = []
    for k, name in names.items():
        d = data[k]
        cmd = (f"python -m benchmarks.trace_steps --trace ../shared/traces/{d['trace'].split('/')[-1]} --start {d['start']} "
               f"--steps {d['steps']} --out DIR --plan {d.get('plan') or 'benchmarks/results/trace_steps_h200/plan_auto.json'}")
        routes = d.get("plan_routes")  # the padded routes run, when not both
        cmd += (f" --plan-routes {','.join(routes)}" if routes and set(routes) != set(PADDED_ROUTES) else "") + (
            f" --parts-plan {d['parts_plan']}" if d.get("parts_plan") else "")
        lines.append(f"- {k}: {_source(name, cmd, d['env']['device'], d['env']['date'])}")
    return out + [""] + lines


def _gpu_ms(entry: dict, route: str):
    """GPU time per step: the profile's CUDA total over its 5 steps."""
    m = re.search(r"Self CUDA time total: ([0-9.]+)(ms|us)", entry.get(f"{route}_profile", ""))
    return float(m.group(1)) / (5 if m.group(2) == "ms" else 5000) if m else None


def mla_table() -> list[str]:
    files = {"mla_h100/routes.json": ("decode_128x4k", "shared_64x4k+256", "unshared_64x4352"),
             "mla_h100/long_contexts.json": ("decode_4x32k", "decode_16x8k"),
             "mla_h200/decode.json": ("decode_128x4k",)}
    out = _head("step", "device", "floor ms (HBM / compute)", "CUDA route GPU / wall ms", "CUDA GPU / floor",
                "Gaudi route GPU / wall ms", "Gaudi GPU / floor", "vllm-gaudi `flat_pa_mla` wall ms",
                "max error CUDA / Gaudi")
    for name, cases in files.items():
        d = _load(name)
        for case in cases:
            e = d[case]
            floor = max(e["floor_ms"], e["compute_floor_ms"])
            gpu, gaudi = _gpu_ms(e, "cuda"), _gpu_ms(e, "gaudi")
            out.append(_row(f"{e['requests']} x {e['seq_len']}" + (" (4096 shared)" if "shared_" in case[:7] else ""),
                            d["device"].split()[1], f"{e['floor_ms']:.3f} / {e['compute_floor_ms']:.3f}",
                            f"{_f(gpu)} / {_f(e.get('cuda_ms'))}", f"{gpu / floor:.2f}x" if gpu else "-",
                            f"{_f(gaudi)} / {_f(e.get('gaudi_ms'))}", f"{gaudi / floor:.2f}x" if gaudi else "-",
                            _f(e.get("vllm_gaudi_ms"), 1), f"{e['cuda_max_err']:.4f} / {e['gaudi_max_err']:.4f}"))
    lines = [f"- {_source(n, 'python -m benchmarks.mla_decode --profile --out FILE --cases ' + ','.join(c), _load(n)['device'])}"
             for n, c in files.items()]
    return out + [""] + lines


def _trace_name(t: str) -> str:
    """A held-out trace's column: `recorded chat`, `sim. chat-rate0.25 seed201`, ..."""
    parts = t.removesuffix(".jsonl.gz").split("_")
    return f"recorded {parts[1]}" if t.startswith("vllm-") else f"sim. {' '.join(parts[2:])}"


def _pad_cell(h: dict) -> str:
    """On the routes a server takes (plans with prompt graphs); every step on the tiled route: time / pairs (worst)."""
    served = h.get("padding_time_served")
    return ((f"**{served:.2f}**; " if served is not None else "") + f"{h['padding_time']:.2f} / {h['padding_pairs']:.2f} "
            f"({h['worst_time']:.1f})" + (f", {h['uncovered']} uncovered" if h.get("uncovered") else ""))


def bucket_table(settings=("llama8b-gaudi3", "bs32-seqs64")) -> list[str]:
    """Each shipped plan of each setting on the held-out traces, beside the earlier scheme's plan and the bound."""
    d, out = _load("bucketing_loads.json"), []
    for setting in settings:
        plans = {k: e for k, e in d[setting].items() if "held_out" in e}
        robust, bound = plans[f"{setting}_robust"], d[setting]["in_sample_bound"]
        ups, own = list(robust["upstream"].values()), list(robust["held_out"].values())
        out += [f"**{setting}**", "", *_head("plan", "graphs", *map(_trace_name, robust["held_out"]))]
        out += [_row(f"`{k}`", f"{e['buckets']} + {e['prompt_graphs']}", *map(_pad_cell, e["held_out"].values()))
                for k, e in plans.items()]
        out += [_row("earlier scheme (rebuilt)", ups[0]["graphs"], *map(_pad_cell, ups)),
                _row("pairs computed per pair needed, unpadded -> padded: earlier scheme; robust", "",
                     *(f"{u['algorithm_factor']:.2f} -> {u['total_factor']:.2f}; {h['algorithm_factor']:.2f} -> "
                       f"{h['total_factor']:.2f}" for u, h in zip(ups, own))),
                _row(f"bound: {bound['buckets']} buckets fitted to the trace itself", bound["buckets"],
                     *(_pad_cell(bound[t]) for t in robust["held_out"])), ""]
    gen = d["generate_10k"]
    out += [f"Making the default kind of plan from a 10 000-step trace: {statistics.median(gen['wall_seconds']):.1f} s "
            f"(median of {len(gen['wall_seconds'])}, a separate process from start to exit)."]
    return out + ["", _source("bucketing_loads.json", "python -m benchmarks.bucketing_goals --loads", "CPU host, 2 cores",
                              d.get("date"))]


def serving_table() -> list[str]:
    d = _load("serving_cpu.json")
    cols = (("median_tpot_ms", "TPOT p50 ms", "tpot_p50"), ("mean_tpot_ms", "TPOT mean ms", "tpot_mean"),
            ("median_ttft_ms", "TTFT p50 ms", "ttft_p50"), ("mean_e2el_ms", "mean latency ms", "latency_mean"),
            ("request_throughput", "requests/s", "req_per_s"))
    out = _head("backend", *(c[1] for c in cols))
    out += [_row(name, *(_f(t[c[0]], 2) for c in cols)) for name, t in d["table"].items()]
    out.append(_row("**plugin / vLLM's** (median of the per-round ratios)",
                    *(f"{d['ratios'][c[2]]:.2f}x" + (f" ({d['paired_ratios'][c[2]]:.2f}x)" if c[2] in d["paired_ratios"]
                                                      else "") for c in cols)))
    date = next(iter(d["runs"].values()))[0]["result"]["date"]
    load = ", ".join(f"{x:.1f}" for x in d["load_average_end"])
    return out + ["", _source("serving_cpu.json", "python -m benchmarks.serving --rounds 6 --json FILE",
                              f"CPU host, engines on core {d['cpus']}, load average {load} at the end",
                              f"{date[:4]}-{date[4:6]}-{date[6:8]} {date[9:11]}:{date[11:13]} UTC")]


def invariance_table() -> list[str]:
    out = _head("scenario", "route", "default ms (graph)", "invariant ms (graph)", "invariant / default",
                "eager ratio", "peak memory ratio")
    files = {route: f"invariance/h200_{route}.json" for route in ("cuda", "gaudi")}
    for route, name in files.items():
        out += [_row(r["scenario"], route, _f(r.get("default_graph_ms")), _f(r.get("invariant_graph_ms")),
                     f"{r['graph_ms_ratio']:.2f}x", f"{r['ms_ratio']:.2f}x", f"{r['peak_mb_ratio']:.2f}x")
                for r in _load(name)]
    return out + [""] + [f"- {_source(name, f'python -m benchmarks.invariance cost --route {route} --out FILE', _load(name)[0]['gpu'], _runs(_load(name)))}"
                         for route, name in files.items()]


def _runs(rows: list) -> str:
    """The date of a results file's rows; rows re-measured at another commit (`--scenarios`) name theirs."""
    runs = list(dict.fromkeys((r["date"], r["commit"]) for r in rows))
    return runs[0][0] + "".join(f" (the {sum(r['commit'] == c for r in rows)} rows of commit {c}: {d})" for d, c in runs[1:])


def _verify_rows(name: str) -> dict:
    """{(scenario, method, route, compiled): ms} of one `benchmarks.verify` results file (default kernel constants)."""
    return {(r["scenario"], r["method"], r.get("route"), r.get("compiled")): r["ms"]
            for r in _load(name)["rows"] if "ms" in r and not r.get("variant")}


def verify_table() -> list[str]:
    runs, peers, mla, cuda_runs, compiled = (f"verify_h200/{n}.json" for n in (
        "gaudi_compiled", "with_peers", "mla_units", "cuda_final", "gaudi_route"))
    ours, peer, cuda = {k: v for n in (runs, compiled) for k, v in _verify_rows(n).items()}, _verify_rows(peers), _verify_rows(cuda_runs)
    titles = {r["scenario"]: r.get("title", r["scenario"]) for r in _load(runs)["rows"]}
    ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
    out = ["CUDA route:", ""] + _head("step", "ours", "vLLM Triton", "ours / Triton", "our decode, same contexts",
                                     "verify / decode", "floor")
    scenarios = sorted({k[0] for k in ours}, key=list(titles).index)
    for sc in scenarios:
        v, t, d = cuda.get((sc, "ours_verify", "cuda", False)), cuda.get((sc, "triton", None, None)), \
            cuda.get((sc, "ours_decode", "cuda", False))
        out.append(_row(sc, _f(v), _f(t), ratio(v, t), _f(d), ratio(v, d), _f(cuda.get((sc, "floor", None, None)))))
    out += ["", "Gaudi route (compiled per bucket where a time is given, else eager), beside vllm-gaudi's two forms:",
            ""] + _head("step", "verify eager", "decode eager", "verify compiled", "decode compiled",
                        "verify / decode", "vllm-gaudi batch expansion", "vllm-gaudi prompt form", "ours / expansion",
                        "ours / prompt form")
    for sc in scenarios:
        ve, de = ours.get((sc, "ours_verify", "gaudi", False)), ours.get((sc, "ours_decode", "gaudi", False))
        vc, dc = ours.get((sc, "ours_verify", "gaudi", True)), ours.get((sc, "ours_decode", "gaudi", True))
        best = vc if vc is not None else ve
        ex, pf = peer.get((sc, "vllm_gaudi_expand", None, None)), peer.get((sc, "vllm_gaudi_prompt", None, None))
        out.append(_row(sc, _f(ve), _f(de), _f(vc), _f(dc), ratio(vc, dc) if vc and dc else ratio(ve, de),
                        _f(ex), _f(pf), ratio(best, ex), ratio(best, pf)))
    m = _verify_rows(mla)
    out += ["", "MLA at DeepSeek-V3's shapes (128 heads, latent 512 + rope 64), eager:", ""]
    cuda, gaudi = ({sc: m.get((sc, "ours", r, None)) for sc in ("mla_128x1_4k", "mla_128x2_4k", "mla_128x3_4k")}
                   for r in ("cuda", "gaudi"))
    out += _head("step", "CUDA", "CUDA / 1-token decode", "Gaudi route", "Gaudi route / 1-token decode") + [
        _row(sc, _f(cuda[sc]), ratio(cuda[sc], cuda["mla_128x1_4k"]), _f(gaudi[sc]),
             ratio(gaudi[sc], gaudi["mla_128x1_4k"])) for sc in cuda]
    src = lambda n, c: _source(n, c, _load(n)["env"]["device"], _load(n)["env"]["date"])  # noqa: E731
    return out + ["", f"- {src(cuda_runs, 'python -m benchmarks.verify --out DIR --no-peers --routes cuda')} "
                  "(the CUDA table)", f"- {src(runs, 'python -m benchmarks.verify --out DIR --compile CASES')}",
                  f"- {src(compiled, 'python -m benchmarks.verify --out DIR --compile CASES --cases CASES --routes , --no-peers --no-triton')} "
                  "(the Gaudi route's compiled steps, over the file above)",
                  f"- {src(peers, 'python -m benchmarks.verify --out DIR')} (vllm-gaudi's columns)",
                  f"- {src(mla, 'python -m benchmarks.verify --out DIR --mla --cases none --no-peers --no-triton')}"]


TABLES = {"planning": planning_table, "speed": speed_table, "trace": trace_table, "mla": mla_table,
          "buckets": lambda: bucket_table(("llama8b-gaudi3",)), "shipped": bucket_table,
          "serving": serving_table, "invariance": invariance_table, "verify": verify_table}
_BLOCK = re.compile(r"(<!-- table:(\w+) -->\n).*?(<!-- end -->)", re.S)


def render(page: str) -> str:
    """The page with every table block remade from the results."""
    return _BLOCK.sub(lambda m: m.group(1) + "\n".join(TABLES[m.group(2)]()) + "\n" + m.group(3), page)



def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.report", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a page differs from the results")
    args = p.parse_args(argv)
    stale = False
    for page in PAGES:  # (each page read and rendered once)
        old = page.read_text()
        if (new := render(old)) == old:
            continue
        stale = True
        if args.check:
            print(f"{page} differs from what benchmarks/results/ give: run python -m benchmarks.report", file=sys.stderr)
            continue
        with atomic_write(str(page)) as f:
            f.write(new)
    return int(args.check and stale)


if __name__ == "__main__":
    raise SystemExit(main())
