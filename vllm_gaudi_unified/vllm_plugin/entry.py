"""The entry points vLLM calls (`setup.py`: `vllm.platform_plugins`, `vllm.general_plugins`).

vLLM calls both in every one of its processes, so they stay cheap: the
standard library and `config` only; vLLM, vllm-gaudi and `habana_frameworks`
are imported inside the functions, and only where they are needed.

Activation, all conditions in one place (`decide`):

1. `VLLM_GAUDI_UNIFIED=0`: off, everywhere.
2. Gaudi present and `takeover_problem` finds nothing in the way (vllm-gaudi installed,
   `VLLM_PLUGINS` naming this plugin and vllm-gaudi's general plugins but not its `hpu`
   platform plugin): vllm-gaudi's platform with the unified worker, runner and backend.
3. Gaudi present, something in the way, `VLLM_GAUDI_UNIFIED=1`: start-up fails with an
   error saying what to set (never silently off).
4. Gaudi present, something in the way, variable unset: off, fully out of the way; one log
   line says that vllm-gaudi's own attention runs, and why.
5. `VLLM_GAUDI_UNIFIED=1` without Gaudi: vLLM's CPU platform with the unified backend.
6. Otherwise: off, and vLLM picks its platform exactly as without the plugin.

vLLM swallows errors raised by platform plugins (it logs them and goes on without that
platform), so case 3 raises from the general plugin, whose errors stop the start-up.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

from vllm_gaudi_unified.vllm_plugin.config import ENV_ENABLE, PluginConfig, hpu_present

CPU_PLATFORM = "vllm_gaudi_unified.vllm_plugin.platform.UnifiedCpuPlatform"
HPU_PLATFORM = "vllm_gaudi_unified.vllm_plugin.hpu_platform.UnifiedHpuPlatform"
PLUGIN_NAME = "unified_attention"  #: this package's entry point name in both groups (setup.py)
VLLM_GAUDI_PLATFORM_PLUGIN = "hpu"  #: vllm-gaudi's own entry point name in `vllm.platform_plugins`
#: vllm-gaudi's general plugins as of the checked snapshot (used when its metadata cannot be read).
VLLM_GAUDI_GENERAL_PLUGINS = ("01.hpu_custom_utils", "02.hpu_custom_ops", "03.hpu_custom_models",
                              "04.hpu_tool_parsers")
#: The one the unified runner cannot run without: it replaces vLLM's `Attention.forward` with
#: vllm-gaudi's calling convention (and the HPU ops). The others (utilities, model variants, tool
#: parsers) are vllm-gaudi features; missing ones are named in a warning.
VLLM_GAUDI_OPS_PLUGIN = "02.hpu_custom_ops"


@dataclass(frozen=True)
class Decision:
    platform: str | None  #: qualified platform class for vLLM, or None
    backend: str | None  #: "cpu" / "hpu": which backend the general plugin registers, or None
    error: str | None = None  #: case 3: the start-up error
    note: str | None = None  #: case 4: why the plugin stays out of the way


def vllm_gaudi_general_plugins() -> tuple[str, ...]:
    """The names of vllm-gaudi's `vllm.general_plugins` entry points (from its installed metadata)."""
    names = tuple(sorted(ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
                         if ep.value.split(":")[0].split(".")[0] == "vllm_gaudi"))
    return names or VLLM_GAUDI_GENERAL_PLUGINS


def required_vllm_plugins() -> str:
    """The VLLM_PLUGINS value that lets the unified runner take over on Gaudi."""
    return ",".join((PLUGIN_NAME, *vllm_gaudi_general_plugins()))


