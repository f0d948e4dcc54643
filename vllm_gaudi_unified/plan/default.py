"""The default planner: which (query token, key) pairs each path computes, in tiles.

Pure numpy, no torch, no vLLM: it runs every step, before any device work, and
the bucketing tools replay it over whole traces.

Lengths of one request `r` (positions in the sequence)::

    |---------- context_len ----------|---- query_len ----|
    |  keys read from the KV cache    | new tokens: q/k/v |
    0                            context_len        context_len + query_len

Token `j` of `r` sits at position `p = context_len + j` and attends positions
`max(0, p - sliding_window + 1) .. p` of `r`. The pairs are split, each pair
computed exactly once:

* **self**: every token against its own key (elementwise, always on);
* **causal**: a token against earlier new tokens of its request, in square
  tiles on the flattened token axis; only tiles some pair needs are listed, so
  tiles that pair two requests are never computed;
* **shared**: cache blocks needed by more than one query token (a chunk over its
  own context, a prefix common to several requests). Blocks are grouped by the
  set of requests that use them and each group is cut into tiles of
  `tile_rows` query tokens (what costs least over the step's groups, within the
  options' bounds) x `blocks_per_tile` blocks, so a prefix common to 64 decodes is one
  row chunk, read once for all 64, and no token meets a block it cannot see;
* **unique**: cache blocks needed by exactly one query token (the usual decode),
  one row per block, computed per block rather than per token; either the
  contiguous cache slice `[0, max id + 1)` (no gather) or only the live blocks
  (gathered), whichever the layout option picks for this step.

Visibility inside a cache block is one interval of slots `[lo, hi)` per
(token, block): `hi` cuts the context (a partial last block, or a block this
token's request does not use), `lo` applies the sliding window. No dense bias
is built on the host: the device makes masks from these small integer arrays.

Cost (`benchmarks/planning.py`, docs/benchmarks.md): a step is a few dozen
numpy calls on arrays of tokens, (request, block) pairs and tiles, never a
Python loop over them. The common decode step (one new token per request, no
window, no block read twice) takes its own branch of about 25 calls, and a
small shared prefix in it a few more (`decode_shared.py`); the shared tiles are
in `shared.py`; the rules the bucketing tools replay are in
`rules.py`. Arrays come from `out` (`buffers.py`): new ones, or host memory
kept from step to step, which `pad_default` then pads in place.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of
from vllm_gaudi_unified.plan.arrays import (cached_pairs, check_causal_tiles, check_covers, empty, grow, move_no_row,
                                            prefix_mask, ranges, same_id_sum, trusted)
from vllm_gaudi_unified.plan.buffers import FRESH, PlanBuffers
from vllm_gaudi_unified.plan.decode_shared import repeated, split_shared
from vllm_gaudi_unified.plan.options import PathWork, PlanOptions
from vllm_gaudi_unified.plan.prompts import (bucket_grid, fill_grid, pad_prompts, plan_prompts, prompt_grid, prompt_ragged,
                                             prompt_requests)
from vllm_gaudi_unified.plan.rules import MAX_SLICE_BLOCKS, causal_spans, shared_pairs, unique_reads_slice
from vllm_gaudi_unified.plan.shared import plan_shared
from vllm_gaudi_unified.plan.step_plan import StepPlan

_I64 = np.int64


# ----------------------------------------------------------------------------- the planner


def plan_default(q, ctx, bt, nb_ctx, bs: int, W: int | None, num_blocks: int | None, opts: PlanOptions,
                 buffers: PlanBuffers | None = None) -> StepPlan:
    """`plan_step` in the default mode (see the module docstring) on checked inputs (`arrays.validate`);
    arrays are unpadded: `bucket == shape`. `buffers`: write the arrays there (the plan holds views,
    valid until the next plan or padding into them)."""
    out = buffers or FRESH
    R, T = q.size, int(q.sum())
    decodes = T == R  # every request has one new token
    units = opts.unique_tokens if W is None else 1  # new tokens of a request its unique units hold
    if W is None and (decodes or (units > 1 and int(q.max()) <= units)):  # decodes, or a verify step
        plan = _plan_decodes(q, ctx, bt, nb_ctx, bs, num_blocks, opts, out, None if decodes else T)
        if plan is not None:
            return plan
    if decodes:
        starts = np.arange(R)
    else:
        starts = np.cumsum(q)
        starts -= q
    pair_req, pair_blk, phys, counts, max_block_id = cached_pairs(ctx, nb_ctx, bt, bs, W, num_blocks)
    sel = None  # requests on the prompt route (plan/prompts.py): their pairs leave the tiled paths
    if not decodes and W is None and opts.prompt_route == "dense":
        sel = fill_grid(prompt_requests(q, ctx, pair_req, phys, max_block_id, units), q, nb_ctx, bs)
        if sel.any():
            keep = ~sel[pair_req]
            pair_req, pair_blk, phys = pair_req[keep], pair_blk[keep], phys[keep]
            counts = np.where(sel, 0, counts)
        else:
            sel = None
    prompts, prompt_needed = _NO_PROMPTS, 0
    if sel is not None:
        prompts, prompt_needed = plan_prompts(sel, q, ctx, nb_ctx, bt, starts, T)
    has_pairs = counts > 0
    last = np.cumsum(counts)
    last -= 1
    last_hi = ctx - (nb_ctx - 1) * bs  # a request's last block with pairs is its last context block
    if not has_pairs.all():
        last, last_hi = last[has_pairs], last_hi[has_pairs]
    pair_hi = np.full(phys.size, bs, _I64)  # every block is full but a request's last one
    pair_hi[last] = last_hi
    if W is None:  # every token of the request sees every block
        is_shared = shared_pairs(phys, q, counts, units)
    else:  # token j sees the block's last key k while j <= k - context_len + W - 1
        users = np.clip(pair_blk * bs + pair_hi - 1 - ctx[pair_req] + W, 0, q[pair_req])
        is_shared = same_id_sum(phys, max_block_id, users) > 1 if phys.size else np.zeros(0, bool)

    if not is_shared.any():  # every pair unique
        u_rows, u_req = (pair_req if decodes else starts[pair_req]), pair_req
        u_ids, u_hi = phys, pair_hi
        u_lo = None if W is None else _first_lo(ctx, nb_ctx - counts, counts, pair_hi, bs, W, phys.size)
        shared, shared_needed = _no_shared(opts, bs, W), 0
    else:
        u_mask = ~is_shared
        u_ids, u_req, u_hi = phys[u_mask], pair_req[u_mask], pair_hi[u_mask]
        u_rows = starts[u_req]
        u_lo = None
        if W is not None:  # the window cuts a block's first slots
            u_lo = np.clip(ctx[u_req] - W + 1 - pair_blk[u_mask] * bs, 0, u_hi)
        shared, shared_needed = plan_shared(is_shared, phys, pair_req, pair_blk, pair_hi, bt.shape[1], q, starts,
                                            ctx, bs, W, T, opts, out)
    u_tokens = None if units == 1 else q[pair_req if not is_shared.any() else u_req]  # new tokens per unit
    unique, unique_needed = _plan_unique(u_rows, u_ids, u_lo, u_hi, T, opts, out, u_tokens)
    if decodes:
        causal_q = causal_k = empty((0,))
        causal_needed = T
        seg_start = out.keep("token_seg_start", np.arange(R))
    else:
        seg_start = out.keep("token_seg_start", np.repeat(starts, q))
        if sel is None:
            causal_q, causal_k, causal_needed = _plan_causal(q, seg_start, T, W, opts.causal_tile, out)
        else:  # a prompt-route token has no causal pair: it starts its own segment (the tiles' masks too)
            np.copyto(seg_start, np.arange(T), where=np.repeat(sel, q))
            causal_q, causal_k, _ = _plan_causal(np.where(sel, 1, q), seg_start, T, W, opts.causal_tile, out)
            causal_needed = int(np.dot(q, q + 1)) // 2
    only = sel is not None and bool(sel.all())
    shape = _bucket(T, causal_q.size, shared[0].shape[0] * opts.blocks_per_tile(bs), unique[0].size, R,
                    prompts[1].shape if sel is not None else (0, 0), prompts[0].shape[1])
    return trusted(StepPlan, block_size=bs, sliding_window=W, options=opts.with_tile_rows(shared[0].shape[1]),
                   num_requests=R, num_tokens=T,
                   shape=shape, bucket=shape, token_seg_start=seg_start, causal_q_start=causal_q,
                   causal_k_start=causal_k, shared_rows=shared[0], shared_blocks=shared[1], shared_lo=shared[2],
                   shared_hi=shared[3], unique_rows=unique[0], unique_blocks=unique[1], unique_lo=unique[2],
                   unique_hi=unique[3], logits_indices=out.keep("logits_indices", starts + (q - 1)),
                   max_block_id=max_block_id,
                   work_needed=PathWork(causal_needed, shared_needed + prompt_needed, unique_needed),
                   shared_prefix_visible=shared[4], prompt_rows=prompts[0], prompt_blocks=prompts[1],
                   prompt_ctx=prompts[2], prompt_len=prompts[3], prompts_only=only,
                   prompt_grid=only and prompt_grid(prompts[0], prompts[3], T),
                   prompt_ragged=prompt_ragged(prompts[3], prompts[2], shape.prompts, bs),
                   drafts_in_units=W is None and units > 1 and not (q > units).any(where=sel is None or ~sel))


def _plan_decodes(q, ctx, bt, nb_ctx, bs, num_blocks, opts, out, T=None):
    """The decode step: one new token per request, no window. Blocks read by one request go to the
    unique path; blocks several requests hold (a common prefix) to the shared tiles, found from the
    same pairs (`decode_shared.repeated`) rather than the general path's recount. None hands anything else (a bad
    id, no context at all, a forced slice past its cap) to the general path, which raises or gives
    the same arrays in more calls. `T` (new tokens): a verify step, each request at most `unique_tokens`
    new tokens: each slot's row its request's first token (its unit), the drafts' causal tiles beside."""
    R = ctx.size
    verify = T is not None
    live = prefix_mask(nb_ctx, bt.shape[1])
    phys = bt[live]  # request-major and in block order: the general path's pairs
    P = phys.size
    if P == 0:
        return None
    max_id = int(phys.view(np.uint64).max())  # a negative id reads as huge: one reduction checks both ends
    if max_id >= (1 << 62 if num_blocks is None else num_blocks):
        return None
    span = max_id + 1
    if opts.unique_layout == "slice" and span > MAX_SLICE_BLOCKS:
        return None  # refused by the general path
    req = np.repeat(np.arange(R), nb_ctx)
    if verify:
        starts = np.cumsum(q)
        starts -= q
        verify = (T, starts, req)
        req = starts[req]  # a unit's row: its request's first token
    ends = np.cumsum(nb_ctx)
    last = ends - 1
    last_hi = ctx - (nb_ctx - 1) * bs
    if nb_ctx.min() == 0:
        has = nb_ctx > 0
        last, last_hi = last[has], last_hi[has]
    no_row = verify[0] if verify else R
    if unique_reads_slice(P, max_id, opts):
        rows = out.full("unique_rows", span, no_row)
        rows[phys] = req
        seen = rows != no_row
        if np.count_nonzero(seen) == P:  # no block read twice
            hi = out.array("unique_hi", span)
            np.multiply(seen, bs, out=hi)
            hi[phys[last]] = last_hi
            unique = rows, None, out.zeros("unique_lo", span), hi
            return _decode_plan(bs, opts, out, ctx, max_id, None, unique, None, q, verify)
        shared = repeated(phys, span, out)
    else:
        shared = repeated(phys, span, out)
        if shared is None:
            hi = out.full("unique_hi", P, bs)
            hi[last] = last_hi
            unique = out.keep("unique_rows", req), out.keep("unique_blocks", phys), out.zeros("unique_lo", P), hi
            return _decode_plan(bs, opts, out, ctx, max_id, None, unique, None, q, verify)
    if verify:  # a block several requests hold: the general path's shared tiles
        return None
    split = split_shared(shared, phys, max_id, req, ends, nb_ctx, ctx, last, last_hi, bt.shape[1], q, bs, opts, out)
    if split is not None:  # (the unique blocks gathered: `decode_shared.py`)
        shared_tiles, shared_needed, unique, unique_needed = split
        return _decode_plan(bs, opts, out, ctx, max_id, shared_tiles, unique, PathWork(R, shared_needed, unique_needed))
    # Blocks held by several requests, the unique ones on the cache slice: the general path's split.
    pair_hi = np.full(P, bs, _I64)
    pair_hi[last] = last_hi
    s_idx = np.flatnonzero(shared)
    s_req = req[s_idx]
    s_blk = s_idx - (ends - nb_ctx)[s_req]
    shared_tiles, shared_needed = plan_shared(None, phys[s_idx], s_req, s_blk, pair_hi[s_idx], bt.shape[1], q,
                                              np.arange(R), ctx, bs, None, R, opts, out)
    u_mask = ~shared
    unique, unique_needed = _plan_unique(req[u_mask], phys[u_mask], None, pair_hi[u_mask], R, opts, out)
    return _decode_plan(bs, opts, out, ctx, max_id, shared_tiles, unique, PathWork(R, shared_needed, unique_needed))


