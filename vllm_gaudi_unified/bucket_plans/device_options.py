"""Planner options chosen by measured time, shipped per device kind.

The tile sizes that are fastest depend on the device's kernels, not on counted
work: with CUDA flash a shared tile's padding rows cost nothing (its real rows
are packed) and long tiles keep scores on the chip, so large tiles win there,
while the matmul tiles Gaudi runs pay for every padded cell. Each entry below
was measured (`python -m benchmarks.speed --variants`); a device
kind without an entry keeps the planner's defaults.

Not the default: the planner chooses each step's route from its
shape, identically on every device (`plan/prompts.py`), and the plugin plans
with the same options everywhere. This table is an explicit, measured
override: `VLLM_GAUDI_UNIFIED_DEVICE_OPTIONS=1`.

The chosen options go into a bucket plan's settings (`ServerSettings.options`,
saved with the plan), so warmup compiles and serving runs the same graphs;
without a bucket plan the plugin plans every step with them.
"""
from __future__ import annotations

from dataclasses import replace

from vllm_gaudi_unified.plan import PlanOptions

#: device kind -> PlanOptions fields, each measured faster than the defaults on that device.
DEVICE_OPTIONS: dict[str, dict] = {
    # Measured 2026-11-23 (`python -m benchmarks.speed --variants`): shared tiles of 256 rows x 2048 keys were the
    # fastest of the fused variants on chunked prefill, mixed and shared-prefix steps at block sizes 16 and 128.
    "cuda:NVIDIA H100 80GB HBM3": {"shared_rows": 256, "shared_tile_keys": 2048},
}


def device_kind(device_type: str, device_name: str = "") -> str:
    """'cuda:<device name>' for a CUDA device (`torch.cuda.get_device_name`), else the device type."""
    return f"cuda:{device_name}" if device_type == "cuda" else device_type


def options_for_device(kind: str, base: PlanOptions) -> PlanOptions:
    """`base` with the measured fields of `kind` (unchanged for a kind without an entry)."""
    return replace(base, **DEVICE_OPTIONS.get(kind, {}))
