"""The planner's options as command-line flags, defined once for every command that plans steps
(`trace-stats`, `buckets generate`, the benchmark suite). Torch-free, so `--help` stays fast."""
from __future__ import annotations

import argparse
from dataclasses import replace

from vllm_gaudi_unified.flags import TILE
from vllm_gaudi_unified.plan.options import DEFAULT_OPTIONS, UNIQUE_LAYOUTS, PlanOptions

#: PlanOptions fields that have a flag (`--causal-tile`, ...).
PLAN_OPTION_FLAGS = ("causal_tile", "shared_rows", "shared_tile_keys", "unique_layout")


def add_plan_option_flags(parser: argparse.ArgumentParser, layouts: tuple[str, ...] = UNIQUE_LAYOUTS,
                          base: str = "the planner's") -> None:
    """`--causal-tile`, `--shared-rows`, `--shared-tile-keys`, `--unique-layout`; each unset flag keeps the
    value of the options the command starts from (`base` says which, for `--help`)."""
    g = parser.add_argument_group("planner options", f"unset: {base}")
    g.add_argument("--causal-tile", type=TILE["causal_tile"], default=None, help="query rows = key columns of a causal tile")
    g.add_argument("--shared-rows", type=TILE["shared_rows"], default=None, help="query rows of a shared tile")
    g.add_argument("--shared-tile-keys", type=TILE["shared_tile_keys"], default=None, help="keys of a shared tile (whole blocks)")
    g.add_argument("--unique-layout", choices=layouts, default=None,
                   help="unique path: contiguous slice, gathered live blocks" +
                        (", or chosen per step (auto)" if "auto" in layouts else ""))


def plan_options_from_args(args: argparse.Namespace, base: PlanOptions = DEFAULT_OPTIONS) -> PlanOptions:
    """`base` with the flags that were given."""
    given = {k: getattr(args, k) for k in PLAN_OPTION_FLAGS if getattr(args, k, None) is not None}
    return replace(base, **given) if given else base
