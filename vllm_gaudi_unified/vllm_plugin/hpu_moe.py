"""vllm-gaudi's fused-MoE layer beside the vLLM it runs with: three version gaps bridged before a model is built.

vllm-gaudi's ops plugin (`02.hpu_custom_ops`: `vllm_gaudi/ops/hpu_fused_moe.py`) replaces pieces of vLLM's
MoE layer. At vllm-gaudi 091bbadd (written against vLLM main of 2026-08-21) they fail beside vLLM 0.32, so
every MoE model (Mixtral, Qwen3-MoE, DeepSeek-V2/V3 with experts) failed to build or to run:

- its `create_fused_moe_router` lacks three keywords vLLM 0.32's `FusedMoEFactory` passes for every MoE layer:
  `skip_padding` (grouped routing with DeepEP v2 kernels, CUDA only), `bias_vl` and `image_sentinel_lo`
  (DeepSeek-V4's routing bias for image tokens): `TypeError: ... unexpected keyword argument 'skip_padding'`.
  `adapt_router_factory` drops such a keyword when it holds the value that leaves routing unchanged
  (`NEUTRAL`, what every such layer on Gaudi passes) and refuses any other value, naming it;
- its `MoERunner.forward` fast path (on by default, `HPU_FUSED_MOE=1`) calls runner methods of a later vLLM
  (`FAST_PATH_CALLS`; 0.32 has `SharedExperts.maybe_forward_async` instead):
  `AttributeError: 'MoERunner' object has no attribute '_maybe_sync_shared_experts_stream'` on the first
  forward. Where vLLM's runner lacks one, `keep_vllm_moe_forward` takes vllm-gaudi's own fallback, as
  `HPU_FUSED_MOE=0` does (read at its import, so its flag is set): vLLM's `MoERunner.forward`, which still
  routes and runs the experts through vllm-gaudi's MoE method and its fused kernel;
- its grouped / custom routing (DeepSeek-V2/V3) imports `select_experts` from vLLM's `experts.cpu_moe`, which
  0.32 moved to `router.cpu_router` (same keywords): `ImportError` on the first forward. `bridge_select_experts`
  gives `cpu_moe` 0.32's function under the old name where it lacks one.

Nothing changes where vllm-gaudi and vLLM agree (a vllm-gaudi that has caught up, or a vLLM it was written for).
"""
from __future__ import annotations

import functools
import inspect

#: vLLM 0.32 router keywords vllm-gaudi 091bbadd's factory lacks -> the value that leaves routing unchanged.
NEUTRAL = {"skip_padding": False, "bias_vl": None, "image_sentinel_lo": 0}
#: `MoERunner` methods vllm-gaudi's fast MoE forward calls that vLLM 0.32's runner lacks.
FAST_PATH_CALLS = ("_maybe_sync_shared_experts_stream",)


def _missing_keywords(factory) -> list[str]:
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [k for k in NEUTRAL if k not in params]


def adapt_router_factory(factory):
    """`factory` taking vLLM 0.32's router keywords (see the module doc), or `factory` itself if it already does."""
    missing = _missing_keywords(factory)
    if not missing:
        return factory

    @functools.wraps(factory)
    def create_fused_moe_router(*args, **kwargs):
        for name in missing:
            if name in kwargs:
                value, off = kwargs.pop(name), NEUTRAL[name]
                if not (value is None if off is None else value == off):
                    raise NotImplementedError(
                        f"MoE routing with {name}={value!r}: vllm-gaudi's router factory ({factory.__module__}) has "
                        f"no {name!r} (vLLM 0.32 passes it); unified attention on Gaudi serves MoE layers with "
                        f"{name}={off!r} only")
        return factory(*args, **kwargs)

    create_fused_moe_router.adapted_keywords = tuple(missing)
    return create_fused_moe_router


def keep_vllm_moe_forward(runner_cls, gaudi_moe) -> list[str]:
    """Turn `gaudi_moe`'s (vllm-gaudi's `hpu_fused_moe` module) fast forward off if `runner_cls` (vLLM's
    `MoERunner`) lacks a method it calls; returns the missing methods."""
    missing = [m for m in FAST_PATH_CALLS if not hasattr(runner_cls, m)]
    if missing and not hasattr(gaudi_moe, "_MOE_COMPILE"):
        raise RuntimeError(f"vLLM's MoERunner lacks {', '.join(missing)}, which vllm-gaudi's fast MoE forward calls, "
                           f"and {gaudi_moe.__name__} has no _MOE_COMPILE flag (HPU_FUSED_MOE) to turn it off")
    if missing:
        gaudi_moe._MOE_COMPILE = False  # vllm-gaudi's HPU_FUSED_MOE=0
    return missing


def bridge_select_experts(cpu_moe, cpu_router) -> bool:
    """`cpu_moe.select_experts` (where vllm-gaudi imports it from) as `cpu_router`'s, if `cpu_moe` lacks it;
    whether that bridge is in place (set now or by an earlier call: a vLLM with both is left alone)."""
    if not hasattr(cpu_moe, "select_experts") and hasattr(cpu_router, "select_experts"):
        cpu_moe.select_experts = cpu_router.select_experts
        cpu_moe.select_experts_bridged = True
    return getattr(cpu_moe, "select_experts_bridged", False)


def adapt_vllm_gaudi_moe() -> list[str]:
    """Bridge the gaps (see the module doc) before a model is built; returns what was adapted, for the log."""
    import vllm_gaudi.ops.hpu_fused_moe as gaudi_moe
    from vllm.model_executor.layers.fused_moe import layer
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    factory = layer.create_fused_moe_router
    if not hasattr(factory, "adapted_keywords"):
        factory = layer.create_fused_moe_router = adapt_router_factory(factory)
    adapted = [f"router keyword {k}" for k in getattr(factory, "adapted_keywords", ())]
    missing = keep_vllm_moe_forward(MoERunner, gaudi_moe)
    adapted += [f"vLLM's MoERunner.forward (no {', '.join(missing)})"] if missing else []
    try:  # vLLM 0.32's layout; in another, vllm-gaudi's own import stands as it is
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.model_executor.layers.fused_moe.router import cpu_router
    except ImportError:
        return adapted
    return adapted + (["select_experts from router.cpu_router"] if bridge_select_experts(cpu_moe, cpu_router) else [])