def _decode_plan(bs, opts, out, ctx, max_id, shared, unique, work, q=None, verify=None) -> StepPlan:
    """The decode branch's plan (`work` None: all pairs unique); `verify` (T, first tokens, _): a verify step's."""
    R = T = ctx.size
    causal_q = causal_k = empty((0,))
    if verify:
        T, starts, _ = verify
        seg_start = out.keep("token_seg_start", np.repeat(starts, q))
        causal_q, causal_k, causal_needed = _plan_causal(q, seg_start, T, None, opts.causal_tile, out)
        work = PathWork(causal_needed, 0, int(np.dot(ctx, q)))
        logits = out.keep("logits_indices", starts + (q - 1))
    else:
        seg_start = out.keep("token_seg_start", np.arange(R))
        logits = out.keep("logits_indices", np.arange(R))
        work = PathWork(R, 0, int(ctx.sum())) if work is None else work
    if shared is None:
        shared = _no_shared(opts, bs, None)
    shape = _bucket(T, causal_q.size, shared[0].shape[0] * opts.blocks_per_tile(bs), unique[0].size, R)
    return trusted(StepPlan, block_size=bs, sliding_window=None, options=opts.with_tile_rows(shared[0].shape[1]),
                   num_requests=R, num_tokens=T,
                   shape=shape, bucket=shape, token_seg_start=seg_start,
                   causal_q_start=causal_q, causal_k_start=causal_k, shared_rows=shared[0],
                   shared_blocks=shared[1], shared_lo=shared[2], shared_hi=shared[3], unique_rows=unique[0],
                   unique_blocks=unique[1], unique_lo=unique[2], unique_hi=unique[3],
                   logits_indices=logits, max_block_id=max_id,
                   work_needed=work, shared_prefix_visible=shared[4], drafts_in_units=opts.unique_tokens > 1)