def takeover_problem(environ) -> str | None:
    """Why the unified runner cannot take over on this Gaudi machine, or None.

    vLLM accepts exactly one activated out-of-tree platform plugin, and vllm-gaudi's own
    `hpu` plugin activates whenever an HPU is present, so it must be left out of
    VLLM_PLUGINS; vllm-gaudi's general plugins must stay in (they replace vLLM's
    `Attention.forward` and ops for the HPU)."""
    if importlib.util.find_spec("vllm_gaudi") is None:
        return "vllm-gaudi is not installed (vLLM cannot run on Gaudi without it): install it next to this package"
    want = required_vllm_plugins()
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is None:
        return (f"VLLM_PLUGINS is unset, so vllm-gaudi's platform plugin {VLLM_GAUDI_PLATFORM_PLUGIN!r} loads too "
                f"and vLLM accepts one platform plugin: set VLLM_PLUGINS={want}")
    names = [n.strip() for n in allowed.split(",") if n.strip()]
    if VLLM_GAUDI_PLATFORM_PLUGIN in names:
        return (f"VLLM_PLUGINS={allowed} names vllm-gaudi's platform plugin {VLLM_GAUDI_PLATFORM_PLUGIN!r} and vLLM "
                f"accepts one platform plugin: set VLLM_PLUGINS={want}")
    missing = [n for n in (PLUGIN_NAME, VLLM_GAUDI_OPS_PLUGIN) if n not in names]
    if missing:
        return f"VLLM_PLUGINS={allowed} leaves out {','.join(missing)}: set VLLM_PLUGINS={want}"
    return None


def missing_optional_plugins(environ) -> list[str]:
    """vllm-gaudi's general plugins other than its ops that VLLM_PLUGINS leaves out (features of vllm-gaudi
    that are then off: model variants, tool parsers, utilities)."""
    names = [n.strip() for n in environ.get("VLLM_PLUGINS", "").split(",")]
    return [n for n in vllm_gaudi_general_plugins() if n not in names]


def decide(environ=None) -> Decision:
    """What this process does (cases 1-6 above)."""
    env = os.environ if environ is None else environ
    cfg = PluginConfig.from_env(env)
    if cfg.enable is False:
        return Decision(None, None)
    if hpu_present():
        problem = takeover_problem(env)
        if problem is None:
            return Decision(HPU_PLATFORM, "hpu", note=None)
        if cfg.enable:
            return Decision(None, None, error=f"{ENV_ENABLE}=1 asks for unified attention on Gaudi, but {problem}. "
                                              f"(Or set {ENV_ENABLE}=0 to run vllm-gaudi's own attention.)")
        return Decision(None, None, note=problem)
    if cfg.enable:
        return Decision(CPU_PLATFORM, "cpu")
    return Decision(None, None)


def is_active() -> bool:
    """Whether this process runs with the unified backend (cases 2 and 5 above)."""
    return decide().backend is not None


def platform_plugin() -> str | None:
    """vLLM's platform plugin hook: the qualified name of the platform class to use, or None."""
    decision = decide()
    if decision.platform == HPU_PLATFORM:
        import vllm_gaudi

        vllm_gaudi.register()  # vllm-gaudi's per-process set-up, which its (left out) platform plugin would have run
    return decision.platform


def general_plugin() -> None:
    """vLLM's general plugin hook: register the backend in vLLM's attention backend registry when the
    plugin is on; fail the start-up in case 3; say which attention runs in case 4.

    Does nothing else when the plugin is off, so an installed-but-unasked plugin leaves the
    registry as it was. Safe to call more than once per process.
    """
    decision = decide()
    if decision.error:
        raise RuntimeError(decision.error)
    if decision.note:
        from vllm_gaudi_unified.log import get_logger

        get_logger("vllm.gaudi_unified.entry").info(
            "Unified attention is off (%s); vllm-gaudi's own attention runs.", decision.note)
    if decision.backend == "cpu":
        from vllm_gaudi_unified.vllm_plugin.backend import register_backend

        register_backend()
    elif decision.backend == "hpu":
        from vllm_gaudi_unified.vllm_plugin.hpu_backend import register_hpu_backend

        register_hpu_backend()
        missing = missing_optional_plugins(os.environ)
        if missing:
            from vllm_gaudi_unified.log import get_logger

            get_logger("vllm.gaudi_unified.entry").warning(
                "VLLM_PLUGINS leaves out vllm-gaudi's %s: those vllm-gaudi features are off (VLLM_PLUGINS=%s "
                "loads them all)", ",".join(missing), required_vllm_plugins())
