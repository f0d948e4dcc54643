"""Writers: results.json (every row), results.md (the table), results.png (the plot)."""
from __future__ import annotations

import json
import math
from pathlib import Path

BASELINE_NAMES = {"sdpa_loop": "SDPA loop", "padded_sdpa": "padded SDPA", "flex": "FlexAttention"}


def _fmt(x, digits=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}" if x < 100 else f"{x:.0f}"


def best_unified(rows, scenario, bs):
    """Our fastest checked variant for (scenario, block size), or None."""
    cands = [r for r in rows if r.get("method") == "unified" and r.get("scenario") == scenario
             and r.get("block_size") == bs and r.get("ok") and r.get("ms") is not None]
    return min(cands, key=lambda r: r["ms"]) if cands else None


def _get(rows, scenario, bs, method, variant=None):
    for r in rows:
        if r.get("scenario") == scenario and r.get("block_size") == bs and r.get("method") == method \
                and (variant is None or r.get("variant") == variant):
            return r
    return None


def summary(rows) -> list[dict]:
    """One line per (scenario, block size): our best time, targets, floors, ratios to each baseline."""
    out = []
    keys = []
    for r in rows:
        if r.get("method") == "unified" and (r["scenario"], r["block_size"]) not in keys:
            keys.append((r["scenario"], r["block_size"]))
    for name, bs in keys:
        best = best_unified(rows, name, bs)
        any_row = _get(rows, name, bs, "unified")
        line = dict(scenario=name, title=any_row.get("title", name), block_size=bs,
                    ms=best["ms"] if best else None, variant=best["variant"] if best else None,
                    eager_ms=(_get(rows, name, bs, "unified", "eager") or {}).get("ms"),
                    target_ms=any_row.get("target_ms"), triton_ms=any_row.get("triton_ms"),
                    floor_ms=any_row.get("floor_ms"), unique_layout=any_row.get("unique_layout"),
                    plan_ms=any_row.get("plan_ms"), h2d_ms=any_row.get("h2d_ms"),
                    peak_mb=(_get(rows, name, bs, "unified", "eager") or {}).get("peak_mb"),
                    rel_err=best.get("rel_err") if best else None)
        other = 128 if bs == 16 else 16
        b2 = best_unified(rows, name, other)
        line["other_bs_ms"] = b2["ms"] if b2 else None
        for bname in BASELINE_NAMES:
            b = _get(rows, name, 16, bname)  # baselines run at block size 16
            line[bname + "_ms"] = b.get("ms") if b else None
            line[bname + "_peak_mb"] = b.get("peak_mb") if b else None
        out.append(line)
    # Scattered vs its dense twin.
    for line in out:
        if line["scenario"] == "scattered":
            twin = next((x for x in out if x["scenario"] == "decode_256x2k" and x["block_size"] == line["block_size"]),
                        None)
            if twin and twin["ms"] and line["ms"]:
                line["vs_dense"] = line["ms"] / twin["ms"]
    return out


