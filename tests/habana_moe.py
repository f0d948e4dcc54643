"""The stand-in's `torch.ops.hpu.mixture_of_experts`: Gaudi's fused MoE kernel as torch arithmetic on the CPU.

vllm-gaudi's unquantized MoE layer (`VllmMixtureOfExpertsOp`) hands the kernel every token's routing
(`expert_routing_table` [T, k] expert ids, `router_weights` [T, k]) and one weight pair per local expert:
`w12[e]` the stacked gate and up projections [2I, H], `w3[e]` the down projection [H, I] (vLLM's own
`[out, in]` layout: `permuted_weights=True`). Experts `experts_min..experts_max` are this rank's; a route to
another expert adds nothing. Each token's output is `sum_j router_weights[t, j] * down(act(gate(x)) * up(x))`
over its routes. `chunk_size` and `total_experts` only tune the real kernel's tiling. The activations vLLM's
MoE models use: silu, and gelu in the kernel's tanh form. Biased experts (the kernel's `bias_fused_weights`)
and other activations are not stood in for: such a call fails naming the op.

vLLM's own MoE layer forward (`MoERunner.forward`, which the unified runner keeps beside vLLM 0.32:
`vllm_plugin/hpu_moe.py`) goes through vLLM's custom ops `vllm::moe_forward` / `vllm::moe_forward_shared`,
registered for the platform's dispatch key (vllm-gaudi's: HPU); the stand-in's tensors are CPU tensors, so
`vllm_moe_ops_on_cpu` gives the same functions of vLLM's to the CPU key too (in an engine's process: importing
vLLM's MoE runner settles vLLM's platform).
"""
from __future__ import annotations

import torch

ACTIVATIONS = {"silu": torch.nn.functional.silu,
               "gelu": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}

SCHEMA = ("mixture_of_experts(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, "
          "Tensor[] w12, Tensor[] w3, bool permuted_weights=True, str activation='silu', int experts_min=0, "
          "int experts_max=7, int? chunk_size=None, int? total_experts=None) -> Tensor")

_LIBRARY = None  #: kept alive: the op is registered for the rest of the process (torch has no unregister)


def mixture_of_experts(hidden_states, expert_routing_table, router_weights, w12, w3, permuted_weights=True,
                       activation="silu", experts_min=0, experts_max=7, chunk_size=None, total_experts=None):
    if not permuted_weights or activation not in ACTIVATIONS:
        raise NotImplementedError(f"hpu::mixture_of_experts stand-in: permuted_weights={permuted_weights}, "
                                  f"activation={activation!r} (it runs permuted weights with {sorted(ACTIVATIONS)})")
    if len(w12) != experts_max - experts_min + 1 or len(w3) != len(w12):
        raise ValueError(f"hpu::mixture_of_experts: {len(w12)} / {len(w3)} expert weights for experts "
                         f"{experts_min}..{experts_max}")
    act = ACTIVATIONS[activation]
    out = torch.zeros_like(hidden_states)
    for local, (gate_up, down) in enumerate(zip(w12, w3)):  # per expert: its routed tokens at once
        rows, slot = (expert_routing_table == experts_min + local).nonzero(as_tuple=True)
        if rows.numel():
            gate, up = (hidden_states[rows] @ gate_up.t()).chunk(2, dim=-1)
            y = (act(gate) * up) @ down.t()
            out.index_add_(0, rows, y * router_weights[rows, slot, None].to(y.dtype))
    return out


def register() -> None:
    """Define `torch.ops.hpu.mixture_of_experts` once per process (unless something already did)."""
    global _LIBRARY
    if _LIBRARY is not None or hasattr(torch.ops.hpu, "mixture_of_experts"):
        return
    library = torch.library.Library("hpu", "FRAGMENT")
    library.define(SCHEMA)
    library.impl("mixture_of_experts", mixture_of_experts, "CompositeExplicitAutograd")
    _LIBRARY = library


def vllm_moe_ops_on_cpu() -> None:
    """vLLM's MoE layer ops (registered for vllm-gaudi's HPU key) for CPU tensors too."""
    from vllm.model_executor.layers.fused_moe.runner import moe_runner
    from vllm.utils.torch_utils import vllm_lib

    for name, func in (("moe_forward", moe_runner._moe_forward), ("moe_forward_shared", moe_runner._moe_forward_shared)):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm::{name}", "CPU"):
            vllm_lib.impl(name, func, dispatch_key="CPU")
