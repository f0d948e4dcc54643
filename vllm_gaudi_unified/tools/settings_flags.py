"""The server-settings and model flags of `buckets generate` and `buckets simulate`, and the settings they
make: a preset (or the settings in the traces' headers), then the flags given."""
from __future__ import annotations

import argparse

from vllm_gaudi_unified.flags import POSITIVE, TILE, float_in, int_in
from vllm_gaudi_unified.plan.arrays import MAX_BLOCK_SIZE, MAX_STEP_TOKENS
from vllm_gaudi_unified.tools.plan_flags import add_plan_option_flags, plan_options_from_args
from vllm_gaudi_unified.bucket_plans.workloads import MIXES, WORKLOADS

WORKLOAD_NAMES = tuple(WORKLOADS)
#: What a plan may learn from when no trace is given: a named workload or a mix of them.
LEARN_NAMES = (*MIXES, *WORKLOADS)

DEFAULT_PRESET = "llama8b-gaudi3"
SETTING_FLAGS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks",
                 "sliding_window", "num_speculative_tokens")
#: Batch-invariant PlanOptions with a flag of `buckets generate` (`--batch-invariant`, `--invariant-chunk`, ...).
INVARIANT_FLAGS = ("batch_invariant", "invariant_rows", "invariant_chunk", "invariant_causal_chunk")
MODEL_FLAGS = ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "dtype_bytes", "hidden_size", "vocab_size")


def add_settings(p: argparse.ArgumentParser, options: bool = True) -> None:
    from vllm_gaudi_unified.bucket_plans.settings import PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="server settings to start from; flags below override. " + "; ".join(
                       f"{name}: {describe_settings(s)}" for name, s in sorted(PRESETS.items())) +
                   f". Default: {DEFAULT_PRESET}, or with --trace the settings in the trace's header")
    p.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=None,
                   help="KV cache block size (tokens)")
    p.add_argument("--max-num-seqs", type=POSITIVE, default=None, help="vLLM max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int_in(1, MAX_STEP_TOKENS), default=None,
                   help="vLLM max_num_batched_tokens")
    p.add_argument("--max-model-len", type=POSITIVE, default=None, help="vLLM max_model_len")
    p.add_argument("--num-blocks", type=POSITIVE, default=None, help="KV cache blocks")
    p.add_argument("--sliding-window", type=POSITIVE, default=None, help="sliding window of the model, if any")
    p.add_argument("--num-speculative-tokens", type=int_in(0, 64), default=None,
                   help="speculative decoding: draft tokens per decode (vLLM's num_speculative_tokens; default 0). "
                        "Decodes then bring up to 1 + k tokens: the exponential plan adds buckets for them and "
                        "the simulator schedules them")
    p.add_argument("--draft-acceptance", type=float_in(0.0, 1.0), default=0.7,
                   help="simulator only: probability that a draft is accepted (each, until the first rejection)")
    if options:  # no 'auto' layout: one bucket would need two graphs (slice and gather)
        add_plan_option_flags(p, layouts=("gather", "slice"), base="the preset's (unique layout: gather)")
        p.add_argument("--invariant-rows", type=TILE["invariant_rows"], default=None,
                       help="planner option, batch-invariant mode: query rows of a unit")
        p.add_argument("--invariant-chunk", type=TILE["invariant_chunk"], default=None,
                       help="planner option, batch-invariant mode: units per product")
        p.add_argument("--invariant-causal-chunk", type=TILE["invariant_causal_chunk"], default=None,
                       help="planner option, batch-invariant mode: causal tiles per product")


def describe_settings(s) -> str:
    return ", ".join(f"{k} {getattr(s, k)}" for k in SETTING_FLAGS if getattr(s, k) not in (None, 0) or k == "block_size")


def add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-layers", type=POSITIVE, default=None, help="model layers (default 32, Llama-3.1-8B)")
    p.add_argument("--num-qo-heads", type=POSITIVE, default=None, help="query heads (default 32)")
    p.add_argument("--num-kv-heads", type=POSITIVE, default=None, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=POSITIVE, default=None, help="head size (default 128)")
    p.add_argument("--dtype-bytes", type=int_in(1, 8), default=None, help="bytes per element (default 2, bf16)")
    p.add_argument("--hidden-size", type=POSITIVE, default=None, help="hidden size, for the LM head (default 4096)")
    p.add_argument("--vocab-size", type=POSITIVE, default=None, help="vocabulary, for the LM head (default 128256)")


def settings_from_args(args):
    """The preset (default: DEFAULT_PRESET, or the settings in the --trace headers), then the flags given."""
    from dataclasses import replace

    from vllm_gaudi_unified.bucket_plans.settings import PRESETS

    s = PRESETS[args.preset or DEFAULT_PRESET]
    if args.preset is None and getattr(args, "trace", None):  # the settings the traces were recorded under
        s = replace(s, **traces_settings(args.trace))
    over = {k: getattr(args, k) for k in SETTING_FLAGS if getattr(args, k, None) is not None}
    options = plan_options_from_args(args, s.options)
    invariant = {k: getattr(args, k) for k in INVARIANT_FLAGS if getattr(args, k, None) not in (None, False)}
    options = replace(options, **invariant) if invariant else options
    if options != s.options:
        over["options"] = options
    return replace(s, **over) if over else s


def traces_settings(paths: list[str]) -> dict:
    """The server settings in the traces' headers (the plugin writes them at the top level, the simulator under
    `scheduler`; a trace without one gives its steps' block size); traces recorded under different settings
    are refused, naming both."""
    from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
    from vllm_gaudi_unified.bucket_plans.trace import iter_trace, read_header

    found, first = {}, None
    for path in paths:
        header = read_header(path)
        merged = {**header.get("scheduler", {}), **header} if isinstance(header.get("scheduler"), dict) else header
        got = {k: merged[k] for k in SETTING_FLAGS if merged.get(k) is not None}
        if "block_size" not in got:  # a trace without a header: its steps say the block size
            got["block_size"] = next((x.block_size for x in iter_trace(path) if not isinstance(x, dict)), None)
            got = {k: v for k, v in got.items() if v is not None}
        try:
            ServerSettings(**got)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: trace header: {exc}") from None
        if first is not None and got != found:
            raise ValueError(f"{path}: trace header settings {got} differ from {first}'s {found}: give the settings "
                             "as flags (or --preset)")
        found, first = (got, path) if first is None else (found, first)
    return found


def model_from_args(args):
    from vllm_gaudi_unified.bucket_plans.cost import ModelSpec

    return ModelSpec(**{k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k, None) is not None})