def markdown(env: dict, rows) -> str:
    lines = [f"Device: {env.get('device')}; torch {env.get('torch')}"
             + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
             + (f", Triton {env['triton']}" if env.get("triton") else "") + f"; {env.get('date')}.", ""]
    lines.append("| scenario | bs | ours ms (variant) | eager ms | target ms | floor ms | x floor | SDPA loop / ours "
                 "| padded SDPA / ours | Flex / ours | vLLM Triton / ours | unique layout | peak MB | plan ms "
                 "| H2D ms | rel err |")
    lines.append("|" + "---|" * 16)
    for s in summary(rows):
        ms = s["ms"]

        def ratio(other):
            return f"{other / ms:.2f}" if other and ms else "-"

        tgt = s["target_ms"]
        mark = "" if not (tgt and ms) else (" ✓" if ms <= tgt else " ✗")
        if s["scenario"] == "scattered" and s.get("vs_dense"):
            mark = f" ({s['vs_dense']:.2f}x dense)"
        lines.append(
            f"| {s['title']} | {s['block_size']} | {_fmt(ms)} ({s['variant'] or '-'}){mark} | {_fmt(s['eager_ms'])} "
            f"| {_fmt(tgt)} | {_fmt(s['floor_ms'])} | {ratio_x(ms, s['floor_ms'])} "
            f"| {ratio(s['sdpa_loop_ms']) if s['block_size'] == 16 else '-'} "
            f"| {ratio(s['padded_sdpa_ms']) if s['block_size'] == 16 else '-'} "
            f"| {ratio(s['flex_ms']) if s['block_size'] == 16 else '-'} "
            f"| {ratio(s['triton_ms'])} | {s['unique_layout']} | {_fmt(s['peak_mb'], 0)} "
            f"| {_fmt(s['plan_ms'], 2)} | {_fmt(s['h2d_ms'], 2)} | {_fmt(s['rel_err'], 4)} |")
    lines.append("")
    lines.append("Ratios above 1: the baseline takes longer than ours. Baselines ran at block size 16; '-' where one "
                 "does not apply or was not run.")
    base = [r for r in rows if r.get("method") in BASELINE_NAMES]
    if base:
        lines += ["", "| scenario | baseline | ms | peak MB | rel err | note |", "|---|---|---|---|---|---|"]
        for r in base:
            lines.append(f"| {r.get('title', r['scenario'])} | {BASELINE_NAMES[r['method']]} | {_fmt(r.get('ms'))} "
                         f"| {_fmt(r.get('peak_mb'), 0)} | {_fmt(r.get('rel_err'), 4)} | {r.get('error', '')} |")
    bad = [r for r in rows if r.get("method") == "unified" and r.get("ok") is False]
    for r in bad:
        lines.append(f"\nFAILED: {r['scenario']} bs {r['block_size']} {r['variant']}: "
                     f"{r.get('error') or 'rel err %s' % r.get('rel_err')}")
    return "\n".join(lines)


def ratio_x(ms, floor):
    return f"{ms / floor:.2f}" if ms and floor else "-"


def progress_line(rows, name, bs, seconds) -> str:
    best = best_unified(rows, name, bs)
    errs = [r.get("error") for r in rows if r.get("scenario") == name and r.get("block_size") == bs and r.get("error")]
    return (f"[{seconds:6.1f}s] {name} bs{bs}: "
            + (f"{best['ms']:.4f} ms ({best['variant']})" if best else "no timing")
            + (f" errors: {errs}" if errs else ""))


def write_plot(path: Path, env: dict, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = [s for s in summary(rows) if s["block_size"] == 16]
    if not summ:
        return
    series = [("ours, bs 16", lambda s: s["ms"]), ("ours, bs 128", lambda s: s["other_bs_ms"]),
              ("SDPA loop", lambda s: s["sdpa_loop_ms"]), ("padded SDPA", lambda s: s["padded_sdpa_ms"]),
              ("FlexAttention", lambda s: s["flex_ms"]), ("vLLM Triton (issue)", lambda s: s["triton_ms"])]
    fig, ax = plt.subplots(figsize=(13, 5.5))
    width = 0.8 / len(series)
    for i, (label, get) in enumerate(series):
        xs = [j + i * width for j, s in enumerate(summ) if get(s)]
        ys = [get(s) for s in summ if get(s)]
        ax.bar(xs, ys, width, label=label)
    for j, s in enumerate(summ):
        if s["target_ms"]:
            ax.hlines(s["target_ms"], j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--", lw=1)
        if s["floor_ms"]:
            ax.hlines(s["floor_ms"], j - width / 2, j + 0.8 - width / 2, colors="r", linestyles=":", lw=1)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (log)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(summ))])
    ax.set_xticklabels([s["title"] for s in summ], rotation=25, ha="right", fontsize=8)
    ax.set_title(f"unified_attention vs baselines: {env.get('device')}, torch {env.get('torch')}, {env.get('date')}"
                 "\n(dashed black: target, dotted red: HBM/FLOP floor)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(out_dir: Path, env: dict, args: dict, rows, plot: bool = False) -> None:
    out_dir = Path(out_dir)
    (out_dir / "results.json").write_text(json.dumps(dict(env=env, args=args, rows=rows, summary=summary(rows)),
                                                     indent=1, default=str))
    (out_dir / "results.md").write_text(markdown(env, rows) + "\n")
    if plot:
        try:
            write_plot(out_dir / "results.png", env, rows)
        except Exception as exc:  # noqa: BLE001 - a missing matplotlib must not lose the numbers
            print(f"plot failed: {exc}")
