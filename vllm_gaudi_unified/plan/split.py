"""Split a step whose gathered K/V would not fit the memory cap into several calls.

The shared and unique paths gather K and V of their block slots into one
tensor per layer (`[slots, block_size, num_kv_heads, head_dim]` each), so a
bucket's memory grows with its slots: the limits bucket of the 8B setting would
gather 87 040 shared slots, about 23 GB of K alone at bf16, too much to warm up.
A bucket plan therefore caps the slots of any bucket (`GatherCap`), and a step
beyond the cap is cut into *pieces*: consecutive ranges of its shared tiles and
of its unique slots, each piece within the cap. Every piece keeps all the step's
query rows; the self and causal pairs go with the first piece only. Each pair of
the step is then computed in exactly one piece, and merging the pieces'
partials (the same exact merge as the paths') gives the unsplit result.

`piece_sizes` is the same cut on shapes alone, so that bucket learning and
evaluation count the calls the planner will make. `build_unified_batch` splits
a step when its bucket plan has a cap (`BucketPlan.gather_cap`) and the step
exceeds it; `unified_attention` runs the pieces and merges them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of


@dataclass(frozen=True)
class GatherCap:
    """Most block slots one call may gather, per path (None: no cap)."""

    max_shared_blocks: int | None = None  #: a multiple of the shared tile's blocks
    max_unique_blocks: int | None = None

    def __post_init__(self):
        for name in ("max_shared_blocks", "max_unique_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise ValueError(f"GatherCap.{name} must be None or an int >= 1, got {v!r}")

    @classmethod
    def from_memory(cls, memory_bytes: float, share: float, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype_bytes: int, blocks_per_tile: int) -> "GatherCap":
        """The cap that keeps one call's gathered K and V of one layer within `share` of `memory_bytes`."""
        if not 0 < share <= 1:
            raise ValueError(f"memory share must be in (0, 1], got {share!r}")
        if memory_bytes <= 0:
            raise ValueError(f"device memory must be positive, got {memory_bytes!r}")
        per_slot = 2 * block_size * num_kv_heads * head_dim * dtype_bytes  # K and V of one block
        slots = int(share * memory_bytes // per_slot)
        shared = slots // blocks_per_tile * blocks_per_tile
        if shared < blocks_per_tile:
            raise ValueError(f"a memory share of {share} of {memory_bytes:.3g} bytes holds {slots} block slots, "
                             f"fewer than one shared tile ({blocks_per_tile} blocks)")
        return cls(shared, slots)

    def exceeded(self, shape: Bucket) -> bool:
        return ((self.max_shared_blocks is not None and shape.num_shared_blocks > self.max_shared_blocks)
                or (self.max_unique_blocks is not None and shape.num_unique_blocks > self.max_unique_blocks))


def _parts(total: np.ndarray, cap: int | None, unit: int = 1) -> np.ndarray:
    """How many pieces `total` (in multiples of `unit`) needs under `cap`."""
    if cap is None:
        return np.where(total > 0, 1, 0)
    return -(-total // (cap // unit * unit))


def _even(total_units: int, parts: int, i: int) -> tuple[int, int]:
    """[start, end) of part i when `total_units` are cut into `parts` near-equal consecutive ranges."""
    base, extra = divmod(total_units, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def piece_sizes(sizes: np.ndarray, cap: GatherCap, blocks_per_tile: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces' shapes `[M, 5]` (DIMS order) of steps `[N, 5]` and the step of each piece `[M]`.

    A step within the cap is one piece, itself. Vectorised over steps: pieces are rare, so the
    per-piece arithmetic runs on the (few) split steps only."""
    sizes = np.asarray(sizes, np.int64)
    q, s, u, l, c = sizes.T
    kb = blocks_per_tile
    ns = _parts(s // kb, None if cap.max_shared_blocks is None else cap.max_shared_blocks // kb)
    nu = _parts(u, cap.max_unique_blocks)
    count = np.maximum(np.maximum(ns, nu), 1)
    owner = np.repeat(np.arange(len(sizes)), count)
    out = sizes[owner].copy()
    first = np.cumsum(count) - count
    for step in np.flatnonzero(count > 1):
        for i in range(int(count[step])):
            row = out[first[step] + i]
            a, b = _even(int(s[step] // kb), int(ns[step]), i) if i < ns[step] else (0, 0)
            row[1] = (b - a) * kb
            a, b = _even(int(u[step]), int(nu[step]), i) if i < nu[step] else (0, 0)
            row[2] = b - a
            if i:
                row[4] = 0
    return out, owner


def split_plan(plan, cap: GatherCap) -> list:
    """An unpadded `StepPlan` cut into pieces within `cap` (a list of one when it fits)."""
    shape = plan.shape
    if plan.bucket != shape:
        raise ValueError("split_plan takes an unpadded plan (pad each piece afterwards)")
    if plan.options.batch_invariant:
        if cap.exceeded(shape):
            raise ValueError(f"step {shape} exceeds the gather cap {cap}; batch-invariant plans are not split")
        return [plan]
    if not cap.exceeded(shape):
        return [plan]
    kb = plan.options.blocks_per_tile(plan.block_size)
    pieces, _ = piece_sizes(np.array([shape.sizes]), cap, kb)
    unique_blocks = plan.unique_blocks
    if unique_blocks is None:  # a slice read in place cannot be cut: gather its blocks instead
        unique_blocks = np.arange(shape.num_unique_blocks, dtype=np.int64)
    out, s0, u0 = [], 0, 0
    for i, (q, s, u, l, c) in enumerate(pieces.tolist()):
        ts, ns = s0 // kb, s // kb
        piece = Bucket(phase_of(c, s, u), q, s, u, l, c, *(shape.prompts if i == 0 else (0, 0, 0)))
        # the prompt route runs with the first piece (its rows are final there); later pieces have none
        prompts = {} if i == 0 or plan.prompt_rows is None else dict(
            prompt_rows=plan.prompt_rows[:0, :0], prompt_blocks=plan.prompt_blocks[:0, :0],
            prompt_ctx=plan.prompt_ctx[:0], prompt_len=plan.prompt_len[:0])
        out.append(replace(
            plan, shape=piece, bucket=piece,
            causal_q_start=plan.causal_q_start[:c], causal_k_start=plan.causal_k_start[:c],
            shared_rows=plan.shared_rows[ts:ts + ns], shared_blocks=plan.shared_blocks[ts:ts + ns],
            shared_lo=plan.shared_lo[ts:ts + ns], shared_hi=plan.shared_hi[ts:ts + ns],
            unique_rows=plan.unique_rows[u0:u0 + u], unique_blocks=unique_blocks[u0:u0 + u],
            unique_lo=plan.unique_lo[u0:u0 + u], unique_hi=plan.unique_hi[u0:u0 + u],
            work_needed=plan.work_needed if i == 0 else type(plan.work_needed)(), **prompts))
        s0, u0 = s0 + s, u0 + u
    return out

