"""Hybrid models (attention beside Mamba / GatedDeltaNet layers) on the Gaudi path: refused at start-up.

vllm-gaudi's Mamba2 op (`ops/hpu_mamba_mixer2.py`) reads one batch metadata object of its own from the forward
context (`load_indices_tensor`, `store_indices_tensor`, `padding_mask_flat`, `last_chunk_indices_p`, ...): its
runner runs decodes apart from prompts and pads each prompt to whole Mamba chunks (one prompt per batch under
prefix caching). The unified runner's one flat step gives the layers vLLM's per-layer dict, and the op failed
deep inside (`'dict' object has no attribute 'load_indices_tensor'`); it now stops at start-up with the reason.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from test_vllm_gaudi import gaudi  # noqa: F401 (also: the module's skips)

pytestmark = pytest.mark.vllm


def test_hybrid_models_are_refused_on_gaudi(gaudi):
    """Mamba / linear-attention layers (hybrid or attention-free) stop the start-up naming the model; an
    attention-only model passes."""
    from vllm_gaudi_unified.vllm_plugin.hpu_platform import refuse_unserved_models

    def config(**kw):
        model = SimpleNamespace(is_multimodal_model=False, use_mla=False, hf_text_config=SimpleNamespace(),
                                architecture="GraniteMoeHybridForCausalLM", **kw)
        return SimpleNamespace(model_config=model, lora_config=None)

    refuse_unserved_models(config(is_hybrid=False, is_attention_free=False))
    for kw in (dict(is_hybrid=True, is_attention_free=False), dict(is_hybrid=False, is_attention_free=True)):
        with pytest.raises(NotImplementedError, match=r"Mamba / linear-attention layers \(GraniteMoeHybridForCausalLM: "
                                                      "vllm-gaudi's Mamba2"):
            refuse_unserved_models(config(**kw))
