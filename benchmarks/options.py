"""The suite's command-line flags, importable without torch (so `--help` stays fast), each range-checked like
every command's of the package (`vllm_gaudi_unified/flags.py`); `parse_args` adds the checks between flags.
"""
from __future__ import annotations

import argparse
import re

from vllm_gaudi_unified.files import output_dir
from vllm_gaudi_unified.flags import POSITIVE, SEED, comma_ints_in, float_in
from vllm_gaudi_unified.plan.arrays import MAX_BLOCK_SIZE
from vllm_gaudi_unified.tools.cli import Parser
from vllm_gaudi_unified.tools.plan_flags import add_plan_option_flags

DESCRIPTION = (
    "Plan each scenario, check unified_attention against a float32 reference, time it next to SDPA/FlexAttention "
    "baselines; writes results.json/.md/.png. Needs a source checkout (run from the repository root: the suite is "
    "the repository's benchmarks/ package, not part of the installed package), torch, and for graph/compiled "
    "variants and flex a CUDA GPU (CPU runs time eager only).")
DTYPES = ("bfloat16", "float16", "float32")
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")

HBM_BYTES_PER_S = 3.35e12  #: H100 SXM HBM3 peak (0.64 ms floor for decode 256 x 2k)
BF16_FLOPS = 800e12  #: dense bf16 matmul measured on an H100
VARIANTS = ("eager", "graph", "compiled")
BASELINES = ("sdpa_loop", "padded_sdpa", "flex")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="python -m benchmarks.suite", description=DESCRIPTION)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--out", type=output_dir, default="out/bench",
                   help="folder for results.json, results.md, results.png")
    p.add_argument("--scenarios", default="all", help="comma-separated scenario names, or 'all'")
    p.add_argument("--block-sizes", type=comma_ints_in(1, MAX_BLOCK_SIZE, "block sizes"), default="16,128",
                   help="comma-separated KV cache block sizes")
    p.add_argument("--variants", default="eager,graph,compiled",
                   help=f"variants of unified_attention to time, from {','.join(VARIANTS)} (graph/compiled: CUDA)")
    p.add_argument("--baselines", default="sdpa_loop,padded_sdpa,flex",
                   help=f"baselines to time, from {','.join(BASELINES)} ('none' for none; flex: CUDA only)")
    p.add_argument("--baseline-block-sizes", type=comma_ints_in(1, MAX_BLOCK_SIZE, "block sizes"), default="16",
                   help="block sizes at which baselines run")
    p.add_argument("--scale", type=float_in(1e-6, 1e3), default=1.0,
                   help="shrink request counts and lengths (CPU runs, tests)")
    p.add_argument("--num-qo-heads", type=POSITIVE, default=32, help="query heads")
    p.add_argument("--num-kv-heads", type=POSITIVE, default=8, help="KV heads")
    p.add_argument("--head-dim", type=POSITIVE, default=128, help="head size")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="activations and KV cache")
    p.add_argument("--tol", type=float_in(0.0, 1e6), default=1e-2, help="largest accepted |out - ref| / |ref|")
    p.add_argument("--seed", type=SEED, default=0, help="seed of block tables and tensors")
    add_plan_option_flags(p)
    p.add_argument("--profile", default="", help="comma-separated scenario:block_size:variant to profile")
    p.add_argument("--isolate", action="store_true",
                   help="run each (scenario, block size) in its own process (no memory carried between cases)")
    p.add_argument("--time-budget", type=float_in(0.0, 1e9), default=1e9, help="seconds; skip remaining work past this")
    p.add_argument("--cpu-reps", type=POSITIVE, default=50, help="timed calls per measurement on CPU (CUDA: do_bench)")
    p.add_argument("--case-timeout", type=float_in(0.0, 1e9), default=1e9, help="--isolate: seconds one case may take")
    p.add_argument("--invariant", default="none",
                   help="scenarios ('all', 'none' or comma-separated) where the batch-invariant mode is also "
                        "timed (eager and graph), at the baseline block sizes (the invariant mode's cost column)")
    p.add_argument("--fp8", default="none",
                   help="scenarios ('all', 'none' or comma-separated) also timed over an fp8 KV cache (every "
                        "variant; per-tensor scales; checked against the reference over the dequantized cache; "
                        "the bf16 vs fp8 column)")
    p.add_argument("--unique-routes", default="none",
                   help="unique-path routes ('kernel', 'torch', comma-separated, or 'none') also timed on every "
                        "scenario, every variant (method `route`): the step again with the unique path forced "
                        "through the Triton kernel, or through flash per block / the matmul tiles, beside the "
                        "default's own choice")
    p.add_argument("--fp8-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "fp8_e5m2"),
                   help="fp8 format of the --fp8 runs (vLLM's kv_cache_dtype names)")
    return p


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The suite's arguments, with the checks no single flag can make (each a one-line error, exit 2)."""
    p = parser or build_parser()
    args = p.parse_args(argv)
    if args.num_qo_heads % args.num_kv_heads:
        p.error(f"--num-qo-heads {args.num_qo_heads} must be a multiple of --num-kv-heads {args.num_kv_heads}")
    if args.device is not None and not DEVICE.match(args.device):
        p.error(f"argument --device: {args.device!r} is not cpu, cuda or cuda:N")
    for flag, value, known in (("--variants", args.variants, VARIANTS), ("--baselines", args.baselines,
                                                                          BASELINES + ("none",))):
        unknown = [v for v in value.split(",") if v and v not in known]
        if unknown or (flag == "--variants" and not value.strip(",")):
            p.error(f"argument {flag}: {value!r}: give names from {','.join(known)}")
    for spec in filter(None, args.profile.split(",")):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in VARIANTS:
            p.error(f"argument --profile: {spec!r} is not scenario:block_size:variant")
    return args


def to_argv(args: argparse.Namespace, **override) -> list[str]:
    """The flags that reproduce `args` (with `override`), for a child process."""
    argv = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = override.get(action.dest, getattr(args, action.dest, action.default))
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        if action.nargs == 0:
            if value:
                argv.append(action.option_strings[0])
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv
