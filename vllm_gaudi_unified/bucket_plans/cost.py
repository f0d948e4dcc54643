"""The work model: what a step of a given shape costs, in estimated device microseconds.

Padding waste is padded work / real work, so "work" must weigh the five sizes
of a bucket against each other: one more unique block is not worth one more
query token. Each size is multiplied by the FLOPs and bytes its unit of work
takes, summed over the model's layers, and turned into time with a
roofline-style sum `flops / peak_flops + vector_ops / vector_flops + bytes / hbm_bw`
(time rather than raw FLOPs, because decode attention is bound by memory and
prefill attention by compute). Per layer, with `Hq` query heads, `Hkv` KV heads,
head size `D`, `B` bytes per element and `kv = 2 * Hkv * D * B` bytes of K and V per
cached token:

| size | unit of work | matmul FLOPs | softmax ops | bytes |
|---|---|---|---|---|
| `query_len` | one new token: q/k/v in, output out, KV written, self pair | `4 Hq D` | `5 Hq` | `(2 Hq + 4 Hkv) D B` |
| `num_causal_tiles` | `t x t` (query, key) pairs, `t` = causal_tile | `4 Hq D t^2` | `5 Hq t^2` | `t kv + t Hq D B` |
| `num_shared_blocks` | one block slot of a shared tile: `shared_rows x block_size` pairs | `4 Hq D rows bs` | `5 Hq rows bs` | `bs kv + rows Hq D B / blocks_per_tile` |
| `num_unique_blocks` | one block against its one query row | `4 Hq D bs` | `5 Hq bs` | `bs kv` |
| `num_logits` | one row for the sampler: the LM head (once, not per layer) | `2 hidden vocab` | | `hidden B` |

(`4 D` per pair and head: `q.k` and `p.v`, two FLOPs per multiply-add; 5 vector
ops per score: scale, mask, max, exp, sum.) The cost is linear in the sizes,
`cost = sizes . weights`, which makes evaluating thousands of steps against
hundreds of buckets one matrix product, and lets the padding waste split
exactly per dimension.

The defaults describe Llama-3.1-8B in bf16 on one Gaudi 3 (about 1835 TFLOP/s of
bf16 matrix math, 28.7 TFLOP/s of bf16 vector math, 3.7 TB/s of HBM; public
figures, rounded). Only ratios matter for the waste, so other models and devices
change the picture only through these ratios. Each size's roofline time is then scaled by what the device
measures for it (`MEASURED_FACTORS`): a padded query row or causal tile costs far more than its FLOPs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from vllm_gaudi_unified.bucket import SIZE_FIELDS, SIZE_NAMES, Bucket
from vllm_gaudi_unified.plan import PlanOptions
from vllm_gaudi_unified.plan.prompts import grid_pairs

#: The numeric fields of a Bucket, in `Bucket.sizes` order (`bucket.SIZE_FIELDS`), and their short names.
DIMS = SIZE_FIELDS
SHORT = dict(zip(SIZE_FIELDS, SIZE_NAMES))


@dataclass(frozen=True)
class ModelSpec:
    """The attention-relevant dimensions of the served model."""

    num_layers: int = 32
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    hidden_size: int = 4096
    vocab_size: int = 128256

    def __post_init__(self):
        for k, v in asdict(self).items():
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ModelSpec.{k} must be a positive int, got {v!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads {self.num_qo_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")


@dataclass(frozen=True)
class Hardware:
    """Peak rates of the device the plan is for."""

    name: str = "gaudi3"
    matmul_tflops: float = 1835.0
    vector_tflops: float = 28.7
    hbm_tb_s: float = 3.7
    memory_gb: float = 128.0  #: device memory (HBM), for the gather cap of a plan


#: The device's time per unit of each size over the roofline's, relative to the unique blocks' (DIMS order),
#: and the same for a prompt graph's grid pairs and its context's K and V: the roofline prices each size at
#: peak rates, while a query row pays for its merges, writes and small per-row operations, a causal tile or
#: shared slot for its masked tile, and the fused prompt call runs near its peak. Fitted (least squares on the
#: relative error, a constant per step beside) to the device time of 3200 steps: steps 300-499 of the shared
#: chat and RAG traces on the Gaudi route (bf16, 32/8/128, block 128), unpadded and padded to four 8B plans, on
#: an H200 at commits 3645134, 86f277a, 19df27c and fb7cc7d (`benchmarks/results/trace_steps_h200/` and its
#: history); median error 3 %, 1 % on the 60 steps in tiled buckets with causal tiles, which need no factor of
#: their own (with the roofline alone they took 0.74 ms of device time per model ms, prompt graphs 0.31). The
#: logits' LM head is not part of that time and keeps its roofline.
MEASURED_FACTORS = np.array([20.6, 7.8, 1.0, 1.0, 11.7])
GRID_FACTOR, CONTEXT_FACTOR = 0.66, 12.3


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec
    hardware: Hardware
    block_size: int
    options: PlanOptions

    @property
    def weights(self) -> np.ndarray:
        """float64[5]: estimated microseconds per unit of each size, in DIMS order: the roofline's
        (`breakdown`) times `MEASURED_FACTORS`."""
        return np.array([self._unit(d) for d in DIMS]) * MEASURED_FACTORS

    def breakdown(self, dim: str) -> dict:
        """FLOPs, vector ops and bytes of one unit of `dim` (whole model, all layers)."""
        m, o, bs = self.model, self.options, self.block_size
        hq, hkv, d, b, layers = m.num_qo_heads, m.num_kv_heads, m.head_dim, m.dtype_bytes, m.num_layers
        kv = 2 * hkv * d * b
        if dim == "num_logits":
            return {"flops": 2.0 * m.hidden_size * m.vocab_size, "vector": 0.0, "bytes": float(m.hidden_size * b)}
        if dim == "query_len":
            pairs, byts = 1, (2 * hq + 4 * hkv) * d * b
        elif dim == "num_causal_tiles":
            t = o.causal_tile
            pairs, byts = t * t, t * kv + t * hq * d * b
        elif dim == "num_shared_blocks":
            rows, kb = o.shared_rows, o.blocks_per_tile(bs)
            pairs, byts = rows * bs, bs * kv + rows * hq * d * b / kb
        elif dim == "num_unique_blocks":
            pairs, byts = bs, bs * kv
        else:
            raise ValueError(f"unknown dimension {dim!r}")
        return {"flops": float(layers * 4 * hq * d * pairs), "vector": float(layers * 5 * hq * pairs),
                "bytes": float(layers * byts)}

    def _unit(self, dim: str) -> float:
        w, h = self.breakdown(dim), self.hardware
        return 1e6 * (w["flops"] / (h.matmul_tflops * 1e12) + w["vector"] / (h.vector_tflops * 1e12)
                      + w["bytes"] / (h.hbm_tb_s * 1e12))

    def cost(self, sizes) -> np.ndarray:
        """Work (estimated µs) of shapes given as an int array [..., 5] in DIMS order."""
        return np.asarray(sizes, dtype=np.float64) @ self.weights

    def bucket_cost(self, bucket: Bucket) -> float:
        return float(np.dot(bucket.sizes, self.weights))

    def graph_cost(self, bucket: Bucket, weights: np.ndarray | None = None) -> float:
        """Work (estimated µs) of a graph: its five sizes (`bucket_cost`) plus, for a prompt graph, its prompt
        call: the pairs of its grid (`plan/prompts.py: grid_pairs`) at `pair_cost`, and its context's K and V
        read once per layer (each times its measured factor, `GRID_FACTOR`, `CONTEXT_FACTOR`). What `BucketPlan.route` weighs a prompt graph against a tiled bucket with."""
        cost = float(np.dot(bucket.sizes, self.weights if weights is None else weights))
        p, qp, cb = bucket.prompts
        if p:
            m, bs = self.model, self.block_size
            kv_bytes = m.num_layers * p * cb * bs * 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
            cost += (GRID_FACTOR * float(grid_pairs(p, qp, cb, bs)) * self.pair_cost()
                     + CONTEXT_FACTOR * 1e6 * kv_bytes / (self.hardware.hbm_tb_s * 1e12))
        return cost

    @property
    def pair_weights(self) -> np.ndarray:
        """float64[5]: score pairs (query token x key) per unit of each size, DIMS order, as the planner's
        `StepPlan.work_planned` counts them: the second measure of padding, blind to bytes and to the
        LM head (no pairs for the logits). A shared slot holds `shared_rows x block_size` pairs, a unique
        one `block_size`; in batch-invariant mode a unit holds `invariant_rows x block_size`."""
        o, bs = self.options, self.block_size
        rows = o.invariant_rows if o.batch_invariant else o.shared_rows
        return np.array([1.0, rows * bs, bs, 0.0, o.causal_tile ** 2])

    def pair_cost(self) -> float:
        """µs per (query token, key) score pair, all heads and layers: prices the planner's `PathWork`."""
        m, h = self.model, self.hardware
        flops, vec = m.num_layers * 4 * m.num_qo_heads * m.head_dim, m.num_layers * 5 * m.num_qo_heads
        return 1e6 * (flops / (h.matmul_tflops * 1e12) + vec / (h.vector_tflops * 1e12))
