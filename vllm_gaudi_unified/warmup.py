"""Warmup: run unified attention once per bucket of a plan, so no graph is compiled while serving.

`warmup(plan, ...)` is what both the `vllm-gaudi-unified warmup PLAN` command
and the vLLM integration (at start-up) call. For every bucket it makes the
smallest step of the bucket's phase (`plan/smallest.py`), plans it padded to the
bucket (so the batch has exactly the bucket's shapes), and runs it through the
chosen mode (a bucket no step of its phase fits, left in an old plan file, is
skipped with one warning counting them):

1. `hpu_graphs`: on Gaudi, the attention wrapped in an HPU graph (one graph per
   bucket, captured on this first run);
2. `compile`: `torch.compile` with static shapes, one compiled function per
   bucket (`vllm_gaudi_unified.graphs`);
3. `eager`: plain torch (checks every bucket runs; nothing is cached);
`auto` picks `hpu_graphs` on an HPU device and `eager` elsewhere.

A caller with its own forward pass (the vLLM integration runs the model, not
only attention) passes `run(bucket, batch)`; the default runs the attention
with random inputs on a KV cache of the plan's size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.files import atomic_write, output_path
from vllm_gaudi_unified.flags import POSITIVE, float_in
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.plan.smallest import can_hold_a_step, with_prompt

logger = get_logger(__name__)

MODES = ("auto", "eager", "compile", "hpu_graphs")


@dataclass
class WarmupReport:
    mode: str
    device: str
    seconds: list = field(default_factory=list)  #: per bucket, in the order warmed
    buckets: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  #: buckets no step of their phase fits (not run)
    total_seconds: float = 0.0

    def table(self) -> str:
        lines = [f"{'#':>4}  {'bucket':<44} {'seconds':>9}"]
        for i, (b, s) in enumerate(zip(self.buckets, self.seconds)):
            lines.append(f"{i:>4}  {str(b):<44} {s:>9.3f}")
        lines.append(f"warmed {len(self.buckets)} buckets in {self.total_seconds:.2f} s ({self.mode} on {self.device})")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} buckets no step of their phase fits (e.g. {self.skipped[0]})")
        return "\n".join(lines)


def step_for_bucket(bucket: Bucket, block_size: int, options=None,
                    sliding_window: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The smallest step of `bucket`'s phase (`plan.smallest`): (query_lens, context_lens, block_table).

    Raises ValueError when no step of that phase fits in the bucket (`can_hold_a_step` is False)."""
    from vllm_gaudi_unified.plan import DEFAULT_OPTIONS
    from vllm_gaudi_unified.plan.options import on_route
    from vllm_gaudi_unified.plan.smallest import smallest_steps

    options = options or DEFAULT_OPTIONS
    if not bucket.num_prompts:  # the five sizes alone describe the tiled route (`batch.prompt_graph_for`)
        options = on_route(options, "tiles")
    smallest = smallest_steps(block_size, options, sliding_window)[bucket.phase]
    if smallest is None:
        raise ValueError(f"bucket {bucket}: the planner makes no step of phase {bucket.phase!r} with these options")
    step, shape = smallest
    if bucket.num_prompts:  # the prompt route's shape: one more request on it (`with_prompt`)
        step, shape = with_prompt(step, bool(bucket.prompt_blocks), block_size, options, sliding_window)
    if not bucket.covers(shape):
        raise ValueError(f"bucket {bucket} cannot hold the smallest step of its phase ({shape})")
    return step


def batch_for_bucket(bucket: Bucket, block_size: int, options, sliding_window=None, device=None):
    """A UnifiedBatch with exactly `bucket`'s shapes (the step of `step_for_bucket`, padded)."""
    from vllm_gaudi_unified.batch import build_unified_batch

    q, ctx, table = step_for_bucket(bucket, block_size, options, sliding_window)
    return build_unified_batch(q, ctx, table, block_size, sliding_window=sliding_window, options=options,
                               bucket=bucket, device=device)