_NO_PROMPTS = (empty((0, 0)), empty((0, 0)), empty((0,)), empty((0,)))


def _bucket(T, n_causal, n_shared, n_unique, R, prompt_blocks=(0, 0), prompt_len=0) -> Bucket:
    return trusted(Bucket, phase=phase_of(n_causal, n_shared, n_unique), query_len=T, num_shared_blocks=n_shared,
                   num_unique_blocks=n_unique, num_logits=R, num_causal_tiles=n_causal,
                   num_prompts=prompt_blocks[0], prompt_len=prompt_len, prompt_blocks=prompt_blocks[1])


def _first_lo(ctx, first_blk, counts, pair_hi, bs, W, P):
    """lo of every pair when no block is shared: only a request's first block can start past slot 0."""
    lo = np.zeros(P, _I64)
    has = counts > 0
    first = (np.cumsum(counts) - counts)[has]
    lo[first] = np.clip(ctx[has] - W + 1 - first_blk[has] * bs, 0, pair_hi[first])
    return lo


def _no_shared(opts, bs, W):
    qt, kb = opts.shared_rows, opts.blocks_per_tile(bs)
    return empty((0, qt)), empty((0, kb)), empty((0, qt, kb)), empty((0, qt, kb)), W is None


def _plan_unique(rows, ids, lo, hi, T, opts, out, tokens=None):
    """One slot per block used by exactly one request: its row is the request's first token (with a
    window, the one token that sees it: later tokens see less far back; else its unit of `tokens` new
    tokens, `PlanOptions.unique_tokens`), compact (gathered) or on the slice [0, max id] of the cache."""
    if ids.size == 0:
        blocks = empty((0,)) if opts.unique_layout == "gather" else None
        return (empty((0,)), blocks, empty((0,)), empty((0,))), 0
    seen = hi if lo is None else hi - lo
    needed = int(seen.sum()) if tokens is None else int(np.dot(seen, tokens))
    span = int(ids.max()) + 1
    if opts.unique_layout == "slice" and span > MAX_SLICE_BLOCKS:
        raise ValueError(f"unique_layout='slice' would read cache blocks [0, {span}) for block id {span - 1}: "
                         f"more than {MAX_SLICE_BLOCKS}; use 'gather' or 'auto'")
    if not unique_reads_slice(ids.size, span - 1, opts):
        lo = out.zeros("unique_lo", ids.size) if lo is None else out.keep("unique_lo", lo)
        return (out.keep("unique_rows", rows), out.keep("unique_blocks", ids), lo, out.keep("unique_hi", hi)), needed
    slot_rows = out.full("unique_rows", span, T)
    slot_rows[ids] = rows
    slot_hi = out.zeros("unique_hi", span)
    slot_hi[ids] = hi
    slot_lo = out.zeros("unique_lo", span)
    if lo is not None:
        slot_lo[ids] = lo
    return (slot_rows, None, slot_lo, slot_hi), needed


