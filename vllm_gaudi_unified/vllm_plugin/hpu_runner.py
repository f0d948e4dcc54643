"""vllm-gaudi's model runner, planning every step as one unified batch.

vllm-gaudi's `HPUModelRunner` splits a step into a decode forward and prefill
forwards and builds its own `HPUAttentionMetadataV1` for each; it never calls a
backend's metadata builder. The subclass keeps everything else of it (request
state, input batch, sampling, logprobs, outputs, KV cache allocation,
defragmenter) and replaces the step's forward plan:

- `_get_prompts_and_decodes`: every scheduled request goes in the one batch (the
  "prompt" list of vllm-gaudi's sampling code; no separate decode forward). Under
  speculative decoding (ngram) vllm-gaudi's own decode list is kept for sampling, since
  it verifies drafts there (`hpu_spec.py`); the forward is still the one batch;
- `_prepare_inputs`: the step from the runner's own input batch (computed tokens,
  scheduled tokens, block table per KV cache group) -> `build_unified_batch` with the
  bucket plan, exactly as the CPU path's metadata builder plans it
  (`backend.GaudiUnifiedMetadataBuilder`), or in parts (`hpu_parts.py`); model inputs `[1, T]`, padded;
- `_execute_model_generic`: runs vllm-gaudi's model adapter with that metadata, which
  its metadata processor lets through (`hpu_backend.UnifiedMetadataProcessor`, set by
  `load_model`), and computes the logits of the requests that sample;
- `warmup_model` (`hpu_warmup.py`): the bucket plan's buckets through the whole model on the real KV caches (HPU graphs
  in lazy mode), instead of vllm-gaudi's prompt/decode buckets;
- `initialize_kv_cache`: one `StepHooks` per KV cache group, its layers by attention kind (`hpu_kinds.py`;
  an encoder-only group, which has no block table, plans bidirectional steps);
- `_configure_lora`, `_get_prompt_logprobs_dict`: LoRA adapters per token of the flat step (`hpu_lora.py`);
- `_get_model_mm_inputs`, M-RoPE positions in `step_inputs`: images of multimodal models as the flat step's
  `inputs_embeds` (`hpu_multimodal.py`);
- hybrids: each Mamba2 layer runs vllm-gaudi's op over the step's decodes and each prompt apart (`hpu_mamba.py`).

vllm-gaudi's `sample_tokens` then samples and returns outputs as it always does:
the unified batch is its single prefill batch.
"""
from __future__ import annotations

import habana_frameworks.torch as htorch
import numpy as np
import torch
from vllm.v1.kv_cache_interface import MambaSpec
from vllm_gaudi.extension.ops import LoraMask
from vllm_gaudi.v1.worker.hpu_model_runner import (
    DecodeInputData,
    HpuModelAdapter,
    HPUModelRunner,
    PrefillInputData,
    PromptDecodeInfo,
)

from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.vllm_plugin.backend import refuse_unsupported_config
from vllm_gaudi_unified.vllm_plugin.config import PluginConfig
from vllm_gaudi_unified.vllm_plugin.hpu_backend import (
    UnifiedHpuMetadata,
    UnifiedMetadataProcessor,
    is_unified_metadata,
)
from vllm_gaudi_unified.vllm_plugin.hpu_eagle import EAGLE_METHODS, drafter_adapter, propose_eagle
from vllm_gaudi_unified.vllm_plugin.hpu_kinds import FULL, group_kinds, plan_encoder_only, plan_kinds, table_indices
from vllm_gaudi_unified.vllm_plugin.hpu_mamba import mamba_step, serve_mamba_layers, state_layer_names
from vllm_gaudi_unified.vllm_plugin.hpu_models import load_shape_fixes
from vllm_gaudi_unified.vllm_plugin.hpu_moe import adapt_vllm_gaudi_moe
from vllm_gaudi_unified.vllm_plugin.hpu_lora import configure_step_lora, prompt_logprobs_by_request
from vllm_gaudi_unified.vllm_plugin.hpu_multimodal import mrope_positions, step_inputs_embeds
from vllm_gaudi_unified.vllm_plugin.hpu_parts import metadata_in_parts, parts_support
from vllm_gaudi_unified.vllm_plugin.hpu_warmup import UnifiedWarmup
from vllm_gaudi_unified.vllm_plugin.hpu_spec import GreedyRejectionSampler, spec_decode_metadata
from vllm_gaudi_unified.vllm_plugin.hpu_step import (
    HpuStep,
    PerRequestRows,
    slot_mapping,
    step_from_input_batch,
    token_positions,
)
from vllm_gaudi_unified.vllm_plugin.steps import StepHooks

