"""On Gaudi: vllm-gaudi's platform, with the unified worker, model runner and backend.

vLLM has no Gaudi platform of its own; vllm-gaudi provides it. This subclass of
its `HpuPlatform` points vLLM at `UnifiedHpuWorker` (which builds
`UnifiedHpuModelRunner`) and at `UnifiedHpuAttentionBackend`; everything else
is vllm-gaudi's. `entry.platform_plugin` names it only where an HPU (or the
tests' stand-in for one) and vllm-gaudi are present.

Start-up refuses, with the reason, what the unified runner does not do:
multimodal models that take raw inputs or prune video tokens (`hpu_multimodal.refused_multimodal`),
sparse (DSA) MLA models and attention-free models (`refuse_unserved_models`; a hybrid's state layers other than
Mamba2 stop the runner's start-up, `hpu_mamba.state_layer_names`), speculative decoding other than ngram and EAGLE / EAGLE3 (whose drafter runs unified batches, `hpu_eagle.py`), a vllm-gaudi whose
overridden methods differ from the ones checked
(`check_vllm_gaudi_hooks`). fp8 KV caches (e4m3: fp8 / fp8_e4m3 / fp8_inc)
are the backend's to accept (`hpu_backend.py`). Async scheduling runs as vllm-gaudi
runs it (the runner takes the previous step's samples on the device), except under
speculative decoding, which vllm-gaudi's runner does not combine with it.
"""
from __future__ import annotations

import importlib
import inspect

from vllm_gaudi.platform import HpuPlatform

from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.vllm_plugin.hpu_eagle import EAGLE_METHODS
from vllm_gaudi_unified.vllm_plugin.hpu_multimodal import refused_multimodal
from vllm_gaudi_unified.vllm_plugin.platform import select_unified_backend

logger = get_logger("vllm.gaudi_unified.hpu_platform")

HPU_WORKER = "vllm_gaudi.v1.worker.hpu_worker.HPUWorker"
UNIFIED_HPU_WORKER = "vllm_gaudi_unified.vllm_plugin.hpu_worker.UnifiedHpuWorker"

#: The vllm-gaudi snapshot the overrides were written against (`../shared/third_party/`).
CHECKED_VLLM_GAUDI = "091bbadd (2026-08-21; tracks vLLM main of that date, newest tag v0.26.0)"

#: vllm-gaudi methods the unified classes override or call, with their parameters (without self) as
#: checked. A vllm-gaudi whose methods differ refuses to start rather than run a mismatched override.
VLLM_GAUDI_HOOKS = {
    "vllm_gaudi.v1.worker.hpu_model_runner.HPUModelRunner": {
        "__init__": ["vllm_config", "device", "is_driver_worker"],
        "load_model": [],
        "initialize_kv_cache": ["kv_cache_config"],
        "warmup_model": [],
        "execute_model": ["scheduler_output", "warmup_mode"],
        "run_defragmenter": ["scheduler_output", "warmup_mode"],
        "_update_states": ["scheduler_output"],
        "_get_prompts_and_decodes": ["scheduler_output"],
        "_prepare_inputs": ["scheduler_output", "num_prefills", "num_decodes", "warmup"],
        "_execute_model_generic": ["token_ids", "position_ids", "attn_metadata", "logits_indices", "kv_caches",
                                   "lora_logits_mask", "lora_mask", "warmup_mode", "inputs_embeds",
                                   "model_mm_kwargs"],
        "sample_tokens": ["grammar_output"],
        "_run_sampling": ["batch_changed", "logits_device", "request_ids", "pad_to", "logits_requests"],
        "propose_ngram_draft_token_ids": ["sampled_token_ids"],
        "_configure_lora": ["input", "requests", "req_ids", "is_prompt"],
        "_get_model_mm_inputs": ["token_ids", "total_num_scheduled_tokens", "scheduler_output", "req_ids"],
        "set_active_loras": ["lora_requests", "lora_mapping"],
        "_get_prompt_logprobs_dict": ["prefill_hidden_states", "scheduler_output"],
        "propose_draft_token_ids": ["scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                                    "sample_hidden_states", "aux_hidden_states", "prefill_sampled_token_ids_tensor",
                                    "decode_sampled_token_ids_tensor", "hidden_states_prefills",
                                    "sample_hidden_states_prefills", "aux_hidden_states_prefills", "num_decodes",
                                    "prefill_data", "decode_data"],
    },
    "vllm_gaudi.v1.worker.hpu_model_runner.HPUAttentionMetadataProcessor": {
        "process_metadata": ["attn_metadata", "batch_size", "seq_len", "device", "dtype",
                             "model_has_chunked_attention"],
    },
    "vllm_gaudi.v1.worker.hpu_model_runner.PrefillInputData": {
        "__init__": ["request_ids", "prompt_lens", "token_ids", "position_ids", "attn_metadata", "logits_indices",
                     "logits_requests"],
    },
    "vllm_gaudi.v1.worker.hpu_model_runner.DecodeInputData": {
        "__init__": ["num_decodes", "token_ids", "position_ids", "attn_metadata", "logits_indices",
                     "spec_decode_metadata"],
    },
    "vllm_gaudi.v1.worker.hpu_model_runner.PromptDecodeInfo": {
        "__init__": ["prompt_req_ids", "decode_req_ids", "prompt_scheduled_tokens"],
    },
    "vllm_gaudi.v1.worker.hpu_worker.HPUWorker": {
        "init_device": [],
        "load_model": ["vllm_config", "quant_config_path"],
    },
    "vllm_gaudi.attention.backends.hpu_attn.HPUAttentionBackend": {
        "get_kv_cache_shape": ["num_blocks", "block_size", "num_kv_heads", "head_size"],
    },
}


