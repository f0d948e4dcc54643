"""Gaudi dispatch: the Gaudi kernels the paths use, and when.

The three paths are plain torch and run on HPU as they are (the graph compiler
fuses them per bucket). Two pieces have dedicated Gaudi kernels:

* the partial softmax of a score tile: `torch.ops.hpu.softmax_fa2` returns the
  probabilities together with the row max and sum that a `Partial` needs;
* a whole masked tile (the causal and shared tiles, bf16/fp16): FusedSDPA's
  forward with statistics, `torch.ops.hpu.sdpa_recomp_fwd(..., requires_backward=True)`,
  returns the output with each row's max `m` and inverse sum `linv`, the
  call vllm-gaudi's sliced FusedSDPA merges its chunks with; as a `Partial`:
  acc = out / linv, max = m, sum = 1 / linv (`paths/fused.py`: `sdpa_attend`;
  `select_fused_sdpa` here says when). Plain FusedSDPA returns only the
  normalised output, which cannot be merged.

`habana_frameworks` is imported lazily, only when a tensor is on an HPU device.
None of this can run on the project's machines (no Gaudi): the selection logic
is tested, the HPU kernel call is not.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch


@functools.lru_cache(maxsize=1)
def habana_importable() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def select_softmax(device_type: str, dtype: torch.dtype, importable: bool | None = None) -> str:
    """Which masked-softmax implementation runs; all conditions live here.

    1. Not an HPU tensor: the torch implementation.
    2. HPU but `habana_frameworks` cannot be imported: torch (the bridge is missing; torch ops still fail loudly).
    3. HPU with scores in fp32/fp64: torch (softmax_fa2 takes bf16 scores).
    4. Otherwise Gaudi's fused `softmax_fa2`.
    """
    if device_type != "hpu":  # first, so CPU/CUDA graphs never trace the import probe
        return "torch"
    if not (habana_importable() if importable is None else importable):
        return "torch"
    if dtype != torch.bfloat16:
        return "torch"
    return "hpu"


def select_fused_sdpa(device_type: str, dtype: torch.dtype, importable: bool | None = None) -> bool:
    """Whether the causal and shared tiles run through FusedSDPA with statistics (`paths.fused.sdpa_attend`):
    an HPU tensor, habana_frameworks importable, 16-bit floats (the kernel's inputs). The caller
    (`paths/fused.py`) has already ruled out a soft cap and `PlanOptions.fused_kernels=False`."""
    if device_type != "hpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return habana_importable() if importable is None else importable


def masked_softmax_torch(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores with -inf at masked keys -> (e^(s - max), max, sum) over the last dim; -inf max for empty rows."""
    m = scores.amax(-1)
    p = torch.exp(scores - torch.where(m > float("-inf"), m, 0.0)[..., None])
    return p, m, p.sum(-1)


def masked_softmax_hpu(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover
    """Gaudi's fused partial softmax; the initial max/sum are the empty partial (-inf, 0)."""
    import habana_frameworks.torch  # noqa: F401  (registers torch.ops.hpu)

    shape = scores.shape[:-1]
    init_max = torch.full(shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    init_sum = torch.zeros(shape, dtype=scores.dtype, device=scores.device)
    p, m, s, _ = torch.ops.hpu.softmax_fa2(scores, inputM=init_max, inputL=init_sum)
    return p, m.reshape(shape).float(), s.reshape(shape).float()


def masked_softmax_for(scores: torch.Tensor) -> Callable:
    return masked_softmax_hpu if select_softmax(scores.device.type, scores.dtype) == "hpu" else masked_softmax_torch


def sdpa_final(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """The prompt route's one fused call (`paths/prompts.py`): q `[B, Hq, S, D]`, k/v `[B, Hkv, K, D]`,
    `mask` `[B, 1, S, K]` bool (True = visible), or already the additive bias in q's dtype (the step's,
    `UnifiedBatch.prompt_bias`), or None = causal (top-left: prompts without context).
    Returns the normalised rows `[B, Hq, S, D]`.

    The mask goes in as an additive bias (0 / -inf in q's dtype) and GQA natively, as vllm-gaudi calls
    it: on a Gaudi FusedSDPA, elsewhere torch SDPA (on CUDA: flash for the causal case, the
    memory-efficient or cuDNN kernel with a bias)."""
    bias = mask
    if mask is not None and not mask.is_floating_point():
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if q.device.type == "hpu" and habana_importable():  # pragma: no cover - needs a Gaudi
        from habana_frameworks.torch.hpex.kernels import FusedSDPA

        return FusedSDPA.apply(q, k, v, bias, 0.0, mask is None, scale, "None", False, None, "left")
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=mask is None,
                                                            scale=scale, enable_gqa=k.shape[1] != q.shape[1])
