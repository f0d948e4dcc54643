"""Several attention kinds in one KV cache group, as vllm-gaudi serves them.

vllm-gaudi gives every decoder layer a `FullAttentionSpec` (`HPUModelRunner.get_kv_cache_spec`), so
Gemma 2/3, gpt-oss and Llama 4 arrive in one KV cache group with one block table; its own attention
then narrows the blocks per layer (`window_block_list` for sliding-window layers,
`chunked_block_list` for chunked local ones). The unified runner does the same with plans: the step
is planned once per attention kind of the group (`AttentionKind`: full, a window, a chunk size) over
the one block table, and each layer reads its kind's plan.

One graph per bucket still holds: every kind's plan pads to one bucket, the smallest covering all of
them (`plan_kinds`). The cost: a windowed or chunked layer then gathers as many block slots as the
full layers (the extra ones fully masked); the window saves memory reads only where the bucket plan
has a smaller bucket for the whole step (docs/usage.md gives the numbers).

Encoder-only layers (BERT-style embedders) are the one kind vllm-gaudi puts in a group of their own, with
no cache and no block table (`table_indices`); their steps are planned bidirectional (`plan_encoder_only`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_gaudi_unified import Bucket, build_unified_batch, pad_plan, plan_step
from vllm_gaudi_unified.bucket import pow2_bucket
from vllm_gaudi_unified.batch import UnifiedBatch, prompt_graph_for
from vllm_gaudi_unified.plan.options import on_route
from vllm_gaudi_unified.plan.local_chunks import local_chunks, with_request_logits


@dataclass(frozen=True, order=True)
class AttentionKind:
    """What a layer's tokens see of the cache: all of it, the last `sliding_window` positions, or their
    own `chunk_size` chunk (Llama 4's chunked local attention)."""

    sliding_window: int = 0  #: 0: none
    chunk_size: int = 0  #: 0: none

    @property
    def window(self) -> int | None:
        return self.sliding_window or None

    def __str__(self) -> str:
        if self.chunk_size:
            return f"chunked local ({self.chunk_size})"
        return f"sliding window {self.sliding_window}" if self.sliding_window else "full"


FULL = AttentionKind()


def layer_kind(layer) -> AttentionKind:
    """The kind of a vLLM attention layer: its impl's window, or the chunk of a `ChunkedLocalAttention`."""
    window = layer.impl.sliding_window or 0
    chunk = getattr(layer, "attention_chunk_size", None) or 0
    if window and chunk:
        raise NotImplementedError(f"layer {layer.layer_name}: a sliding window ({window}) and chunked local "
                                  f"attention ({chunk}) together")
    return AttentionKind(int(window), int(chunk))


def group_kinds(vllm_config, layer_names) -> dict[AttentionKind, list[str]]:
    """The group's layers by kind, full attention first (it plans the step's logits rows)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    kinds: dict[AttentionKind, list[str]] = {}
    for name in layer_names:  # a layer that is no `Attention` (e.g. MLA's) attends to everything: full
        kinds.setdefault(layer_kind(layers[name]) if name in layers else FULL, []).append(name)
    return dict(sorted(kinds.items()))


def table_indices(groups) -> list[int | None]:
    """Per KV cache group, the index of its block table in vllm-gaudi's input batch, None for an
    encoder-only group (`EncoderOnlyAttentionSpec`: no cache, so vllm-gaudi keeps no table for it)."""
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    indices, next_table = [], 0
    for group in groups:
        if isinstance(group.kv_cache_spec, EncoderOnlyAttentionSpec):
            indices.append(None)
        else:
            indices.append(next_table)
            next_table += 1
    return indices


def plan_encoder_only(query_lens, context_lens, block_size: int, options, device,
                      kind: AttentionKind = FULL) -> UnifiedBatch:
    """An encoder-only step (every token sees its whole request, within the kind's two-sided window; no cache,
    so `context_lens` all 0 and no block table: `plan/bidirectional.py`) padded to `bucket.pow2_bucket` of its
    shape: bucket plans describe cached steps, and an HPU compiles a graph per shape, so the step's sizes are
    rounded to a few shapes (at most 2x each) rather than left as they come. Every kind pads to the same rows."""
    if kind.chunk_size:
        raise NotImplementedError(f"chunked local attention ({kind.chunk_size}) in an encoder-only layer")
    plan = plan_step(query_lens, context_lens, np.zeros((len(query_lens), 0), np.int64), block_size,
                     sliding_window=kind.window, options=options, causal=False)
    return UnifiedBatch.from_plan(pad_plan(plan, pow2_bucket(plan.shape)), device)


def plan_kinds(query_lens, context_lens, block_table, block_size: int, kinds, options, bucket,
               device) -> dict[AttentionKind, UnifiedBatch]:
    """The step planned for each kind of `kinds`, every plan padded to one bucket.

    `bucket`: a bucket plan (`.find`), a `Bucket`, or None (unpadded). One plain kind plans exactly
    as the CPU path's metadata builder (`build_unified_batch`). Several: each kind is planned
    unpadded, the bucket is the plan's for the elementwise largest shape, and each pads to it."""
    kinds = list(kinds)
    if len(kinds) == 1 and not kinds[0].chunk_size:
        return {kinds[0]: build_unified_batch(query_lens, context_lens, block_table, block_size,
                                              sliding_window=kinds[0].window, options=options, bucket=bucket,
                                              device=device)}
    plans = {k: _plan_kind(k, query_lens, context_lens, block_table, block_size, options) for k in kinds}
    if any(p.shape.num_prompts for p in plans.values()) and not prompt_graph_for(
            bucket, largest_shape([p.shape for p in plans.values()])):  # no warmed graph: the tiled route
        tiled = on_route(options, "tiles")
        plans = {k: _plan_kind(k, query_lens, context_lens, block_table, block_size, tiled) for k in kinds}
    cap = getattr(bucket, "gather_cap", None)
    if cap is not None and any(cap.exceeded(p.shape) for p in plans.values()):
        raise NotImplementedError(f"a step of {len(query_lens)} requests gathers more than the bucket plan's cap "
                                  f"{cap} in one of its attention kinds ({', '.join(map(str, kinds))}): splitting "
                                  "a step of several kinds is not supported; raise the cap")
    target = step_bucket([p.shape for p in plans.values()], bucket)
    padded = [p if target is None else pad_plan(p, target) for p in plans.values()]
    return dict(zip(plans, UnifiedBatch.from_plans(padded, device)[0]))  # (every kind in one copy)


def _plan_kind(kind: AttentionKind, query_lens, context_lens, block_table, block_size: int, options):
    if not kind.chunk_size:
        return plan_step(query_lens, context_lens, block_table, block_size, sliding_window=kind.window,
                         options=options)
    q, c, table = local_chunks(query_lens, context_lens, block_table, block_size, kind.chunk_size)
    return with_request_logits(plan_step(q, c, table, block_size, options=options), query_lens)


def step_bucket(shapes: list[Bucket], bucket) -> Bucket | None:
    """The one bucket of a step whose kinds have `shapes`: the plan's bucket for their elementwise
    largest shape (`bucket` a plan), `bucket` itself (a `Bucket`), or None (unpadded)."""
    if bucket is None:
        return None
    largest = largest_shape(shapes)
    if isinstance(bucket, Bucket):
        if not bucket.covers(largest):
            raise ValueError(f"bucket {bucket} does not cover the step's largest kind shape {largest}")
        return bucket
    return bucket.find(largest)


def largest_shape(shapes: list[Bucket]) -> Bucket:
    """The elementwise largest of `shapes` (its phase: every path any of them runs)."""
    from vllm_gaudi_unified.bucket import phase_of

    sizes = np.max(np.array([s.sizes + s.prompts for s in shapes], dtype=np.int64), axis=0).tolist()
    q, s, u, n, c, *prompts = (int(x) for x in sizes)
    return Bucket(phase_of(c, s, u), q, s, u, n, c, *prompts)  # with the prompt route's shape (plan/prompts.py)


def padding_work(batches: dict[AttentionKind, UnifiedBatch], layers: dict[AttentionKind, int]) -> tuple[int, int]:
    """(pairs needed, pairs planned) over the step's layers: each kind's plan times its layer count."""
    needed = sum(b.work_needed.total * layers[k] for k, b in batches.items())
    planned = sum(b.work_planned.total * layers[k] for k, b in batches.items())
    return needed, planned
