"""The entry points vLLM calls (`setup.py`: `vllm.platform_plugins`, `vllm.general_plugins`).

vLLM calls both in every one of its processes, so they stay cheap: the
standard library and `config` only; vLLM, vllm-gaudi and `habana_frameworks`
are imported inside the functions, and only where they are needed.

Activation, all conditions in one place (`platform_plugin`):

1. `VLLM_GAUDI_UNIFIED=0`: off, everywhere.
2. Gaudi present: vllm-gaudi's Gaudi platform with the unified backend, when
   vLLM can take it (`_gaudi_platform` says when not, and why).
3. `VLLM_GAUDI_UNIFIED=1` without Gaudi: vLLM's CPU platform with the unified backend.
4. Otherwise: None, and vLLM picks its platform exactly as without the plugin.
"""
from __future__ import annotations

import importlib.util
import os

from vllm_gaudi_unified.vllm_plugin.config import PluginConfig, hpu_present

CPU_PLATFORM = "vllm_gaudi_unified.vllm_plugin.platform.UnifiedCpuPlatform"
HPU_PLATFORM = "vllm_gaudi_unified.vllm_plugin.hpu_platform.UnifiedHpuPlatform"
VLLM_GAUDI_PLATFORM_PLUGIN = "hpu"  #: vllm-gaudi's own entry point name in `vllm.platform_plugins`


def is_active(config: PluginConfig | None = None) -> bool:
    """Whether this process runs with the plugin on (cases 2 and 3 above)."""
    cfg = PluginConfig.from_env() if config is None else config
    if cfg.enable is False:
        return False
    return bool(cfg.enable) or hpu_present()


def platform_plugin() -> str | None:
    """vLLM's platform plugin hook: the qualified name of the platform class to use, or None."""
    cfg = PluginConfig.from_env()
    if not is_active(cfg):
        return None
    if hpu_present():
        return _gaudi_platform(os.environ)
    return CPU_PLATFORM


def _gaudi_platform(environ) -> str | None:
    """`HPU_PLATFORM` when vLLM can activate it, else None with a warning saying why.

    vLLM accepts exactly one activated out-of-tree platform plugin, and
    vllm-gaudi's own `hpu` plugin activates whenever an HPU is present; so
    ours can be used only when `hpu` is left out of `VLLM_PLUGINS` (vllm-gaudi's
    general plugins stay in it). Otherwise we step aside and vLLM starts with
    vllm-gaudi's own attention, instead of refusing to start.
    """
    from vllm_gaudi_unified.log import get_logger

    logger = get_logger("vllm.gaudi_unified.entry")
    if importlib.util.find_spec("vllm_gaudi") is None:
        logger.warning("Gaudi found but vllm-gaudi is not installed: vLLM cannot run on Gaudi without it, "
                       "so unified attention stays off. Install vllm-gaudi next to this package.")
        return None
    allowed = environ.get("VLLM_PLUGINS")
    names = None if allowed is None else [n.strip() for n in allowed.split(",")]
    if names is None or VLLM_GAUDI_PLATFORM_PLUGIN in names:
        logger.warning("vllm-gaudi's platform plugin %r is enabled too and vLLM accepts only one platform plugin: "
                       "running vllm-gaudi's own attention. To use unified attention, leave %r out of "
                       "VLLM_PLUGINS (docs/usage.md).", VLLM_GAUDI_PLATFORM_PLUGIN, VLLM_GAUDI_PLATFORM_PLUGIN)
        return None
    import vllm_gaudi

    vllm_gaudi.register()  # vllm-gaudi's per-process set-up, which its (left out) platform plugin would have run
    return HPU_PLATFORM


def general_plugin() -> None:
    """vLLM's general plugin hook: put the backend in vLLM's attention backend registry.

    Does nothing when the plugin is off, so an installed-but-unasked plugin
    leaves the registry as it was. Safe to call more than once per process.
    """
    if is_active():
        from vllm_gaudi_unified.vllm_plugin.backend import register_backend

        register_backend()
