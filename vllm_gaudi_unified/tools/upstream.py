"""The earlier Gaudi implementation's bucket plan, rebuilt from its published rules, for comparison.

vLLM-Gaudi's experimental Unified Attention (added 2025-09, removed 2026-03; see
`UPSTREAM_NOTES.md` of the project) bucketed a step by the 4-tuple
`(query tokens, shared blocks, unique blocks, is_causal)`. Its rules, as its
last version applied them (written here from those facts, not from its code):

- each of the three sizes takes 10 points spaced evenly in log scale between 1
  and its maximum, each rounded *up* to a multiple of `max_num_seqs`, the last
  one the maximum itself, plus 0 for the two block counts; the maxima are
  `max_num_batched_tokens` tokens, `min(max_model_len // block_size, num_blocks)`
  shared blocks and `num_blocks` unique blocks;
- every combination with both causal flags is kept, except that a causal bucket
  needs `shared * block_size // min(max_num_seqs, query) <= max_model_len`, and
  a non-causal one needs `query <= max_num_seqs`, some block, `shared *
  block_size // (query // 2) <= max_model_len` when it has shared blocks, and
  `query <= unique` when it has none;
- lookup takes the buckets in sorted (lexicographic) order from the step's own
  tuple on and returns the first whose three sizes are all at least the step's
  (the causal flag is not compared); a miss runs unpadded (a graph compiled
  while serving).

For the 8B / Gaudi 3 setting this gives 107 buckets. Its step shape differs from
ours: every scheduled token against every *shared block* (dense), the unique
blocks as the contiguous cache slice up to the largest unique block id, and
the causal part in 512-row slices over the whole flattened batch. Its score
work per bucket `(q, s, u, causal)` is therefore `q * s * block_size` (shared)
+ `u * block_size` (unique) + the causal slices' pairs `sum_i 512 * min(q,
512 (i + 1))` when causal; its time adds the bytes of the blocks read and of
the tokens, at the same rates as `cost.py`.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from vllm_gaudi_unified.bucket_plans.cost import CostModel
from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
from vllm_gaudi_unified.bucket_plans.trace import step_lines

CAUSAL_SLICE = 512


def log_points(lo: int, hi: int, multiple: int, count: int = 10) -> list[int]:
    """`count` points spaced evenly in log scale from `lo` to `hi`, rounded up to `multiple`, the last `hi`."""
    out = {hi}
    for i in range(count - 1):
        x = lo * (hi / lo) ** (i / (count - 1))
        out.add(int(math.ceil(x / multiple - 1e-9)) * multiple)
    return sorted(out)


def upstream_buckets(settings: ServerSettings) -> np.ndarray:
    """int64 [N, 4] (query, shared blocks, unique blocks, causal), sorted as the lookup walks them."""
    seqs, bs, mml = settings.max_num_seqs, settings.block_size, settings.max_model_len
    query = log_points(1, settings.max_num_batched_tokens, seqs)
    shared = [0] + log_points(1, min(mml // bs, settings.num_blocks), seqs)
    unique = [0] + log_points(1, settings.num_blocks, seqs)
    rows = set()
    for q, s, u, causal in itertools.product(query, shared, unique, (0, 1)):
        if causal:
            keep = s * bs // min(seqs, q) <= mml
        else:
            keep = (q <= seqs and (s > 0 or u > 0) and (s == 0 or (q >= 2 and s * bs // (q // 2) <= mml))
                    and (s > 0 or q <= u))
        if keep:
            rows.add((q, s, u, causal))
    return np.array(sorted(rows), np.int64)


def find_upstream(buckets: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Index of the bucket the lookup returns for each step [N, 4] (-1: none)."""
    steps = np.asarray(steps, np.int64)
    span = np.maximum(buckets.max(0), steps.max(0)) + 1
    def key(a):
        return ((a[:, 0] * span[1] + a[:, 1]) * span[2] + a[:, 2]) * span[3] + a[:, 3]
    start = np.searchsorted(key(buckets), key(steps), side="left")
    cover = (buckets[None, :, :3] >= steps[:, None, :3]).all(2) & (np.arange(len(buckets))[None, :] >= start[:, None])
    return np.where(cover.any(1), cover.argmax(1), -1)


