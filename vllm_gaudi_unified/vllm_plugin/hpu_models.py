"""vllm-gaudi's fixes to vLLM models that the runner's `[1, T]` inputs need, loaded without its model plugin.

vllm-gaudi feeds a model `input_ids` and `positions` shaped `[batch, seq]` (the unified runner: `[1, T]`),
and some of vLLM's models read `positions.shape[0]` as the step's token count. DeepSeek-V2/V3's model
takes the tensor-parallel all-gather branch whenever its hidden states (flattened to `[T, hidden]` by
a layer) have another first size than the positions, and crashes there on the first step of more than
one token (`torch.cat` of 2-D and 3-D tensors). vllm-gaudi replaces that forward in its
`03.hpu_custom_models` plugin, which also imports every multimodal model it serves (torchvision among
them), so a set-up that leaves the plugin out (or cannot import it) ran vLLM's forward. The modules here
carry vllm-gaudi's fix alone and import nothing else; importing one again is a no-op.
"""
from __future__ import annotations

import importlib

#: vLLM's model module -> vllm-gaudi's module that patches it for `[batch, seq]` inputs on import.
SHAPE_FIXES = {"vllm.model_executor.models.deepseek_v2": "vllm_gaudi.models.deepseek_v2"}


def model_modules(architectures) -> set[str]:
    """The vLLM modules `architectures` resolve to in vLLM's model registry (lazily: nothing imported)."""
    from vllm.model_executor.models.registry import ModelRegistry

    modules = set()
    for arch in architectures or ():
        model = ModelRegistry.models.get(arch)
        module = getattr(model, "module_name", None) or getattr(getattr(model, "model_cls", None), "__module__", None)
        if module:
            modules.add(module)
    return modules


def load_shape_fixes(model_config) -> list[str]:
    """Import vllm-gaudi's fixes for the model's vLLM modules (before the model is built); returns their names."""
    fixes = sorted(SHAPE_FIXES[m] for m in model_modules(model_config.architectures) if m in SHAPE_FIXES)
    for name in fixes:
        importlib.import_module(name)
    return fixes
