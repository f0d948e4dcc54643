"""Batch-invariant mode: a request's output has the same bits whatever else is in its step.

Why the default mode is not invariant (each hazard was seen in a test, see
tests/test_batch_invariance.py and docs/batch_invariance.md):

1. causal tiles sit on the flattened token axis, so which keys share a tile
   (one softmax and one `p @ V` reduction) depends on the request's offset;
2. a cached block's keys are reduced per shared tile of several blocks when
   other tokens use it, per block when only this token does, so the
   shared/unique classification, which depends on the other requests, changes
   the reduction;
3. the partials of one token are summed by `index_add`, whose order is the
   order of the rows in the step (and, on CUDA, of the atomics);
4. matrix products change shape with the step: `[1, D] @ [D, K]` (a GEMV)
   rounds differently from the same row inside `[R, D] @ [D, K]`, and a library
   may pick another kernel for another batch count; kernels that split a row's
   keys pick the split count by the batch.

The rule of this mode: every reduction a token's result goes through is cut at
boundaries fixed by positions in the token's own request and folded in an
order fixed by those positions; which route a request takes depends on the
request alone (its new-token count, its context) and on the step's dtype and
device.

**Own calls** (`own_calls`: two or more new tokens, no window, and no context
or at least `CALL_MIN_ROWS` new tokens: prompts and prompt chunks): the
default's prompt route taken one request at a time. A prompt without context
is one fused causal SDPA call over its own rows; a prompt over its context is
the split form (`paths/prompts.py`): one fused call over its context keys
(exactly its context, gathered in position order) and one causal call over
its new keys, merged by their LSE. Each call's inputs are the request's own
q/k/v and cache contents, at shapes set by its own lengths, so the call (and
the kernel's choice of tiles, splits and algorithm) is the same alone or in
any batch; the split between the two calls is the request's context length, a
position of its own. Where that form does not run (soft cap, sinks, fused
kernels off, no fused kernel with statistics, values narrower than keys) the
request's pairs take the routes below like any other request's: the plan
lists them there too, after the other requests' (`*_own_from`), so a step
skips them when its own calls run.

Every other request takes one of two routes' arrays (the device picks one per
step, `paths/invariant.py`):

* **fast route** (CUDA flash + Triton, `paths/invariant_fast.py`): a request
  with one new token (or any request under a sliding window) has its cached
  blocks as *slots* (one per (token, block), sorted by token then position),
  which the Triton kernel walks in splits of `split_keys` keys counted from the
  token's first slot (a constant of the model's KV heads); a verify step (2 to `unique_tokens` new tokens over a
  context, no window: `unit_requests`) has its slots listed once, on its first
  token, whose program takes all its rows (tokens x query heads of a KV head)
  in the same splits; another request with several new tokens has its context as one
  flash segment (its rows against its gathered blocks, no split-KV) and its new
  tokens, self pair included, one causal flash segment; a one-token request and a
  verify step take their new keys in their Triton program (split 0, after its
  context keys, in the request's order);
* **tile route** (torch products: the Gaudi route, fp32, soft cap): a
  request's context is cut into *chunks* of `blocks_per_tile` logical blocks (counted from block 0),
  a tile is one chunk and the rows of one request that read it: one row for a one-token request (a
  decode is one row), `unique_tokens` rows for a verify step (`unit_requests`: its tokens, one tile
  per chunk), up to `invariant_rows` rows otherwise; tiles go through products of one fixed shape
  per kind (`invariant_chunk` tiles per call, a quarter for one-row tiles that miss a key of their
  chunk; the last call padded), each (token, chunk) partial is written to slot `[token, chunk]` and
  the slots are folded by a fixed pairwise tree. A whole chunk many one-row tiles read is a *share
  call* (`share_*`): the one-row call's products, its K and V a view repeating the chunk read once.
  Causal pairs: tiles of `causal_tile` x `causal_tile` counted from each request's first token.

Padding to a bucket adds rows no request owns and empty tiles: they touch no
real row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, phase_of
from vllm_gaudi_unified.plan.arrays import (cached_pairs, check_causal_tiles, check_covers, grow, move_no_row, ranges,
                                            step_tokens)
from vllm_gaudi_unified.plan.invariant_slots import most as _most, plan_ctx_segments, plan_slots
from vllm_gaudi_unified.plan.options import PathWork, PlanOptions
from vllm_gaudi_unified.plan.step_plan import StepPlan

#: A request with context takes its own calls from this many new tokens (with no context: from two). Shorter
#: ones (speculative verify steps, small chunks) stay on the step's kernels, one launch for all of them,
#: where two calls each would cost a launch per request.
CALL_MIN_ROWS = 16

#: Keys per split of the fast route's Triton kernel, counted from a token's first slot: a split's
#: boundaries are positions of the token's own context, never a function of the batch. `split_keys`:
#: `SPLIT_HEAD_KEYS` per KV head, at most `SPLIT_KEYS` (a token's programs, KV heads x splits, take about as
#: many keys each whatever the model's KV heads: an MQA verify step still fills the SMs).
SPLIT_KEYS = 8192
SPLIT_HEAD_KEYS = 1024


def split_keys(kv_heads: int) -> int:
    """Keys per split of the fast route's Triton kernel for a model of `kv_heads` KV heads (a constant of the model)."""
    return min(SPLIT_KEYS, SPLIT_HEAD_KEYS * kv_heads)


