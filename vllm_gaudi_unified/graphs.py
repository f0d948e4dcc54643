"""Compiled `unified_attention`, one compiled function per bucket.

The stand-in for Gaudi's graph compiler on other devices: the same torch code,
handed to `torch.compile` with static shapes. A bucket fixes every shape of a
step, so each bucket gets its own compiled function (and, where the caller
captures one, its own CUDA graph). Dynamo caches compiled code per code
object and falls back to eager past a few recompiles, so each bucket compiles
a private copy of `run_step` (`attend_step`'s work; the checks run outside it): a server
with many buckets keeps one compiled entry per bucket, and every step padded to
a bucket runs it with no recompile. Nothing here changes what is computed.
"""
from __future__ import annotations

import types
from typing import Callable

import torch

from vllm_gaudi_unified import attention
from vllm_gaudi_unified.attention import checked_step, run_step
from vllm_gaudi_unified.paths import fused, prompts

_COMPILED: dict[tuple, Callable] = {}


def bucket_key(batch, query: torch.Tensor, key_cache: torch.Tensor, **kwargs) -> tuple:
    """Everything that changes the compiled code: bucket, plan options, layout, dtypes (an fp8 cache
    included), shapes, device, the route and the prompt route's form (`prompts.SPLIT_CONTEXT`,
    `attention.PROMPT_FLASH`, and on CUDA the plan's `prompt_ragged`; off a Gaudi its `prompt_full`), whether
    a latent route takes the drafts' causal pairs (`drafts_in_units`), which keyword arguments are given."""
    return (batch.bucket, tuple(p.bucket for p in getattr(batch, "pieces", ())), batch.plan.options,
            batch.block_size, batch.sliding_window, batch.unique_layout, batch.plan.shared_prefix_visible,
            getattr(batch.plan, "prompts_only", False), getattr(batch.plan, "prompt_grid", False),
            getattr(batch.plan, "drafts_in_units", False), fused.CUDA_KERNELS,
            prompts.SPLIT_CONTEXT, attention.PROMPT_FLASH,
            fused.CUDA_KERNELS and query.device.type == "cuda" and getattr(batch.plan, "prompt_ragged", False),
            prompts.causal_selects(query) and getattr(batch.plan, "prompt_full", False),
            query.dtype, key_cache.dtype, tuple(query.shape[1:]), tuple(key_cache.shape), str(query.device),
            tuple(sorted((k, v is None) for k, v in kwargs.items())))


def compiled_attention(query, key, value, key_cache, value_cache, batch, scale, *, backend=None,
                       **kwargs) -> torch.Tensor:
    """`unified_attention` through the compiled function of this batch's bucket (compiled on first use), by
    `torch.compile`'s `backend` (default its own; a Gaudi in torch.compile mode: `"hpu_backend"`).

    The checks and the padding to the bucket's rows run here, eagerly; only `run_step` (`attend_step`'s
    work) is compiled. Compiled, the checks would read the step's own sizes (its token count, its largest
    block id), and dynamo guards every value it reads: each new step of a bucket would compile again, and
    past a few the bucket would fall back to eager."""
    q, k, v = checked_step(query, key, value, key_cache, value_cache, batch, scale,
                           *(kwargs.get(k) for k in ("logits_soft_cap", "sinks", "k_scale", "v_scale")))
    graph_key = (bucket_key(batch, q, key_cache, **kwargs), backend)
    fn = _COMPILED.get(graph_key)
    if fn is None:
        private = types.FunctionType(run_step.__code__.replace(), run_step.__globals__, "run_step",
                                     run_step.__defaults__, run_step.__closure__)
        private.__kwdefaults__ = run_step.__kwdefaults__
        fn = _COMPILED[graph_key] = torch.compile(private, dynamic=False,
                                                  **({} if backend is None else {"backend": backend}))
    if torch.is_inference_mode_enabled():
        # (dynamo builds its guards on the plan's numpy arrays, which the graph reads as tensors, outside
        # inference mode and checks them inside it: a dispatch-key mismatch it reports as its own bug; torch 2.13)
        with torch.inference_mode(False), torch.no_grad():
            return fn(q, k, v, key_cache, value_cache, batch, scale, **kwargs)[:query.shape[0]]
    return fn(q, k, v, key_cache, value_cache, batch, scale, **kwargs)[:query.shape[0]]


def clear() -> None:
    """Forget every compiled bucket (tests, benchmarks between configurations)."""
    _COMPILED.clear()