def resolve_mode(mode: str, device_type: str) -> str:
    if mode not in MODES:
        raise ValueError(f"warmup mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "hpu_graphs" if device_type == "hpu" else "eager"
    if mode == "hpu_graphs" and device_type != "hpu":
        raise ValueError("mode 'hpu_graphs' needs an HPU device (Gaudi); use 'compile' or 'eager' here")
    return mode


def _attention_fn(mode: str) -> Callable:
    from vllm_gaudi_unified.attention import unified_attention

    if mode == "eager":
        return unified_attention
    if mode == "compile":
        from vllm_gaudi_unified.graphs import compiled_attention

        return compiled_attention
    return _hpu_graph_attention()  # pragma: no cover - needs Gaudi


def _hpu_graph_attention() -> Callable:  # pragma: no cover - needs Gaudi
    """unified_attention inside an HPU graph; the graph cache is keyed by input shapes (= bucket)."""
    import habana_frameworks.torch.hpu.graphs as htgraphs
    import torch

    from vllm_gaudi_unified.attention import unified_attention

    class _Attention(torch.nn.Module):
        def forward(self, query, key, value, key_cache, value_cache, batch, scale):
            return unified_attention(query, key, value, key_cache, value_cache, batch, scale)

    return htgraphs.wrap_in_hpu_graph(_Attention(), disable_tensor_cache=True)


def warmup(plan, *, device=None, mode: str = "auto", dtype=None, num_qo_heads: int | None = None,
           num_kv_heads: int | None = None, head_dim: int | None = None, num_blocks: int | None = None,
           key_cache=None, value_cache=None, run: Callable | None = None, buckets: list[Bucket] | None = None,
           progress: bool = True, log=None) -> WarmupReport:
    """Run every bucket of `plan` (a BucketPlan) once; returns per-bucket and total seconds.

    Heads, head size and cache size default to the plan's model and settings.
    `key_cache`/`value_cache`: the real KV cache (vLLM); else one is allocated, after checking that
    it fits in the device's free memory.
    `run(bucket, batch)`: replaces the default attention call (vLLM runs its model).
    `buckets`: a subset to warm (default: all, cheapest first).
    `progress`: one line per bucket as it finishes, with the time left estimated from the plan's work
    model, through `log` (default: this module's logger; vLLM's for the plugin, so the lines are in
    its log). The summary line is the caller's. A Ctrl-C (KeyboardInterrupt) carries the buckets
    warmed so far as `exc.warmup_report`, so nothing already reported is lost.
    """
    import torch

    from vllm_gaudi_unified.batch import check_device

    log = log or logger
    check_arguments(plan, dtype, run, buckets, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, num_blocks=num_blocks)
    device = check_device(device or "cpu")
    mode = resolve_mode(mode, device.type)
    settings, model = plan.settings, plan.model
    dtype = dtype or (torch.bfloat16 if model.dtype_bytes == 2 else torch.float32)
    hq, hkv, d = num_qo_heads or model.num_qo_heads, num_kv_heads or model.num_kv_heads, head_dim or model.head_dim
    todo = list(plan.buckets + getattr(plan, "prompt_graphs", []) if buckets is None else buckets)
    options_for = getattr(plan, "options_for", lambda b: settings.options)  # prompt graphs: the prompt route
    report = WarmupReport(mode=mode, device=str(device))
    report.skipped = [b for b in todo if not can_hold_a_step(b, settings.block_size, options_for(b),
                                                             settings.sliding_window)]
    if report.skipped:  # an old plan file: its generator emitted buckets no step can use
        log.warning("warmup skips %d of %d buckets that no step of their phase fits (e.g. %s)",
                    len(report.skipped), len(todo), report.skipped[0])
        skip = set(report.skipped)
        todo = [b for b in todo if b not in skip]
    if run is None:
        if key_cache is None:
            nb = num_blocks or settings.num_blocks
            shape = (nb, settings.block_size, hkv, d)
            check_cache_fits("num_blocks", nb, shape, dtype, device)
            key_cache = _allocate(shape, dtype, device)
            value_cache = _allocate(shape, dtype, device)
        attend = _attention_fn(mode)
        scale = 1.0 / d ** 0.5

        def run(bucket, batch):
            t = bucket.query_len
            q = torch.randn(t, hq, d, dtype=dtype, device=device)
            k = torch.randn(t, hkv, d, dtype=dtype, device=device)
            return attend(q, k, torch.randn_like(k), key_cache, value_cache, batch, scale)

    costs = plan.cost_model.cost(np.array([b.sizes for b in todo], np.int64).reshape(-1, 5)) if todo else []
    cost = dict(zip(todo, map(float, costs)))  # a prompt graph: its five sizes (the prompt call is not modelled)
    left, done = sum(cost.values()), 0.0
    start = time.perf_counter()
    try:
        for i, bucket in enumerate(todo):
            t0 = time.perf_counter()
            batch = batch_for_bucket(bucket, settings.block_size, options_for(bucket), settings.sliding_window, device)
            out = run(bucket, batch)
            _sync(out, device)
            report.buckets.append(bucket)
            report.seconds.append(time.perf_counter() - t0)
            report.total_seconds = time.perf_counter() - start
            left, done = left - cost[bucket], done + cost[bucket]
            if progress:
                log.info("warmup %d/%d: bucket %s in %.2f s (%.1f s so far, about %s left)", i + 1, len(todo),
                         bucket, report.seconds[-1], report.total_seconds,
                         _eta(report.total_seconds, i + 1, len(todo), left, done))
    except KeyboardInterrupt as exc:
        report.total_seconds = time.perf_counter() - start
        exc.warmup_report = report
        raise
    report.total_seconds = time.perf_counter() - start
    return report


def check_arguments(plan, dtype, run, buckets, **sizes) -> None:
    """`warmup`'s arguments of the wrong type, each a ValueError naming it before any work (the caches are
    checked with the step's other tensors: `attention.check_inputs`)."""
    import torch

    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan
    from vllm_gaudi_unified.plan.arrays import is_int

    if not isinstance(plan, BucketPlan):
        raise ValueError(f"plan must be a BucketPlan (BucketPlan.load(path)), got {type(plan).__name__}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
    for name, n in sizes.items():
        if n is not None and not (is_int(n) and n >= 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {n!r}")
    if run is not None and not callable(run):
        raise ValueError(f"run must be None or a callable run(bucket, batch), got {type(run).__name__}")
    if buckets is not None and (isinstance(buckets, (str, bytes)) or not all(isinstance(b, Bucket) for b in buckets)):
        raise ValueError(f"buckets must be None or a list of Bucket, got {buckets!r:.80}")


def _eta(elapsed: float, done: int, total: int, cost_left: float, cost_done: float) -> str:
    """Time left: the seconds so far scaled by the plan's modelled work left against work done (buckets run
    cheapest first, so a count would promise too little), by bucket counts when the plan has no costs."""
    if done >= total:
        return "0 s"
    rate = elapsed / cost_done if cost_done > 0 else None
    seconds = rate * cost_left if rate is not None and cost_left > 0 else elapsed / done * (total - done)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def check_cache_fits(name: str, num_blocks: int, shape: tuple, dtype, device) -> None:
    """Refuse a KV cache (key and value, `shape` each) larger than the device's free memory, naming `name`
    (the flag or field that set `num_blocks`) and the bytes it would take, before allocating anything."""
    import torch

    need = 2 * int(np.prod(shape, dtype=object)) * torch.empty((), dtype=dtype).element_size()
    free = free_memory(torch.device(device))
    if free is not None and need > free:
        raise ValueError(f"{name} {num_blocks}: a KV cache of shape {list(shape)} ({dtype}, key and value) takes "
                         f"{need} bytes ({need / 2**30:.1f} GiB), more than the {free} bytes ({free / 2**30:.1f} "
                         f"GiB) free on {device}")


def free_memory(device) -> int | None:
    """Bytes free for a new allocation on `device` (None: unknown)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            return int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return None
    return None


def _allocate(shape, dtype, device):
    import torch

    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:  # the allocator refused: one line, not its traceback
        raise ValueError(f"num_blocks {shape[0]}: cannot allocate a KV cache of shape {list(shape)} on {device} "
                         f"({' '.join(str(exc).split())[:200]})") from None


def _sync(out, device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "hpu":  # pragma: no cover - needs Gaudi
        import habana_frameworks.torch.core as htcore

        htcore.mark_step()
        torch.hpu.synchronize()
    elif isinstance(out, torch.Tensor):
        out.sum().item()  # make sure the work ran


# ----------------------------------------------------------------------------- command


def register(subparsers) -> None:
    p = subparsers.add_parser("warmup", help="run unified attention once per bucket of a plan, timed",
                              description="Run unified attention once per bucket of PLAN on the current device "
                                          "(HPU graphs on Gaudi, torch.compile with --mode compile, eager "
                                          "otherwise) and print per-bucket and total times.")
    p.add_argument("plan", metavar="PLAN", help="bucket plan JSON (from `buckets generate`)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda[:N] or hpu[:N], checked before any work (default: hpu if available, else cpu)")
    p.add_argument("--mode", choices=MODES, default="auto", help="how each bucket runs (default: auto)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="activation and KV dtype (default: the plan's model dtype)")
    p.add_argument("--num-qo-heads", type=POSITIVE, default=None, help="query heads (default: the plan's model)")
    p.add_argument("--num-kv-heads", type=POSITIVE, default=None, help="KV heads (default: the plan's model)")
    p.add_argument("--head-dim", type=POSITIVE, default=None, help="head size (default: the plan's model)")
    p.add_argument("--num-blocks", type=POSITIVE, default=None, help="KV cache blocks (default: the plan's)")
    p.add_argument("--limit", type=POSITIVE, default=None, help="warm only the N cheapest buckets")
    p.add_argument("--max-cost-us", type=float_in(0.0, None), default=None,
                   help="skip buckets whose modelled work exceeds this many µs (e.g. the limits bucket on CPU)")
    p.add_argument("--json", type=output_path, default=None, help="also write the per-bucket times to this JSON file")
    p.add_argument("--no-progress", action="store_true",
                   help="no line per bucket on stderr as it finishes (the table at the end is printed anyway)")
    p.set_defaults(func=_cmd_warmup)


def _default_device() -> str:
    from vllm_gaudi_unified.hpu import habana_importable

    if habana_importable():  # pragma: no cover - needs Gaudi
        import habana_frameworks.torch  # noqa: F401
        import torch

        if torch.hpu.is_available():
            return "hpu"
    return "cpu"


def _cmd_warmup(args) -> int:
    import torch

    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan

    from vllm_gaudi_unified.batch import check_device

    device = check_device(args.device or _default_device(), "--device")
    plan = BucketPlan.load(args.plan)
    todo = list(plan.buckets)  # cheapest first
    if args.max_cost_us is not None:
        todo = [b for b, c in zip(plan.buckets, plan.costs) if c <= args.max_cost_us]
    if args.limit is not None:
        todo = todo[: args.limit]
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if plan.model.dtype_bytes == 2
                                                           else torch.float32)
    shape = (args.num_blocks or plan.settings.num_blocks, plan.settings.block_size,
             args.num_kv_heads or plan.model.num_kv_heads, args.head_dim or plan.model.head_dim)
    check_cache_fits("--num-blocks" if args.num_blocks else f"{args.plan}: settings: num_blocks", shape[0], shape,
                     dtype, device)
    try:
        report = warmup(plan, device=device, mode=args.mode, dtype=dtype, num_qo_heads=args.num_qo_heads,
                        num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, num_blocks=args.num_blocks,
                        buckets=todo, progress=not args.no_progress)
    except KeyboardInterrupt as exc:  # keep what was warmed: the table and the JSON of the buckets done
        report = getattr(exc, "warmup_report", None)
        if report is not None:
            _report(args, plan, todo, report, interrupted=True)
        raise
    _report(args, plan, todo, report)
    return 0


def _report(args, plan, todo, report: WarmupReport, interrupted: bool = False) -> None:
    import json

    print(report.table() + (f" (interrupted: {len(todo) - len(report.buckets)} of {len(todo)} buckets not run)"
                            if interrupted else ""), flush=True)
    if len(todo) < len(plan) and not interrupted:
        print(f"({len(plan) - len(todo)} of {len(plan)} buckets skipped by --limit/--max-cost-us)")
    if args.json:
        with atomic_write(args.json) as f:
            json.dump({"plan": args.plan, "mode": report.mode, "device": report.device,
                       "total_seconds": report.total_seconds, "interrupted": interrupted,
                       "buckets": [{"bucket": str(b), "seconds": s} for b, s in zip(report.buckets, report.seconds)]},
                      f, indent=1)
