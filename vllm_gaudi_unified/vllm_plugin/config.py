"""The plugin's options: environment variables, read once per process.

vLLM starts engine and worker processes of its own, and the platform plugin is
resolved before any vLLM config exists, so the options are environment
variables: they reach every process and are there when vLLM asks for a
platform. docs/usage.md lists them with their defaults. Only the standard
library and `hpu.habana_importable` are imported here: `entry.py` reads these
in every vLLM process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_gaudi_unified.flags import env_flag
from vllm_gaudi_unified.hpu import habana_importable

#: "1" activates the plugin off Gaudi (CPU platform + unified backend); "0" keeps it off even
#: on Gaudi; unset: on only on Gaudi.
ENV_ENABLE = "VLLM_GAUDI_UNIFIED"
#: A bucket plan file (from `vllm-gaudi-unified buckets generate`), or "auto" to make one at start-up.
ENV_BUCKETS = "VLLM_GAUDI_UNIFIED_BUCKETS"
#: "1" (default when a plan is given) runs every bucket of the plan once at start-up.
ENV_WARMUP = "VLLM_GAUDI_UNIFIED_WARMUP"
#: A path: every step the backend plans is appended to it in the scheduler trace format.
ENV_RECORD_TRACE = "VLLM_GAUDI_UNIFIED_RECORD_TRACE"
#: "1": plan steps so that a request's result does not depend on its batch (PlanOptions.batch_invariant).
ENV_BATCH_INVARIANT = "VLLM_GAUDI_UNIFIED_BATCH_INVARIANT"

#: "1": plan with the tile sizes measured for this device kind (`bucket_plans/device_options.py`), an
#: explicit override; by default every device plans with the same options (the planner picks routes).
ENV_DEVICE_OPTIONS = "VLLM_GAUDI_UNIFIED_DEVICE_OPTIONS"

@dataclass(frozen=True)
class PluginConfig:
    """What the user asked for; `from_env()` is the only constructor vLLM processes use."""

    enable: bool | None = None  #: VLLM_GAUDI_UNIFIED: True / False / None (auto: on only on Gaudi)
    buckets: str | None = None  #: VLLM_GAUDI_UNIFIED_BUCKETS: plan file path, "auto", or None (no padding)
    warmup: bool = True  #: VLLM_GAUDI_UNIFIED_WARMUP: warm every bucket at start-up when a plan is given
    record_trace: str | None = None  #: VLLM_GAUDI_UNIFIED_RECORD_TRACE: trace file to append steps to
    batch_invariant: bool = False  #: VLLM_GAUDI_UNIFIED_BATCH_INVARIANT (default: vLLM's VLLM_BATCH_INVARIANT)
    device_options: bool = False  #: VLLM_GAUDI_UNIFIED_DEVICE_OPTIONS: the measured per-device tile table

    @classmethod
    def from_env(cls, environ=None) -> "PluginConfig":
        env = os.environ if environ is None else environ
        batch_invariant = env_flag(ENV_BATCH_INVARIANT, env)
        if batch_invariant is None:
            batch_invariant = bool(env_flag("VLLM_BATCH_INVARIANT", env))
        warmup = env_flag(ENV_WARMUP, env)
        return cls(
            enable=env_flag(ENV_ENABLE, env),
            buckets=env.get(ENV_BUCKETS) or None,
            warmup=True if warmup is None else warmup,
            record_trace=env.get(ENV_RECORD_TRACE) or None,
            batch_invariant=batch_invariant,
            device_options=bool(env_flag(ENV_DEVICE_OPTIONS, env)),
        )


def hpu_present() -> bool:
    """An HPU is usable: `habana_frameworks` imports and reports a device. Imports the bridge
    only when it is installed, so machines without it pay nothing."""
    if not habana_importable():
        return False
    try:
        import habana_frameworks.torch.hpu as hthpu  # noqa: PLC0415  (lazy: heavy, Gaudi only)

        return bool(hthpu.is_available())
    except Exception:  # a broken or driver-less install is "no Gaudi"
        return False