def check_vllm_gaudi_hooks() -> None:
    """Raise if the installed vllm-gaudi's overridden methods are not the ones checked."""
    problems = []
    for qualname, methods in VLLM_GAUDI_HOOKS.items():
        module, _, name = qualname.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None)
        if cls is None:
            problems.append(f"{qualname} is missing")
            continue
        for method, expected in methods.items():
            fn = getattr(cls, method, None)
            if fn is None:
                problems.append(f"{name}.{method} is missing")
                continue
            params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
            if params != expected:
                problems.append(f"{name}.{method}{tuple(params)} (checked: {tuple(expected)})")
    if problems:
        raise RuntimeError("The installed vllm-gaudi differs from the one unified attention was checked against ("
                           f"{CHECKED_VLLM_GAUDI}): " + "; ".join(problems) + ". Install that vllm-gaudi, or set "
                           "VLLM_GAUDI_UNIFIED=0 to run vllm-gaudi's own attention.")


def refuse_unserved_models(vllm_config) -> None:
    """Start-up errors, naming the model feature, for what vllm-gaudi serves and the unified runner not yet."""
    model = vllm_config.model_config
    problems = []
    if model is not None and model.is_multimodal_model and (why := refused_multimodal(model)):
        problems.append(f"multimodal inputs ({why})")
    topk = getattr(getattr(model, "hf_text_config", None), "index_topk", None) if model is not None else None
    if model is not None and model.use_mla and topk is not None:
        problems.append(f"sparse (DSA) MLA layers (index_topk {topk}: vllm-gaudi builds them as dense MLA, exact "
                        "only while a sequence has no more than index_topk tokens)")
    if model is not None and getattr(model, "is_attention_free", False):
        problems.append(f"attention-free models ({model.architecture}: the unified runner plans its steps for "
                        "attention layers; hybrids of attention and Mamba2 layers are served)")
    if problems:
        raise NotImplementedError("Unified attention on Gaudi does not serve " + "; ".join(problems) + ". Unset "
                                  "VLLM_GAUDI_UNIFIED (or set it to 0) to use vllm-gaudi's own attention.")


class UnifiedHpuPlatform(HpuPlatform):
    """vllm-gaudi's `HpuPlatform` with the unified worker (and so model runner) and attention backend."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        check_vllm_gaudi_hooks()
        parallel = vllm_config.parallel_config
        if parallel.worker_cls in ("auto", HPU_WORKER):
            parallel.worker_cls = UNIFIED_HPU_WORKER
        elif parallel.worker_cls != UNIFIED_HPU_WORKER:
            raise ValueError(f"worker_cls={parallel.worker_cls!r}: unified attention on Gaudi needs its own worker "
                             f"({UNIFIED_HPU_WORKER}); leave worker_cls unset")
        spec = vllm_config.speculative_config
        if spec is not None and spec.method not in ("ngram", *EAGLE_METHODS):
            raise NotImplementedError(f"speculative decoding method {spec.method!r} is not supported with unified "
                                      "attention on Gaudi (ngram, eagle and eagle3 are: vllm-gaudi's runner serves "
                                      "no other drafter). Use one of those, or unset VLLM_GAUDI_UNIFIED (or set it "
                                      "to 0) to use vllm-gaudi's own attention.")
        refuse_unserved_models(vllm_config)
        sched = vllm_config.scheduler_config
        if sched.async_scheduling and spec is not None:
            sched.async_scheduling = False  # vllm-gaudi's runner asserts it (its ngram path samples on the host)
            logger.info("Unified attention: async scheduling off under speculative decoding (vllm-gaudi's runner "
                        "does not combine them)")

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuAttentionBackend, register_hpu_backend

        if attn_selector_config.use_mla:  # latent caches in vllm-gaudi's MLA layout (hpu_mla.py)
            from vllm_gaudi_unified.vllm_plugin.hpu_mla import UnifiedHpuMLABackend, register_hpu_mla_backend

            register_hpu_mla_backend()
            return select_unified_backend(attn_selector_config, UnifiedHpuMLABackend,
                                          where="vllm-gaudi's MLA layer, one unified batch per step in latent space")
        register_hpu_backend()
        return select_unified_backend(attn_selector_config, UnifiedHpuAttentionBackend,
                                      where="vllm-gaudi's model runner, one unified batch per step")
