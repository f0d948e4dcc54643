"""Warmup of the unified runner: the bucket plan through the whole model, and which steps replay graphs.

A mixin of `hpu_runner.UnifiedHpuModelRunner` (its one job: the start-up warmup vllm-gaudi's worker
asks for, and the rule that only warmed buckets run as HPU graphs).
"""
from __future__ import annotations

import torch
from vllm_gaudi.extension.defragmentation import OnlineDefragmenter

from vllm_gaudi_unified.batch import InvariantBatch
from vllm_gaudi_unified.log import get_logger
from vllm_gaudi_unified.vllm_plugin.hpu_backend import UnifiedHpuAttentionBackend, UnifiedHpuMetadata
from vllm_gaudi_unified.vllm_plugin.hpu_lora import no_adapter_mask
from vllm_gaudi_unified.vllm_plugin.hpu_multimodal import text_inputs_embeds
from vllm_gaudi_unified.vllm_plugin.hpu_parts import grid_graph_warmup

logger = get_logger("vllm.gaudi_unified.hpu_runner")


def drafts_off(md) -> bool:
    """A latent step whose bucket has units (`StepPlan.unique_units`) but a chunk longer than a unit off the
    prompt route (`drafts_in_units` False): MLA's routes then leave the causal pairs to the tiles, another
    code path in the same bucket than the one a warmed graph may hold (`paths/mla_drafts.py`), so it runs
    eagerly (rare: mixed steps whose long chunks the prompt route does not take)."""
    plan = md.batch.plan
    return not isinstance(md.batch, InvariantBatch) and plan.unique_units > 1 and not plan.drafts_in_units


class UnifiedWarmup:
    """`warmup_model` and `_use_unified_graphs` of the unified runner (needs its `unified_hooks`,
    `unified_kinds`, `unified_warmed`, `kv_caches` and vllm-gaudi's runner methods)."""

    def _use_unified_graphs(self, attn_metadata) -> bool:
        """HPU graphs only for buckets warmed at start-up: an unpadded step has a shape of its own,
        and capturing a graph per step shape would fill the device memory."""
        if self.model_config.enforce_eager:
            return False
        buckets = {md.batch.bucket for md in attn_metadata.values()}
        mla = getattr(self.model_config, "use_mla", False)
        return buckets <= self.unified_warmed and not (mla and any(map(drafts_off, attn_metadata.values())))

    @torch.inference_mode()  # as every serving step runs (HPUWorker.execute_model)
    def warmup_model(self) -> None:
        """Each bucket of the plan once through the whole model, on the real KV caches.

        vllm-gaudi's own warmup runs its prompt/decode buckets, which the unified runner never
        plans; this runs the unified bucket plan instead. In lazy mode the model adapter is an HPU
        graph, captured here per bucket (later steps padded to a warmed bucket replay it). The dummy
        steps read real cache blocks and write only the padding block. Without a bucket plan there
        is nothing to warm (every step runs at its own shape, eagerly)."""
        if self.unified_warmed:  # vllm-gaudi's worker asks twice (initialize_from_config, then the engine)
            return
        if self.kv_caches:  # (vllm-gaudi makes it here too; an encoder-only model has no cache to defragment)
            self.defragmenter = OnlineDefragmenter(self.kv_caches, self.block_size)
        plans = {id(h.bucket_plan): h for h in self.unified_hooks if h.bucket_plan is not None}
        if not plans or not all(h.warmup_enabled for h in self.unified_hooks):
            logger.info("Unified attention: no bucket plan to warm (%s)",
                        "warmup disabled" if plans else "steps run unpadded")
            return
        if len(plans) > 1 or len(plans) != len({id(h) for h in self.unified_hooks if h.bucket_plan is not None}):
            self._warm_attention_only()
            return
        from vllm_gaudi_unified.warmup import warmup

        hooks = self.unified_hooks[0]
        device = torch.device(self.device)
        report = warmup(hooks.bucket_plan, device=device, mode="eager", run=self._warm_bucket, log=logger)
        self.unified_warmed.update(report.buckets)
        logger.info("Unified attention: warmed %d buckets through the model in %.1f s", len(report.buckets),
                    report.total_seconds)

    def _warm_bucket(self, bucket, batch):
        """One bucket through the model; a plan in parts' grid graph as a step in parts of its one part, over
        a bucket's row count (`hpu_parts.grid_graph_warmup`): it compiles that graph's attention, and the
        layers' graphs see only the buckets' row counts."""
        from vllm_gaudi_unified.warmup import batch_for_bucket

        metadata, rows = {}, bucket.query_len
        for group, hooks, kinds in zip(self.kv_cache_config.kv_cache_groups, self.unified_hooks, self.unified_kinds):
            for kind, names in kinds.items():
                b = batch_for_bucket(bucket, group.kv_cache_spec.block_size, hooks.bucket_plan.options_for(bucket),
                                     kind.window, self.device)  # (with the step's mask, as `plan_step` makes it)
                b = b.with_prompt_bias(self.dtype, same_head_dims=not self.model_config.use_mla)
                parts, rows = grid_graph_warmup(hooks, bucket, b) or (None, rows)
                pad = torch.full((rows,), self._PAD_SLOT_ID, dtype=torch.int64, device=self.device)
                md = UnifiedHpuMetadata(batch=b, slot_mapping=pad, parts=parts, graph_backend=hooks.graph_backend)
                metadata.update({name: md for name in names})
        tokens = torch.zeros((1, rows), dtype=torch.int64, device=self.device)
        positions = torch.zeros((3 if self.uses_mrope else 1, rows), dtype=torch.int64, device=self.device)
        self.unified_warmed.add(bucket)  # the forward below captures its graph (lazy mode)
        if self.is_pooling_model:  # no logits; its pooler runs after the forward
            from vllm_gaudi_unified.vllm_plugin.hpu_pooling import pooling_forward

            return pooling_forward(self, tokens, positions, metadata)
        mask = no_adapter_mask(self, rows)
        # A multimodal model's steps all run from inputs_embeds (`hpu_multimodal.py`): its graphs take them too.
        embeds = text_inputs_embeds(self, tokens) if self.supports_mm_inputs else None
        _, _, _, logits = self._execute_model_generic(tokens, positions, metadata,
                                                      torch.zeros(1, dtype=torch.int64, device=self.device),
                                                      self.kv_caches, mask, mask, warmup_mode=True,
                                                      inputs_embeds=embeds)
        return logits

    def _warm_attention_only(self) -> None:
        """KV cache groups with different bucket plans (`auto` per sliding window): each group's plan
        through its attention only, on its first layer's cache; model steps then run without graphs."""
        layers = self.vllm_config.compilation_config.static_forward_context
        for group, hooks in zip(self.kv_cache_config.kv_cache_groups, self.unified_hooks):
            layer = layers[group.layer_names[0]]
            k, v = layer.kv_cache[0], layer.kv_cache[1]
            bs = group.kv_cache_spec.block_size
            hooks.warm_up(UnifiedHpuAttentionBackend.block_view(k, bs), UnifiedHpuAttentionBackend.block_view(v, bs),
                          layer.impl.num_heads)
