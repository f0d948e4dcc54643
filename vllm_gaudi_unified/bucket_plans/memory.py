"""Warmup's peak device memory, from the plan's own model: no device needed to see it.

Warmup runs the graphs one at a time, so its peak is the largest graph's working
set plus what stays allocated across graphs. Per graph (one attention call of
one layer, every buffer of it counted as live at once, an upper bound for a
fused graph that frees intermediates early), in bytes, with `Hq`, `Hkv`, `D`, `B`
the model's heads, head size and element size and `bs` the block size:

| part | bytes |
|---|---|
| gathered K and V | `2 (num_shared_blocks + num_unique_blocks + num_prompts x prompt_blocks) bs Hkv D B` |
| scores (float32) | `4 Hq` x the graph's (query, key) pairs: shared tiles `num_shared_blocks x shared_rows x bs`, unique `num_unique_blocks x bs`, causal `num_causal_tiles x causal_tile^2`, the prompt call's grid (`grid_pairs`) |
| inputs and outputs | `query_len (2 Hq + 2 Hkv) D B` (q, k, v, output) |
| partial outputs | float32, a head's output and row statistics per row the step's one merge (`merge.merge_rows`) holds until its end: every shared-tile row, unique slot and causal-tile row, and the accumulator's query row |
| index arrays | 8 bytes per query token, block slot, logit row, causal tile and prompt grid cell |

What warmup keeps across graphs: each graph's inputs and outputs and its
index arrays (an HPU graph holds its static tensors) and the KV
cache of one layer it runs on (`num_blocks`, the server's; vLLM's other layers
are its own budget). The LM head and the model's weights are not counted: the
plugin warms attention inside vLLM's own memory accounting.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.plan.prompts import grid_pairs

GIB = float(1 << 30)


def graph_bytes(bucket: Bucket, settings, model) -> dict:
    """Bytes of one graph's working set, per part (module docstring)."""
    o, bs = settings.options, settings.block_size
    hq, hkv, d, b = model.num_qo_heads, model.num_kv_heads, model.head_dim, model.dtype_bytes
    p, qp, cb = bucket.prompts
    slots = bucket.num_shared_blocks + bucket.num_unique_blocks + p * cb
    pairs = (bucket.num_shared_blocks * o.shared_rows * bs + bucket.num_unique_blocks * bs
             + bucket.num_causal_tiles * o.causal_tile ** 2 + int(grid_pairs(p, qp, cb, bs)))
    rows = (bucket.num_shared_blocks // settings.blocks_per_tile * o.shared_rows + bucket.num_unique_blocks
            + bucket.num_causal_tiles * o.causal_tile + bucket.query_len)
    return {"gathered_kv": 2 * slots * bs * hkv * d * b, "scores": 4 * hq * pairs,
            "inputs_outputs": bucket.query_len * (2 * hq + 2 * hkv) * d * b, "partials": rows * hq * (d + 2) * 4,
            "indices": 8 * (bucket.query_len + slots + bucket.num_logits + bucket.num_causal_tiles + p * qp)}


@dataclass(frozen=True)
class WarmupMemory:
    """Warmup's peak, in bytes: `largest` (the graph with the largest working set) plus `kept` plus `kv_cache`."""

    largest: Bucket
    working_set: int
    kept: int
    kv_cache: int

    @property
    def peak(self) -> int:
        return self.working_set + self.kept + self.kv_cache

    def describe(self) -> str:
        return (f"warmup peak device memory (the plan's model, bucket_plans/memory.py): {self.peak / GIB:.2f} GiB = "
                f"largest graph's working set {self.working_set / GIB:.2f} GiB ({self.largest}) + inputs and "
                f"outputs warmup keeps {self.kept / GIB:.2f} GiB + one layer's KV cache {self.kv_cache / GIB:.2f} GiB")


def warmup_memory(plan) -> WarmupMemory:
    """The plan's warmup peak (module docstring): every bucket and prompt graph."""
    s, m = plan.settings, plan.model
    graphs = list(plan.buckets) + list(plan.prompt_graphs)
    parts = {g: graph_bytes(g, s, m) for g in graphs}
    largest = max(graphs, key=lambda g: (sum(parts[g].values()), g))
    kept = sum(x["inputs_outputs"] + x["indices"] for x in parts.values())
    kept -= parts[largest]["inputs_outputs"] + parts[largest]["indices"]  # counted in its working set
    kv = 2 * s.num_blocks * s.block_size * m.num_kv_heads * m.head_dim * m.dtype_bytes
    return WarmupMemory(largest, sum(parts[largest].values()), kept, kv)
