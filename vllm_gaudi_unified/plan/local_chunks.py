"""Chunked local attention (Llama 4) planned as what it is: a token sees only its own chunk's keys.

Positions `[k * chunk, (k + 1) * chunk)` form chunk `k`; a token attends causally to the keys of its
chunk and to nothing before it. That is not a sliding window (the first token of a chunk sees one key,
the last sees `chunk`). vLLM plans it the same way (`make_local_attention_virtual_batches`): every
request's new tokens are cut at chunk boundaries into virtual requests, each with the context its
chunk holds before it and a block table starting at the chunk's first block. The rows keep their
order (a request's chunks are consecutive), so q/k/v, the cache slots and the outputs are the step's
own; only the planner sees the virtual requests. Numpy only.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from vllm_gaudi_unified.plan.step_plan import StepPlan


def local_chunks(query_lens, context_lens, block_table, block_size: int, chunk_size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's requests cut into per-chunk virtual requests: (query_lens, context_lens, block_table),
    the table `[V, chunk_size // block_size]` (the chunk's blocks; 0 past the request's table)."""
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(f"attention chunk_size {chunk_size!r} must be a positive multiple of the KV cache "
                         f"block_size {block_size}: a chunk starts at a block boundary")
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(context_lens, dtype=np.int64)
    table = np.asarray(block_table)
    if q.ndim != 1 or c.shape != q.shape or table.ndim != 2 or table.shape[0] != q.size or (q < 1).any():
        raise ValueError(f"query_lens {q.shape} (each >= 1), context_lens {c.shape} and block_table "
                         f"{table.shape} must describe the same requests")
    end = c + q
    first, last = c // chunk_size, (end - 1) // chunk_size
    per_req = last - first + 1  # chunks the request's new tokens touch
    req = np.repeat(np.arange(q.size), per_req)
    k = np.arange(req.size) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    chunk = first[req] + k
    chunk_start = chunk * chunk_size
    v_start = np.maximum(c[req], chunk_start)
    v_end = np.minimum(end[req], chunk_start + chunk_size)
    width = chunk_size // block_size
    cols = (chunk_start // block_size)[:, None] + np.arange(width)
    inside = cols < table.shape[1]
    v_table = np.where(inside, table[req[:, None], np.minimum(cols, table.shape[1] - 1)], 0)
    return v_end - v_start, v_start - chunk_start, v_table.astype(table.dtype, copy=False)


def with_request_logits(plan: StepPlan, query_lens) -> StepPlan:
    """A plan of virtual requests (`local_chunks`) with the logits rows of the step's real requests
    (the last new token of each), so that its shape counts requests as every other plan of the step."""
    q = np.asarray(query_lens, dtype=np.int64)
    rows = np.cumsum(q) - 1
    n = int(q.size)
    return replace(plan, num_requests=n, logits_indices=rows, shape=replace(plan.shape, num_logits=n),
                   bucket=replace(plan.bucket, num_logits=n))