@dataclass(frozen=True, eq=False)
class InvariantPlan(StepPlan):
    """A batch-invariant step (module docstring); the shared/unique arrays of `StepPlan` are empty.

    Tile route: `dec_*` one-row tiles (requests with one new token), `unit_*` tiles of `unique_tokens`
    rows (verify steps, `unit_requests`), `pre_*` tiles of `invariant_rows` rows (the others), each one chunk of
    `blocks_per_tile` logical blocks, `share_*` calls of one-row tiles of one chunk; causal tiles per request.
    Fast route: `slot_*`, `ctx_*`, `seg_*`. Own calls: `calls`, `call_blocks`; their requests' entries sit
    last in `pre_*`, `causal_*`, `ctx_*` and `seg_*`, from the `*_own_from` counts on."""

    dec_rows: np.ndarray  #: [dec tiles, 1] the tile's token (query_len: none)
    dec_blocks: np.ndarray  #: [dec tiles, blocks_per_tile] physical blocks of the chunk (0 where unseen)
    dec_lo: np.ndarray  #: [dec tiles, 1, blocks_per_tile] first visible slot
    dec_hi: np.ndarray  #: [dec tiles, 1, blocks_per_tile] end of visible slots (0: unseen)
    dec_col: np.ndarray  #: [dec tiles] chunk index in the request's context
    dec_whole: int  #: the first `dec_whole` dec tiles see every key of their chunk (no V mask needed)
    dec_real: tuple  #: (whole, other): the real dec tiles of each range, first in it (the rest padding)
    share_rows: np.ndarray  #: [share calls, invariant_chunk] one-token requests' tokens reading a whole chunk
    share_blocks: np.ndarray  #: [share calls, blocks_per_tile] that chunk's physical blocks (read once per call)
    share_col: np.ndarray  #: [share calls, invariant_chunk] the chunk's index in each row's context
    share_real: tuple  #: per share call, its real rows (first in it)
    pre_rows: np.ndarray  #: [pre tiles, invariant_rows] tokens of one request (query_len: none)
    pre_blocks: np.ndarray  #: [pre tiles, blocks_per_tile]
    pre_lo: np.ndarray  #: [pre tiles, invariant_rows, blocks_per_tile]
    pre_hi: np.ndarray  #: [pre tiles, invariant_rows, blocks_per_tile]
    pre_col: np.ndarray  #: [pre tiles]
    unit_rows: np.ndarray  #: [unit tiles, unique_tokens] tokens of one verify step (`unit_requests`; query_len: none)
    unit_blocks: np.ndarray  #: [unit tiles, blocks_per_tile]
    unit_lo: np.ndarray  #: [unit tiles, unique_tokens, blocks_per_tile]
    unit_hi: np.ndarray  #: [unit tiles, unique_tokens, blocks_per_tile]
    unit_col: np.ndarray  #: [unit tiles]
    causal_col: np.ndarray  #: [num_causal_tiles] key tile index within its request
    cached_width: int  #: slots per token: its self pair's partial, then its chunks' (a power of two)
    causal_width: int  #: slots per token for causal partials (a power of two)
    slot_rows: np.ndarray  #: [slots] token of each (token, block) slot, sorted by token then position
    slot_blocks: np.ndarray  #: [slots] physical block
    slot_lo: np.ndarray  #: [slots] first visible slot of the block
    slot_hi: np.ndarray  #: [slots] end of visible slots
    slot_starts: np.ndarray  #: [tokens + 1] token t's slots are `slot_*[slot_starts[t]:slot_starts[t + 1]]`
    slot_take: np.ndarray  #: [tokens] 1: the token's program takes its request's new keys (one-token requests, units)
    slot_most: int  #: the most slots of one token (the kernel's split count: `split_keys` at run time)
    ctx_rows: np.ndarray  #: [rows] tokens of the requests whose context is one flash segment, in order
    ctx_cu_q: np.ndarray  #: [segments + 1] cumulative rows
    ctx_blocks: np.ndarray  #: [blocks] each segment's context blocks, in order
    ctx_cu_k: np.ndarray  #: [segments + 1] cumulative keys (whole blocks)
    ctx_used: np.ndarray  #: [segments] the context length (keys used of the segment)
    ctx_max: tuple  #: (max rows, max keys) of a segment
    ctx_own_from: tuple  #: (rows, segments, blocks, max rows, max keys) of the segments before the own calls'
    seg_rows: np.ndarray  #: [rows] tokens of the requests with several new tokens, not units: a causal segment each
    seg_cu: np.ndarray  #: [segments + 1] cumulative rows of `seg_rows`
    seg_max: int  #: the most new tokens of a segment, at least 2 (flash's one-row path never runs)
    seg_own_from: tuple  #: (rows, segments, max rows) of the segments before the own calls'
    slot_units: int  #: tokens of a Triton program's rows (`unique_tokens`; 1 under a window): `unit_requests`
    one_rows: np.ndarray  #: [rows] tokens of the one-token requests (fast route: their self pair in their program)
    pre_own_from: int  #: `pre_*` tiles before the own calls' (whole calls)
    causal_own_from: int  #: causal tiles before the own calls' (whole calls)
    calls: tuple  #: per own-calls request: (first token, new tokens, context, first `call_blocks` entry, blocks)
    call_blocks: np.ndarray  #: [blocks] the own-calls requests' context blocks, in order

    @property
    def calls_only(self) -> bool:
        """Every new token of the step is on its request's own calls (a step of prompts)."""
        return sum(length for _, length, _, _, _ in self.calls) == self.num_tokens

    @property
    def work_planned(self) -> PathWork:
        b, opts = self.bucket, self.options
        keys = opts.blocks_per_tile(self.block_size) * self.block_size
        return PathWork(causal=b.num_causal_tiles * opts.causal_tile**2 + b.query_len,
                        shared=(self.dec_rows.shape[0] + self.pre_rows.size + self.unit_rows.size
                                + self.share_rows.size) * keys)


def pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tiles_per_call(opts: PlanOptions) -> int:
    """Tiles per product of the tile route (a tail call: a quarter): one shape per kind, whatever the batch."""
    return opts.invariant_chunk


def own_calls(q: np.ndarray, ctx: np.ndarray, W: int | None) -> np.ndarray:
    """Bool `[R]`: the requests whose rows may come from their own fused calls (module docstring): a
    function of each request alone."""
    if W is not None:
        return np.zeros(q.shape, bool)
    return (q >= 2) & ((ctx == 0) | (q >= CALL_MIN_ROWS))


def unit_requests(q: np.ndarray, ctx: np.ndarray, W: int | None, opts: PlanOptions) -> np.ndarray:
    """Bool `[R]`: the requests whose cached keys the fast route reads as one unit (a speculative verify step:
    2 to `unique_tokens` new tokens over a context, no window): the Triton kernel's program of the request's
    first token takes all its rows (tokens x query heads of a KV head) against each key it loads, in
    position-fixed splits; on the tile route its tokens are one tile of `unique_tokens` rows per chunk.
    A function of each request and the options alone."""
    if W is not None:
        return np.zeros(q.shape, bool)
    return (q >= 2) & (q <= opts.unique_tokens) & (ctx > 0)


def plan_invariant(q, ctx, bt, nb_ctx, bs: int, W: int | None, num_blocks: int | None,
                   opts: PlanOptions) -> InvariantPlan:
    """`plan_step` for `options.batch_invariant` on checked inputs: the same semantics, the layout of this module."""
    R, T = q.size, int(q.sum())
    starts, tok_j, tok_req, tok_pos = step_tokens(q, ctx)
    pair_req, pair_blk, phys, _, max_block_id = cached_pairs(ctx, nb_ctx, bt, bs, W, num_blocks)
    kb, rs = opts.blocks_per_tile(bs), opts.invariant_rows
    first_blk = np.zeros_like(ctx) if W is None else np.maximum(ctx - W + 1, 0) // bs
    one, own = q == 1, own_calls(q, ctx, W)
    unit = unit_requests(q, ctx, W, opts) & ~own
    rest = np.flatnonzero(~one & ~own)  # several new tokens, not on their own calls
    mine = np.flatnonzero(own)
    dec_all = _plan_tiles(np.flatnonzero(one), 1, q, starts, ctx, nb_ctx, first_blk, bt, bs, W, kb, tok_pos, T, opts)
    dec, share = _plan_share_calls(dec_all, T, bs, W, tiles_per_call(opts))
    units = _plan_tiles(np.flatnonzero(unit), opts.unique_tokens, q, starts, ctx, nb_ctx, first_blk, bt, bs, W, kb,
                        tok_pos, T, opts)
    flash_rest = rest[~unit[rest]]  # several new tokens, not units (their new keys: the units' programs')
    pre_rest, pre_own = (_plan_tiles(reqs, rs, q, starts, ctx, nb_ctx, first_blk, bt, bs, W, kb, tok_pos, T, opts)
                         for reqs in (flash_rest, mine))
    pre = {key: np.concatenate([pre_rest[key], pre_own[key]]) for key in pre_rest}
    causal_rest, causal_own = (_plan_causal_tiles(q, starts, W, opts, sel) for sel in (~own, own))
    causal_q, causal_k, causal_col = (np.concatenate(pair) for pair in zip(causal_rest, causal_own))
    n_causal = np.where(q >= 2, -(-q // opts.causal_tile), 0)
    causal_width = pow2(int(n_causal.max()) if n_causal.size else 1)
    slot_tokens = np.where(one | (W is not None), q, np.where(unit, 1, 0))  # a unit's slots: its first token's
    slots = plan_slots(pair_req, pair_blk, phys, slot_tokens, starts, ctx, tok_pos, bs, W)
    slots["take"] = np.bincount(starts[one | unit], minlength=T).astype(np.int32)  # (W: no unit)
    flash_ctx_reqs = flash_rest[ctx[flash_rest] > 0]
    ctx_reqs = (flash_ctx_reqs, mine[ctx[mine] > 0]) if W is None else (np.zeros(0, np.int64),) * 2
    flash_ctx = plan_ctx_segments(np.concatenate(ctx_reqs), q, starts, ctx, nb_ctx, bt, bs)
    c = ctx_reqs[0]
    flash_ctx["own_from"] = (int(q[c].sum()), c.size, int(nb_ctx[c].sum()), max(2, _most(q[c])), _most(nb_ctx[c]) * bs)
    multi = np.concatenate([flash_rest, mine])
    seg_rows, _ = ranges(starts[multi], q[multi])
    call_blk, call_owner = ranges(np.zeros_like(mine), nb_ctx[mine])
    call_first = np.cumsum(nb_ctx[mine]) - nb_ctx[mine]
    n_tiles = dec["rows"].shape[0] + pre["rows"].shape[0] + units["rows"].shape[0] + int((share["rows"] < T).sum())
    shape = Bucket(phase=phase_of(causal_q.size, n_tiles, 0), query_len=T, num_shared_blocks=n_tiles,
                   num_unique_blocks=0, num_logits=R, num_causal_tiles=causal_q.size)
    needed = PathWork(causal=int(np.minimum(tok_j + 1, W if W is not None else T + 1).sum()),
                      shared=int(sum((t["hi"] - t["lo"]).sum() for t in (dec_all, pre, units))))
    rows_kb = np.zeros((0, opts.shared_rows), np.int32)
    none3 = np.zeros((0, opts.shared_rows, 1), np.int32)
    empty = np.zeros(0, np.int32)
    chunks = -(-nb_ctx // kb)
    return InvariantPlan(
        block_size=bs, sliding_window=W, options=opts, num_requests=R, num_tokens=T, shape=shape, bucket=shape,
        token_seg_start=starts[tok_req].astype(np.int32), causal_q_start=causal_q, causal_k_start=causal_k,
        shared_rows=rows_kb, shared_blocks=np.zeros((0, 1), np.int32), shared_lo=none3, shared_hi=none3,
        unique_rows=empty, unique_blocks=empty, unique_lo=empty, unique_hi=empty,
        logits_indices=(starts + q - 1).astype(np.int32), max_block_id=max_block_id,
        work_needed=needed, shared_prefix_visible=False,
        **{f"dec_{k}": v for k, v in dec.items()}, **{f"pre_{k}": v for k, v in pre.items()},
        **{f"unit_{k}": v for k, v in units.items()}, **{f"share_{k}": v for k, v in share.items()},
        causal_col=causal_col, cached_width=pow2(int(chunks.max()) + 1 if chunks.size else 1),
        causal_width=causal_width, **{f"slot_{k}": v for k, v in slots.items()},
        **{f"ctx_{k}": v for k, v in flash_ctx.items()}, seg_rows=seg_rows.astype(np.int32),
        seg_cu=np.concatenate([[0], np.cumsum(q[multi])]).astype(np.int32), seg_max=max(2, _most(q[multi])),
        seg_own_from=(int(q[flash_rest].sum()), flash_rest.size, max(2, _most(q[flash_rest]))),
        slot_units=opts.unique_tokens if W is None else 1,
        one_rows=starts[one].astype(np.int32), pre_own_from=pre_rest["rows"].shape[0],
        causal_own_from=causal_rest[0].size,
        calls=tuple(zip(*(a.tolist() for a in (starts[mine], q[mine], ctx[mine], call_first, nb_ctx[mine])))),
        call_blocks=bt[mine[call_owner], call_blk] if call_blk.size else np.zeros(0, np.int64))


def _plan_tiles(reqs, rows, q, starts, ctx, nb_ctx, first_blk, bt, bs, W, kb, tok_pos, T, opts):
    """Tiles of one chunk (`kb` logical blocks from block `col * kb`) and up to `rows` tokens of one
    request; rows that see no slot of the chunk (a window) are no row, tiles without a row dropped;
    padded with empty tiles to whole calls."""
    c0 = first_blk[reqs] // kb
    col, owner = ranges(c0, np.maximum(-(-nb_ctx[reqs] // kb) - c0, 0))
    req = reqs[owner]
    group, owner = ranges(np.zeros_like(col), -(-q[req] // rows))
    req, col = req[owner], col[owner]
    j = group[:, None] * rows + np.arange(rows)  # [n, rows] token index in the request
    real = j < q[req][:, None]
    blk = col[:, None] * kb + np.arange(kb)  # [n, kb] logical blocks
    seen = (blk >= first_blk[req][:, None]) & (blk < nb_ctx[req][:, None])
    ids = np.where(seen, bt[req[:, None], np.minimum(blk, bt.shape[1] - 1)], 0)
    hi = np.where(seen, np.minimum(bs, ctx[req][:, None] - blk * bs), 0)[:, None, :] * real[:, :, None]
    tok = np.where(real, starts[req][:, None] + j, T)
    if W is None:
        lo = np.zeros_like(hi)
    else:
        lo = np.clip(tok_pos[np.minimum(tok, T - 1)][:, :, None] - W + 1 - blk[:, None, :] * bs, 0, hi)
    sees = (hi > lo).any(-1)
    tok = np.where(sees, tok, T)
    keep = sees.any(-1)
    n = _round_up(int(keep.sum()), tiles_per_call(opts))

    def padded(a, fill, dtype=np.int32):  # tokens, slots and columns fit int32 (plan/arrays.py limits)
        out = np.full((n,) + a.shape[1:], fill, dtype)
        out[:int(keep.sum())] = a[keep]
        return out

    return dict(rows=padded(tok, T), blocks=padded(ids, 0, np.int64),  # block ids need 64 bits
                lo=padded(np.where(sees[..., None], lo, 0), 0), hi=padded(np.where(sees[..., None], hi, 0), 0),
                col=padded(col, 0))


def _plan_share_calls(dec: dict, T: int, bs: int, W: int | None, per_call: int) -> tuple[dict, dict]:
    """(`dec` less the tiles below: those that see their whole chunk in calls of `per_call` (`whole`: where
    they end), then the others (a request's last chunk, or cut by a window) in *tail calls* of a quarter;
    the share calls): one-row tiles of a whole chunk (every key seen, no window) that `max(2, per_call // 4)`
    tiles or more read, `per_call` rows a call against the chunk read once (the one-row call's products on a
    view repeating it: the same values and shapes). Which rows share a call follows the batch; no bit does."""
    rows, blocks = dec["rows"][:, 0], dec["blocks"]
    whole = (rows < T) & (dec["hi"][:, 0] == bs).all(-1) & (dec["lo"][:, 0] == 0).all(-1)
    full = np.flatnonzero(whole & (W is None))
    group, count = np.unique(blocks[full], axis=0, return_inverse=True, return_counts=True)[1:]
    group = group.reshape(-1)
    sel = count[group] >= max(2, per_call // 4)
    order = np.lexsort((rows[full[sel]], group[sel]))
    tiles, group = full[sel][order], group[sel][order]
    rank = np.arange(tiles.size) - np.searchsorted(group, group)  # the tile's place among its chunk's readers
    new = rank % per_call == 0  # the first row of a call
    call = np.cumsum(new) - 1
    share_rows, share_col = np.full((2, int(new.sum()), per_call), [[[T]], [[0]]], np.int32)  # no row; column 0
    share_rows[call, rank % per_call], share_col[call, rank % per_call] = rows[tiles], dec["col"][tiles]
    keep = np.flatnonzero((rows < T) & ~np.isin(np.arange(rows.size), tiles))
    keep = keep[np.argsort(~whole[keep], kind="stable")]
    nw = int(whole[keep].sum())
    parts = ((keep[:nw], _round_up(nw, per_call)), (keep[nw:], _round_up(keep.size - nw, max(1, per_call // 4))))
    rest = {k: np.concatenate([x for i, n in parts for x in (a[i], np.full((n - i.size,) + a.shape[1:],
                                                                          T if k == "rows" else 0, a.dtype))])
            for k, a in dec.items()}
    rest["whole"], rest["real"] = parts[0][1], (nw, keep.size - nw)
    return rest, dict(rows=share_rows, blocks=blocks[tiles[new]], col=share_col,
                      real=tuple(np.bincount(call, minlength=share_rows.shape[0]).tolist()))


def _plan_causal_tiles(q, starts, W, opts, sel):
    """(query tile a, key tile b <= a) of each request of `sel` with two or more new tokens, tiles
    counted from the request's first token; padded to a multiple of `invariant_causal_chunk`."""
    c = opts.causal_tile
    n_tiles = np.where((q >= 2) & sel, -(-q // c), 0)
    a, a_req = ranges(np.zeros_like(q), n_tiles)
    first_b = np.zeros_like(a) if W is None else np.maximum(a * c - W + 1, 0) // c
    check_causal_tiles(int((a - first_b + 1).sum()), c)
    b, owner = ranges(first_b, a - first_b + 1)
    req, a = a_req[owner], a[owner]
    n = _round_up(b.size, opts.invariant_causal_chunk)
    T = int(q.sum())

    def padded(x, fill):
        return np.concatenate([x, np.full(n - x.size, fill)]).astype(np.int32)

    return padded(starts[req] + a * c, T), padded(starts[req] + b * c, 0), padded(b, 0)


def pad_invariant(plan: InvariantPlan, bucket: Bucket) -> InvariantPlan:
    """`pad_plan` for an invariant plan: empty tiles and rows, never a changed real one (extra cached
    tiles are one-row tiles; the fast route's arrays list real tokens only and stay)."""
    check_covers(bucket, plan.shape)
    T, Tp = plan.bucket.query_len, bucket.query_len
    rows = lambda a: move_no_row(a, T, Tp)  # noqa: E731

    nd = bucket.num_shared_blocks - plan.pre_rows.shape[0] - plan.unit_rows.shape[0] - int((plan.share_rows < T).sum())
    nc, nq = bucket.num_causal_tiles, bucket.num_unique_blocks
    empty = np.zeros(0, np.int32)
    return replace(
        plan, bucket=bucket,
        token_seg_start=np.concatenate([plan.token_seg_start, np.arange(T, Tp, dtype=np.int32)]),
        causal_q_start=grow(rows(plan.causal_q_start), nc, Tp), causal_k_start=grow(plan.causal_k_start, nc, 0),
        causal_col=grow(plan.causal_col, nc, 0),
        dec_rows=grow(rows(plan.dec_rows), nd, Tp), dec_blocks=grow(plan.dec_blocks, nd, 0),
        dec_lo=grow(plan.dec_lo, nd, 0), dec_hi=grow(plan.dec_hi, nd, 0), dec_col=grow(plan.dec_col, nd, 0),
        pre_rows=rows(plan.pre_rows), unit_rows=rows(plan.unit_rows), share_rows=rows(plan.share_rows),
        slot_starts=grow(plan.slot_starts, Tp + 1, plan.slot_rows.size), slot_take=grow(plan.slot_take, Tp, 0),
        # A bucket made for the default mode may have unique slots: empty ones, never read.
        unique_rows=np.full(nq, Tp, np.int32), unique_blocks=np.zeros(nq, np.int32) if nq else empty,
        unique_lo=np.zeros(nq, np.int32), unique_hi=np.zeros(nq, np.int32),
        logits_indices=grow(plan.logits_indices, bucket.num_logits, 0))