logger = get_logger("vllm.gaudi_unified.hpu_runner")


class UnifiedHpuModelRunner(UnifiedWarmup, HPUModelRunner):
    """`HPUModelRunner` with one unified forward per step; see the module doc for what is overridden."""

    def __init__(self, vllm_config, device="hpu", is_driver_worker: bool = False):
        refuse_unsupported_config(vllm_config)
        super().__init__(vllm_config, device=device, is_driver_worker=is_driver_worker)
        self.unified_hooks: list[StepHooks] = []  #: per KV cache group (made in initialize_kv_cache)
        self.unified_kinds: list[dict] = []  #: per KV cache group: its layers by AttentionKind (hpu_kinds.py)
        self.unified_tables: list[int | None] = []  #: per KV cache group: its block table's index; None: encoder-only
        self.unified_warmed: set = set()  #: buckets run through the whole model at warmup
        self.unified_mamba_layers: list[str] = []  #: Mamba2 layers (hybrids), served per call (hpu_mamba.py)
        self.last_step: HpuStep | None = None  #: the last step planned (tests, debugging)
        self.num_listed_decodes = 0  #: the step's first requests, which vllm-gaudi's sampling treats as decodes
        self._step_forward = None  #: (metadata, hidden, aux) of the step's one forward, for its second reader
        self.step_logits_rows = np.zeros(0, dtype=np.int64)  #: flat rows of the step's sampled logits (LoRA)
        if self.speculative_config is not None:  # drafts verified in vLLM's compact layout (hpu_spec.py)
            self.rejection_sampler = GreedyRejectionSampler(self.sampler)

    # ------------------------------------------------------------------ set-up

    def load_model(self) -> None:
        fixes = load_shape_fixes(self.model_config)  # before vLLM builds the model (`hpu_models.py`)
        if fixes:
            logger.info("Unified attention: loaded vllm-gaudi's model fixes for [1, T] inputs: %s", ", ".join(fixes))
        if adapted := adapt_vllm_gaudi_moe():  # vllm-gaudi's MoE layer beside this vLLM (`hpu_moe.py`)
            logger.info("Unified attention: vllm-gaudi's MoE layer adapted to this vLLM: %s", "; ".join(adapted))
        super().load_model()
        if not self.is_pooling_model:  # vllm-gaudi runs a pooling model bare, without its model adapter
            self._model_adapter().metadata_processor = UnifiedMetadataProcessor(self.vllm_config)
        if served := serve_mamba_layers(self.vllm_config):  # hybrids: vllm-gaudi's Mamba2 op per call (hpu_mamba.py)
            logger.info("Unified attention: %d Mamba2 layers run vllm-gaudi's op over each step's decodes together "
                        "and each prompt apart; attention layers the one unified batch", served)
        if hasattr(getattr(self, "drafter", None), "model"):  # EAGLE: its drafter runs unified batches too
            drafter_adapter(self).metadata_processor = UnifiedMetadataProcessor(self.vllm_config)
        logger.info("Unified attention: vllm-gaudi's model runner plans every step as one unified batch "
                    "(backend %s).", self.attn_backend.get_name())

    def _model_adapter(self) -> HpuModelAdapter:
        model = self.model
        for attr in ("_orig_mod", "module"):  # a torch.compile or graph wrapper around the adapter
            if not isinstance(model, HpuModelAdapter) and hasattr(model, attr):
                model = getattr(model, attr)
        if not isinstance(model, HpuModelAdapter):
            raise TypeError(f"vllm-gaudi's runner model is a {type(self.model).__name__}, not its HpuModelAdapter: "
                            "this vllm-gaudi is not the one the unified runner was checked against")
        return model

    def initialize_kv_cache(self, kv_cache_config) -> None:
        super().initialize_kv_cache(kv_cache_config)
        self.make_unified_hooks()

    def make_unified_hooks(self) -> None:
        """Bucket plan, trace and debug log per KV cache group of `self.kv_cache_config`; the group's
        layers by attention kind (vllm-gaudi puts sliding-window, chunked and full layers in one group).
        An encoder-only group (BERT-style embedders: vllm-gaudi appends it, `EncoderOnlyAttentionSpec`,
        with no cache and no block table) plans its steps bidirectional per attention kind (ModernBERT's global
        and local layers), padded to powers of two (`hpu_kinds.plan_encoder_only`): bucket plans and traces
        describe cached steps."""
        config = PluginConfig.from_env()
        groups = self.kv_cache_config.kv_cache_groups
        self.unified_tables = table_indices(groups)
        tables = len(self.input_batch.block_table.block_tables)
        cached = sum(t is not None for t in self.unified_tables)
        if 0 < cached < len(groups):
            raise NotImplementedError("encoder-only attention layers beside layers with a KV cache in one model: "
                                      "the unified runner pads encoder-only steps to their own buckets, so the "
                                      "two kinds of layer would get different row counts")
        if cached != tables:
            # vllm-gaudi keeps one block table for attention-only models and handles windows inside it.
            raise NotImplementedError(f"{cached} KV cache groups with a cache (e.g. sliding-window beside full "
                                      f"attention layers) but vllm-gaudi's input batch keeps {tables} block "
                                      "table(s): not supported by the unified runner yet")
        self.unified_mamba_layers = state_layer_names(self.vllm_config, groups, config.buckets)
        self.unified_kinds = [group_kinds(self.vllm_config, g.layer_names) for g in groups]
        # A group of one plain kind gets that window's bucket plan; several kinds share the full one.
        windows = [next(iter(k)).window if len(k) == 1 and not next(iter(k)).chunk_size else None
                   for k in self.unified_kinds]
        recorder = next((i for i, k in enumerate(self.unified_kinds) if FULL in k), 0)
        self.unified_hooks = [
            StepHooks.encoder_only(config) if t is None else
            StepHooks.create(config, self.vllm_config, g.kv_cache_spec, torch.device(self.device),
                             sliding_window=w, may_record=(i == recorder), **parts_support(self, k))
            for i, (g, w, t, k) in enumerate(zip(groups, windows, self.unified_tables, self.unified_kinds))]
        for kinds, t in zip(self.unified_kinds, self.unified_tables):
            if len(kinds) > 1:
                logger.info("Unified attention: one KV cache group, one plan per attention kind per step (%s), "
                            "%s", ", ".join(f"{k}: {len(v)} layers" for k, v in kinds.items()),
                            "all padded to one bucket" if t is not None else "encoder-only, two-sided windows, "
                            "each padded to powers of two")

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(self, scheduler_output, warmup_mode: bool = False):
        """vllm-gaudi's, except for pooling models, whose steps run as one unified batch too (`hpu_pooling.py`)."""
        if not self.is_pooling_model:
            return super().execute_model(scheduler_output, warmup_mode)
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        from vllm_gaudi_unified.vllm_plugin.hpu_pooling import pool_step

        self.run_defragmenter(scheduler_output, warmup_mode)
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        return pool_step(self, scheduler_output)

    def _get_prompts_and_decodes(self, scheduler_output) -> PromptDecodeInfo:
        """Every scheduled request in one batch, in input-batch order (as vllm-gaudi's prompt list).

        Under speculative decoding vllm-gaudi verifies drafts (rejection sampling) in its decode
        branch only, so its own prompt/decode lists are kept for sampling (decodes first: it has
        ordered the input batch so); the forward stays one unified batch (`_prepare_inputs`)."""
        if self.speculative_config is not None:
            return super()._get_prompts_and_decodes(scheduler_output)
        n = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:n])
        return PromptDecodeInfo(prompt_req_ids=req_ids, decode_req_ids=[],
                                prompt_scheduled_tokens=[scheduler_output.num_scheduled_tokens[r] for r in req_ids])

    def _resolve_block_table(self, table: np.ndarray) -> np.ndarray:
        defrag = getattr(self, "defragmenter", None)
        if defrag is None or not defrag.enabled or not defrag.fwd_mapping_table:
            return table
        mapping = np.asarray(defrag.fwd_mapping_table, dtype=np.int64)
        inside = table < len(mapping)
        return np.where(inside, mapping[np.where(inside, table, 0)], table)

    def plan_step(self, step: HpuStep, bucket_override=None) -> dict[str, UnifiedHpuMetadata]:
        """The step planned per KV cache group and attention kind, as `{layer_name: UnifiedHpuMetadata}`.

        A group of one kind plans like the CPU path's builder: `build_unified_batch(query_lens,
        context_lens, block_table, block_size, sliding_window, options, bucket)`; several kinds
        pad to one bucket (`hpu_kinds.plan_kinds`). Every group pads to the same rows.
        """
        metadata, padded = {}, None
        for gid, (group, hooks, kinds, t) in enumerate(zip(self.kv_cache_config.kv_cache_groups, self.unified_hooks,
                                                           self.unified_kinds, self.unified_tables)):
            if isinstance(group.kv_cache_spec, MambaSpec):  # its layers' calls below
                continue
            bs = group.kv_cache_spec.block_size
            if t is None:  # encoder-only: every token sees its whole request, no cache (`make_unified_hooks`)
                table = np.zeros((len(step.query_lens), 0), dtype=np.int64)
                batches = {kind: plan_encoder_only(step.query_lens, step.context_lens, bs, hooks.options,
                                                   self.device, kind) for kind in kinds}
            else:
                table = step.block_tables[t]
                if (parts := metadata_in_parts(self, step, table, hooks, kinds)) is not None:  # (hpu_parts.py)
                    metadata.update(parts)
                    continue
                batches = plan_kinds(step.query_lens, step.context_lens, table, bs, kinds, hooks.options,
                                     bucket_override if bucket_override is not None else hooks.bucket_plan,
                                     self.device)
            batch = next(iter(batches.values()))
            hooks.after_plan(batch, step.query_lens, step.context_lens, table)
            rows = batch.bucket.query_len
            if padded is None:
                padded = rows
            elif rows != padded:
                raise ValueError(f"KV cache group {gid} padded the step to {rows} rows, group 0 to {padded}: "
                                 "the groups' bucket plans must agree on query lengths")
            slots = (torch.full((rows,), self._PAD_SLOT_ID, dtype=torch.int64) if t is None else  # (nothing cached)
                     torch.from_numpy(slot_mapping(step, table, bs, rows, self._PAD_SLOT_ID))).to(self.device)
            for kind, names in kinds.items():
                # the prompt route's mask once per step for every layer, as vllm-gaudi makes its attn_bias
                # (MLA's expanded prompts, values narrower than keys: the one call's full mask)
                planned = batches[kind].with_prompt_bias(self.dtype, same_head_dims=not self.model_config.use_mla)
                md = UnifiedHpuMetadata(batch=planned, slot_mapping=slots, graph_backend=hooks.graph_backend)
                metadata.update({name: md for name in names})
        if self.unified_mamba_layers:
            mamba = mamba_step(self, step.query_lens, step.context_lens)
            metadata.update({name: mamba for name in self.unified_mamba_layers})
        return metadata

    def _prepare_inputs(self, scheduler_output, num_prefills, num_decodes, warmup=False):
        """The step as vllm-gaudi's sampling code expects it: one prefill batch over every request.

        Under speculative decoding the step's first `num_decodes` requests (vllm-gaudi's decode list)
        sample in its decode branch instead, from the logits of all their rows (`spec_decode_metadata`),
        and the prefill batch samples the others. Both carry the same planned step: the model runs it
        once (`_execute_model_generic`)."""
        step = step_from_input_batch(self.input_batch, scheduler_output.num_scheduled_tokens,
                                     resolve_blocks=None if warmup else self._resolve_block_table)
        self.last_step, self._step_forward = step, None
        metadata = self.plan_step(step)
        first = next(iter(metadata.values()))
        token_ids, tokens_device, positions_device = self.step_inputs(step, first.rows)
        # Which requests sample this step: vLLM's rule (the GPU runner's discard mask): a request
        # whose scheduled tokens reach the end of its known tokens; a prompt chunk short of it does not.
        n = len(step.req_ids)
        d = num_decodes if self.speculative_config is not None else 0
        self.num_listed_decodes = d
        ends = step.context_lens + step.query_lens
        samples = ends >= self.input_batch.num_tokens_no_spec[:n]
        samples[:d] = False  # sampled in the decode branch
        if self.use_async_scheduling:
            # vllm-gaudi's rule: every request samples (its sampled rows are the input batch's, in order, for
            # the next step to read on the device); a prompt chunk short of its end is discarded.
            discarded = np.flatnonzero(~samples).tolist()
            self.invalid_req_indices = getattr(self, "invalid_req_indices", []) + discarded  # reset by sample_tokens
            samples[:] = True
            self._last_sampled_on_device(step, tokens_device)
        last_rows = first.logits_rows(n)
        logits_indices = torch.from_numpy(np.ascontiguousarray(last_rows[samples], dtype=np.int64))
        self.step_logits_rows = logits_indices.numpy()
        data = PrefillInputData()
        if d < n:
            data = PrefillInputData(
                request_ids=[step.req_ids[d:]],
                prompt_lens=[step.query_lens[d:].tolist()],
                token_ids=[tokens_device],
                position_ids=[positions_device],
                attn_metadata=[metadata],
                logits_indices=[logits_indices.to(self.device)],
                logits_requests=[[r for r, s in zip(step.req_ids, samples) if s]],
            )
        decode = None
        if d:
            spec = spec_decode_metadata(step.query_lens[:d], token_ids, self.device)
            decode = DecodeInputData(num_decodes=d, token_ids=tokens_device, position_ids=positions_device,
                                     attn_metadata=metadata, logits_indices=spec.logits_indices.long(),
                                     spec_decode_metadata=spec)
        return (data, None), (decode, None)

    def step_inputs(self, step: HpuStep, padded: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """The step's token ids ([padded] int64, host; padding rows 0) read from the input batch, and the
        model's `[1, padded]` token and position tensors on the device."""
        req_index, positions = token_positions(step, padded)
        width = self.input_batch.token_ids_cpu.shape[1]
        token_ids = self.input_batch.token_ids_cpu.reshape(-1)[req_index * width + positions]
        token_ids[step.num_tokens:] = 0
        token_ids = token_ids.astype(np.int64)
        if self.uses_mrope:  # [3, padded] (hpu_multimodal.py)
            positions = mrope_positions(self.requests, step, positions)
        return (token_ids, torch.from_numpy(token_ids).view(1, -1).to(self.device),
                torch.from_numpy(positions).view(-1 if self.uses_mrope else 1, padded).to(self.device))

    def _last_sampled_on_device(self, step: HpuStep, tokens_device: torch.Tensor) -> None:
        """Async scheduling: a request of the previous step that sampled there brings that token as its last
        scheduled token now, and the host does not have it yet (vllm-gaudi keeps the previous step's samples on
        the device, `prev_sampled_token_ids`, in its input-batch order): copied device to device, never read
        from the host."""
        prev = self.input_batch.prev_sampled_token_ids
        if prev is None:
            return
        prev_index = self.input_batch.prev_req_id_to_index or {}  # without the previous step's discarded samples
        last = np.cumsum(step.query_lens) - 1
        pairs = [(last[i], j) for i, r in enumerate(step.req_ids) if (j := prev_index.get(r)) is not None]
        if pairs:
            rows, src = (torch.tensor(x, dtype=torch.int64) for x in zip(*pairs))
            tokens_device[0, rows.to(tokens_device.device)] = prev[src.to(prev.device)].to(tokens_device.dtype)

    def _execute_model_generic(self, token_ids, position_ids, attn_metadata, logits_indices, kv_caches,
                               lora_logits_mask, lora_mask, warmup_mode=False, inputs_embeds=None,
                               model_mm_kwargs=None):
        """vllm-gaudi's forward with the unified metadata as it is (vllm-gaudi trims its own metadata
        to a namedtuple here; the unified plan passes whole), then the logits of the sampling rows."""
        if not is_unified_metadata(attn_metadata):
            raise TypeError(f"the unified runner got {type(attn_metadata).__name__} metadata: a vllm-gaudi path "
                            "that plans its own batches (e.g. its multimodal warmup) is not supported")
        if self._step_forward is not None and self._step_forward[0] is attn_metadata:
            # The step's second reader (speculative decoding: vllm-gaudi's decode branch after its
            # prefill branch): the same planned step, already run.
            hidden, aux = self._step_forward[1:]
        else:
            hidden, aux = self._forward(token_ids, position_ids, attn_metadata, kv_caches, lora_mask,
                                        inputs_embeds, model_mm_kwargs)
            if self.speculative_config is not None and not warmup_mode:
                self._step_forward = (attn_metadata, hidden, aux)
        flat = hidden.reshape(-1, hidden.shape[-1])
        sample_hidden = flat[logits_indices]
        if lora_logits_mask is not None and lora_logits_mask.shape[0] == flat.shape[0]:
            lora_logits_mask = lora_logits_mask[logits_indices]  # per-token mask (`_configure_lora`): sampled rows
        LoraMask.setLoraMask(lora_logits_mask)
        logits = self.model.compute_logits(sample_hidden)
        step = self.last_step
        rows = PerRequestRows(flat, step.query_lens, self.num_listed_decodes) if step is not None else flat
        return rows, aux, sample_hidden, logits

    def _forward(self, token_ids, position_ids, attn_metadata, kv_caches, lora_mask, inputs_embeds,
                 model_mm_kwargs):
        """vllm-gaudi's model adapter over the planned step -> (hidden states, aux hidden states or None)."""
        extra = {}
        if htorch.utils.internal.is_lazy():  # vllm-gaudi wraps its model adapter in an HPU graph only then
            extra["bypass_hpu_graphs"] = not self._use_unified_graphs(attn_metadata)
        hidden = self.model.forward(input_ids=token_ids, positions=position_ids, attn_metadata=attn_metadata,
                                    kv_caches=kv_caches, inputs_embeds=inputs_embeds,
                                    model_mm_kwargs=model_mm_kwargs, lora_mask=lora_mask, **extra)
        if self.use_aux_hidden_state_outputs:
            return hidden
        return hidden, None

    def _get_model_mm_inputs(self, token_ids, total_num_scheduled_tokens, scheduler_output, req_ids):
        """Multimodal models: the flat step's `inputs_embeds`, images encoded and placed (`hpu_multimodal.py`)."""
        if not self.supports_mm_inputs:
            return None, None
        return step_inputs_embeds(self, token_ids, self.last_step, scheduler_output), None

    def _configure_lora(self, input, requests, req_ids, is_prompt):
        """vllm-gaudi's LoRA mapping and mask, one adapter per token of the flat step (`hpu_lora.py`); the
        per-token mask twice: `_execute_model_generic` takes the logits' rows from the second."""
        mask = self.lora_config and configure_step_lora(self, self.last_step, input.shape[-1], self.step_logits_rows)
        return mask, mask

    def _get_prompt_logprobs_dict(self, prefill_hidden_states, scheduler_output):
        """vllm-gaudi's; with LoRA one request at a time under its adapter's mask (`hpu_lora.py`)."""
        compute, args = super()._get_prompt_logprobs_dict, (prefill_hidden_states, scheduler_output)
        return prompt_logprobs_by_request(self, compute, *args) if self.lora_config else compute(*args)

    def propose_ngram_draft_token_ids(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """vLLM's ngram proposer as it is: no proposal is an empty list. (vllm-gaudi writes [-1] there, a
        token id vLLM 0.32's scheduler would schedule as a draft.)"""
        return self.drafter.propose(self.speculative_config.num_speculative_tokens, sampled_token_ids,
                                    self.input_batch.num_tokens_no_spec, self.input_batch.token_ids_cpu)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        """EAGLE: the drafter over unified batches (`hpu_eagle.py`); ngram: vllm-gaudi's (below)."""
        if self.speculative_config.method in EAGLE_METHODS:
            return propose_eagle(self, sampled_token_ids)
        return super().propose_draft_token_ids(scheduler_output, sampled_token_ids, *args, **kwargs)