def step_tuples(a, block_size: int) -> np.ndarray:
    """int64 [steps, 4] upstream tuples of parsed steps (`shapes._Arrays`): a block is shared when
    two (token, block) pairs of the step use it, unique otherwise; unique = largest unique id + 1."""
    q, ctx, n = a.q, a.ctx, a.num_steps
    nb = (ctx + block_size - 1) // block_size
    ends = np.cumsum(nb)
    pair_req = np.repeat(np.arange(q.size), nb)
    pair_blk = np.arange(pair_req.size) - np.repeat(ends - nb, nb)
    phys = a.flat[pair_blk + np.repeat(a.row_starts, nb)]
    pair_step = a.req_step[pair_req]
    span = int(phys.max()) + 1 if phys.size else 1
    key = pair_step * span + phys
    uses = np.bincount(key, weights=q[pair_req], minlength=n * span)
    shared_key = np.unique(key[uses[key] > 1])
    shared = np.bincount(shared_key // span, minlength=n)
    uniq = uses[key] == 1
    top = np.full(n, -1, np.int64)
    np.maximum.at(top, pair_step[uniq], phys[uniq])
    T = np.bincount(a.req_step, weights=q, minlength=n).astype(np.int64)
    causal = np.bincount(a.req_step, weights=q > 1, minlength=n) > 0
    return np.stack([T, shared, top + 1, causal.astype(np.int64)], 1)


def upstream_work(tuples: np.ndarray, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Score pairs and estimated µs of tuples [N, 4] (see the module docstring)."""
    t = np.asarray(tuples, np.int64)
    q, s, u, causal = t.T
    bs, m = cost.block_size, cost.model
    slices = -(-q // CAUSAL_SLICE)
    # full slices i < n - 1: 512 rows x 512 (i + 1) keys; the last: its rows x all q keys
    full = CAUSAL_SLICE ** 2 * (slices - 1) * slices // 2
    causal_pairs = np.where(causal > 0, full + (q - CAUSAL_SLICE * (slices - 1)) * q, 0)
    pairs = causal_pairs + q * s * bs + u * bs
    block_bytes = m.num_layers * bs * 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
    time = pairs * cost.pair_cost() + (s + u) * block_bytes / (cost.hardware.hbm_tb_s * 1e6) + q * cost.weights[0]
    return pairs.astype(np.float64), time


def evaluate_upstream(settings: ServerSettings, cost: CostModel, tuples: np.ndarray, needed_pairs: float,
                      name: str = "") -> dict:
    """Graphs, uncovered steps, padding in both measures, worst and p99 step of the upstream plan."""
    buckets = upstream_buckets(settings)
    idx = find_upstream(buckets, tuples)
    hit = idx >= 0
    padded = np.where(hit[:, None], buckets[np.maximum(idx, 0)], tuples)
    padded[:, 3] = tuples[:, 3]  # the step's causal work runs whatever the bucket's flag says
    own_p, own_t = upstream_work(tuples, cost)
    pad_p, pad_t = upstream_work(padded, cost)
    rt, rp = pad_t / own_t, pad_p / np.maximum(own_p, 1)
    return {"trace": name, "steps": int(len(tuples)), "graphs": int(len(buckets)), "uncovered": int((~hit).sum()),
            "padding_time": float(pad_t.sum() / own_t.sum()), "padding_pairs": float(pad_p.sum() / own_p.sum()),
            "worst_time": float(rt.max()), "worst_pairs": float(rp.max()),
            "p99_time": float(np.percentile(rt, 99)), "p99_pairs": float(np.percentile(rp, 99)),
            "algorithm_factor": float(own_p.sum() / needed_pairs), "total_factor": float(pad_p.sum() / needed_pairs)}


def upstream_tuples_of_trace(path: str, settings: ServerSettings) -> np.ndarray:
    """Upstream tuples of every step of a trace file (steps the fast parser cannot read are skipped)."""
    from vllm_gaudi_unified.tools import shapes as sh

    lines = step_lines(path)[0]
    out = []
    for lo in range(0, len(lines), sh._BATCH):
        a = sh._parse_lines(lines[lo:lo + sh._BATCH], settings.block_size)
        if a is None:
            raise ValueError(f"{path}: steps {lo}..{lo + sh._BATCH} are not in the layout the fast parser reads")
        out.append(step_tuples(a, settings.block_size))
    return np.concatenate(out)
