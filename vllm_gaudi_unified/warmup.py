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
from vllm_gaudi_unified.plan.smallest import can_hold_a_step

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
    from vllm_gaudi_unified.plan.smallest import smallest_steps

    smallest = smallest_steps(block_size, options or DEFAULT_OPTIONS, sliding_window)[bucket.phase]
    if smallest is None:
        raise ValueError(f"bucket {bucket}: the planner makes no step of phase {bucket.phase!r} with these options")
    step, shape = smallest
    if bucket.num_prompts:  # the prompt route's shape: one more request on it (`with_prompt`)
        step, shape = with_prompt(step, bucket, block_size, options or DEFAULT_OPTIONS, sliding_window)
    if not bucket.covers(shape):
        raise ValueError(f"bucket {bucket} cannot hold the smallest step of its phase ({shape})")
    return step


def with_prompt(step, bucket: Bucket, block_size: int, options, sliding_window=None):
    """`step` and one more request on the prompt route: two new tokens, over one block of context of its
    own when the bucket has prompt context blocks. Returns (step, shape)."""
    from vllm_gaudi_unified.plan import plan_step

    q, ctx, table = step
    own = int(table.max()) + 1 if table.size else 0
    width = max(table.shape[1], 1)
    row = np.zeros((1, width), np.int64)
    row[0, 0] = own
    step = (np.append(q, 2), np.append(ctx, block_size if bucket.prompt_blocks else 0),
            np.concatenate([np.pad(table, ((0, 0), (0, width - table.shape[1]))), row]))
    return step, plan_step(*step, block_size, sliding_window=sliding_window, options=options).shape


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
           progress: bool = True) -> WarmupReport:
    """Run every bucket of `plan` (a BucketPlan) once; returns per-bucket and total seconds.

    Heads, head size and cache size default to the plan's model and settings.
    `key_cache`/`value_cache`: the real KV cache (vLLM); else one is allocated.
    `run(bucket, batch)`: replaces the default attention call (vLLM runs its model).
    `buckets`: a subset to warm (default: all, cheapest first).
    """
    import torch

    device = torch.device(device or "cpu")
    mode = resolve_mode(mode, device.type)
    settings, model = plan.settings, plan.model
    dtype = dtype or (torch.bfloat16 if model.dtype_bytes == 2 else torch.float32)
    hq, hkv, d = num_qo_heads or model.num_qo_heads, num_kv_heads or model.num_kv_heads, head_dim or model.head_dim
    todo = list(plan.buckets if buckets is None else buckets)
    report = WarmupReport(mode=mode, device=str(device))
    report.skipped = [b for b in todo if not can_hold_a_step(b, settings.block_size, settings.options,
                                                             settings.sliding_window)]
    if report.skipped:  # an old plan file: its generator emitted buckets no step can use
        logger.warning("warmup skips %d of %d buckets that no step of their phase fits (e.g. %s)",
                       len(report.skipped), len(todo), report.skipped[0])
        skip = set(report.skipped)
        todo = [b for b in todo if b not in skip]
    if run is None:
        if key_cache is None:
            nb = num_blocks or settings.num_blocks
            shape = (nb, settings.block_size, hkv, d)
            key_cache = torch.zeros(shape, dtype=dtype, device=device)
            value_cache = torch.zeros(shape, dtype=dtype, device=device)
        attend = _attention_fn(mode)
        scale = 1.0 / d ** 0.5

        def run(bucket, batch):
            t = bucket.query_len
            q = torch.randn(t, hq, d, dtype=dtype, device=device)
            k = torch.randn(t, hkv, d, dtype=dtype, device=device)
            return attend(q, k, torch.randn_like(k), key_cache, value_cache, batch, scale)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=f"warmup ({mode})", unit="bucket")
    start = time.perf_counter()
    for bucket in todo:
        t0 = time.perf_counter()
        batch = batch_for_bucket(bucket, settings.block_size, settings.options, settings.sliding_window, device)
        out = run(bucket, batch)
        _sync(out, device)
        report.buckets.append(bucket)
        report.seconds.append(time.perf_counter() - t0)
        if bar:
            bar.set_postfix_str(f"{bucket} {report.seconds[-1]:.2f}s")
            bar.update(1)
    if bar:
        bar.close()
    report.total_seconds = time.perf_counter() - start
    logger.info("warmed %d buckets in %.2f s (%s on %s)", len(todo), report.total_seconds, mode, device)
    return report


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
    p.add_argument("--device", default=None, help="torch device (default: hpu if available, else cpu)")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    import json

    import torch

    from vllm_gaudi_unified.bucket_plans.bucket_plan import BucketPlan

    plan = BucketPlan.load(args.plan)
    todo = list(plan.buckets)  # cheapest first
    if args.max_cost_us is not None:
        todo = [b for b, c in zip(plan.buckets, plan.costs) if c <= args.max_cost_us]
    if args.limit is not None:
        todo = todo[: args.limit]
    report = warmup(plan, device=args.device or _default_device(), mode=args.mode,
                    dtype=getattr(torch, args.dtype) if args.dtype else None, num_qo_heads=args.num_qo_heads,
                    num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, num_blocks=args.num_blocks,
                    buckets=todo, progress=not args.no_progress)
    print(report.table())
    if len(todo) < len(plan):
        print(f"({len(plan) - len(todo)} of {len(plan)} buckets skipped by --limit/--max-cost-us)")
    if args.json:
        with atomic_write(args.json) as f:
            json.dump({"plan": args.plan, "mode": report.mode, "device": report.device,
                       "total_seconds": report.total_seconds,
                       "buckets": [{"bucket": str(b), "seconds": s} for b, s in zip(report.buckets, report.seconds)]},
                      f, indent=1)
    return 0