def _plan_causal(q, seg_start, T, W, tile, out):
    """Tiles (query slice, key slice) on the flattened token axis that hold some strict-causal pair
    (`rules.causal_spans`); the pairs needed come per request: sum_j min(j + 1, W)."""
    wq = q if W is None else np.minimum(q, W)
    needed = int(np.dot(wq, wq + 1)) // 2 + (0 if W is None else int(np.dot(q - wq, wq)))
    if W == 1 or int(q.max()) == 1:  # only self pairs
        return empty((0,)), empty((0,)), needed
    t = np.arange(T)
    klo = seg_start if W is None else np.maximum(seg_start, t - (W - 1))
    needs = klo <= t - 1  # at least one earlier new token of the same request is visible
    first_q, active, first_k, last_k = causal_spans(t // tile, t, klo, needs, tile)
    first_q, first_k, last_k = first_q[active], first_k[active], last_k[active]
    check_causal_tiles(int((last_k - first_k + 1).sum()), tile)
    k_tiles, owner = ranges(first_k, last_k - first_k + 1)
    cq = out.array("causal_q_start", k_tiles.size)
    np.take(first_q, owner, out=cq)
    ck = out.array("causal_k_start", k_tiles.size)
    np.multiply(k_tiles, tile, out=ck)
    return cq, ck, needed


# ----------------------------------------------------------------------------- padding


def pad_default(plan: StepPlan, bucket: Bucket, buffers: PlanBuffers | None = None) -> StepPlan:
    """`pad_plan` in the default mode: padding adds only fully masked work.

    With `buffers`, the padded arrays are those buffers (a plan made into them is padded in place,
    its "no row" markers moved: the unpadded plan is then spent)."""
    check_covers(bucket, plan.shape)
    kb = plan.options.blocks_per_tile(plan.block_size)
    if bucket.num_shared_blocks % kb:
        raise ValueError(f"bucket num_shared_blocks {bucket.num_shared_blocks} is not a multiple of the "
                         f"{kb} blocks of a shared tile (block_size {plan.block_size})")
    T, Tp = plan.bucket.query_len, bucket.query_len
    ns, nu, nc = bucket.num_shared_blocks // kb, bucket.num_unique_blocks, bucket.num_causal_tiles
    if buffers is None:
        def rows(a):
            return move_no_row(a, T, Tp)

        return replace(
            plan, bucket=bucket,
            token_seg_start=np.concatenate([plan.token_seg_start, np.arange(T, Tp, dtype=np.int64)]),
            causal_q_start=grow(rows(plan.causal_q_start), nc, Tp), causal_k_start=grow(plan.causal_k_start, nc, 0),
            shared_rows=grow(rows(plan.shared_rows), ns, Tp), shared_blocks=grow(plan.shared_blocks, ns, 0),
            shared_lo=grow(plan.shared_lo, ns, 0), shared_hi=grow(plan.shared_hi, ns, 0),
            unique_rows=grow(rows(plan.unique_rows), nu, Tp),
            unique_blocks=None if plan.unique_blocks is None else grow(plan.unique_blocks, nu, 0),
            unique_lo=grow(plan.unique_lo, nu, 0), unique_hi=grow(plan.unique_hi, nu, 0),
            logits_indices=grow(plan.logits_indices, bucket.num_logits, 0), **_pad_prompts(plan, bucket, T, Tp),
            prompt_grid=bucket_grid(plan.prompts_only, bucket.prompts, Tp),
            prompt_ragged=_ragged(plan, bucket))

    def pad(name, n, fill, rows=False):
        a = getattr(plan, name)
        kept = buffers.holds(name, a)
        padded = buffers.array(name, (n,) + a.shape[1:])  # the same memory (grown: its content too)
        head = padded[: a.shape[0]]
        if not kept:
            np.copyto(head, a)
        if rows and T != Tp:
            np.putmask(head, head == T, Tp)
        padded[a.shape[0]:] = fill
        return padded

    padded = dict(
        plan.__dict__, bucket=bucket, token_seg_start=pad("token_seg_start", Tp, np.arange(T, Tp)),
        causal_q_start=pad("causal_q_start", nc, Tp, rows=True), causal_k_start=pad("causal_k_start", nc, 0),
        shared_rows=pad("shared_rows", ns, Tp, rows=True), shared_blocks=pad("shared_blocks", ns, 0),
        shared_lo=pad("shared_lo", ns, 0), shared_hi=pad("shared_hi", ns, 0),
        unique_rows=pad("unique_rows", nu, Tp, rows=True),
        unique_blocks=None if plan.unique_blocks is None else pad("unique_blocks", nu, 0),
        unique_lo=pad("unique_lo", nu, 0), unique_hi=pad("unique_hi", nu, 0),
        logits_indices=pad("logits_indices", bucket.num_logits, 0), **_pad_prompts(plan, bucket, T, Tp),
        prompt_grid=bucket_grid(plan.prompts_only, bucket.prompts, Tp), prompt_ragged=_ragged(plan, bucket))
    return trusted(type(plan), **padded)


def _ragged(plan, bucket) -> bool:
    """`prompt_ragged` of the step's prompts in the bucket's grid."""
    return plan.prompt_len is not None and prompt_ragged(plan.prompt_len, plan.prompt_ctx, bucket.prompts,
                                                         plan.block_size)


def _pad_prompts(plan, bucket, T, Tp) -> dict:
    """The prompt route's arrays at `bucket` (a plan without them, the decode branch's: empty ones)."""
    if plan.prompt_rows is None:
        if not bucket.num_prompts:
            return {}
        plan = replace(plan, **dict(zip(("prompt_rows", "prompt_blocks", "prompt_ctx", "prompt_len"), _NO_PROMPTS)))
    if plan.bucket.prompts == bucket.prompts and T == Tp:
        return {}
    return pad_prompts(plan, bucket, T, Tp)
