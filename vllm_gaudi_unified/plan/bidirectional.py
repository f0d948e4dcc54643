"""The planner of encoder-only (bidirectional) steps: every new token sees every new token of its request.

Why a planner of its own: an encoder (BERT-style embedders, vLLM's
`AttentionType.ENCODER_ONLY`) reads no KV cache, so only the causal path runs,
without its causal mask. Its tiles are the causal path's square tiles on the
flattened token axis (each pair of tokens in exactly one tile), but each
query tile takes the key tiles of its requests' whole spans rather than those
up to its last token. A tile that holds two requests' tokens is masked by the
device (`paths/causal.py`: a key counts only where it has the row's request
start), so no pair of two requests is computed. The self pair comes
from the self path, as for decoders.

A sliding window W is two-sided here (ModernBERT's local layers: keys less than
W positions away on either side, as vLLM's CPU attention applies it): a query
tile then takes only the key tiles within W - 1 of its tokens, inside their
requests, and the device masks the rest.

The result is an ordinary `StepPlan` (no shared or unique work, `bidirectional`
set), padded and bucketed like any other.
"""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of
from vllm_gaudi_unified.plan.arrays import check_causal_tiles, empty, ranges, trusted
from vllm_gaudi_unified.plan.options import PathWork, PlanOptions
from vllm_gaudi_unified.plan.step_plan import StepPlan


def plan_bidirectional(q: np.ndarray, ctx: np.ndarray, bs: int, W: int | None, opts: PlanOptions) -> StepPlan:
    """An encoder step on checked inputs (`arrays.validate`): no cache, whole-request tiles (within the
    two-sided window `W`), unpadded."""
    if opts.batch_invariant:
        raise ValueError("PlanOptions.batch_invariant: the batch-invariant planner plans causal steps only")
    if ctx.max() > 0:
        r = int(np.argmax(ctx > 0))
        raise ValueError(f"context_lens[{r}] = {int(ctx[r])} must be 0: bidirectional (encoder-only) attention "
                         "reads no KV cache")
    R, T, tile = q.size, int(q.sum()), opts.causal_tile
    starts = np.cumsum(q)
    starts -= q
    seg_start = np.repeat(starts, q)
    # Each token's keys: its request's span, within W - 1 of it (`W` two-sided); the flattened index is the
    # position within the request plus its start, so the window is one on the flattened axis too.
    first_key, last_key = seg_start, seg_start + np.repeat(q, q) - 1
    if W is not None:
        token = np.arange(T)
        first_key, last_key = np.maximum(first_key, token - (W - 1)), np.minimum(last_key, token + (W - 1))
    # Query tiles on the flattened axis, as the causal planner cuts them; each takes the key tiles from
    # its tokens' first key to their last (a token whose only key is itself needs none: the self path).
    needs = last_key > first_key
    first_q = np.arange(0, T, tile)
    lo = np.minimum.reduceat(np.where(needs, first_key, T), first_q)
    hi = np.maximum.reduceat(np.where(needs, last_key, -1), first_q)
    active = hi >= 0
    first_q, first_k, last_k = first_q[active], lo[active] // tile, hi[active] // tile
    check_causal_tiles(int((last_k - first_k + 1).sum()), tile)
    k_tiles, owner = ranges(first_k, last_k - first_k + 1)
    causal_q, causal_k = first_q[owner], k_tiles * tile
    qt, kb = opts.shared_rows, opts.blocks_per_tile(bs)
    shape = trusted(Bucket, phase=phase_of(causal_q.size, 0, 0), query_len=T, num_shared_blocks=0,
                    num_unique_blocks=0, num_logits=R, num_causal_tiles=int(causal_q.size))
    return trusted(StepPlan, block_size=bs, sliding_window=W, options=opts, num_requests=R, num_tokens=T,
                   shape=shape, bucket=shape, token_seg_start=seg_start, causal_q_start=causal_q,
                   causal_k_start=causal_k, shared_rows=empty((0, qt)), shared_blocks=empty((0, kb)),
                   shared_lo=empty((0, qt, kb)), shared_hi=empty((0, qt, kb)), unique_rows=empty((0,)),
                   unique_blocks=None if opts.unique_layout != "gather" else empty((0,)), unique_lo=empty((0,)),
                   unique_hi=empty((0,)), logits_indices=starts + (q - 1), max_block_id=-1,
                   work_needed=PathWork(causal=int((last_key - first_key + 1).sum())), shared_prefix_visible=True,
                   bidirectional=True)
