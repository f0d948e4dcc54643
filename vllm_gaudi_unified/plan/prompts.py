"""The prompt route: a request's new tokens over its own cached context, as one padded batch.

A prompt or a chunk of one (two or more new tokens) reads its whole context
and its own new keys, causal and bottom-right aligned. The tiled paths cut
that into thousands of small tiles and merge them; vllm-gaudi runs it as one
FusedSDPA call over the context blocks gathered in front of the new keys
(`_include_past`). The prompt route does the same: each such request is one
row of a padded batch `[num_prompts, prompt_len]` of query tokens against its
`prompt_blocks` context blocks followed by its new keys, one fused SDPA call
for all of them (`paths/prompts.py`); the rows come out final, with no merge.

Which requests take it (`prompt_requests`, identical on every device):

* two or more new tokens, more than `PlanOptions.unique_tokens` (a verify step's 1 + k stay on
  the unique path, read once per request: `plan/default.py`) (and, once some request takes it, a one-token prompt
  without context, so that a step of prompts alone is that one call), no sliding window (the window's first-slot cut is
  the tiled paths' job), `PlanOptions.prompt_route == "dense"`;
* but not a short draft (fewer than `PROMPT_MIN_SHARED_ROWS` tokens) over
  blocks another request of the step also reads: speculative decodes or
  parallel samples over a common prefix keep the shared tiles, which read that
  prefix once for all of them instead of once per request.

A decode (one new token) never takes it: its context goes to the unique and
shared paths as before, so a decode step's plan is unchanged.
"""
from __future__ import annotations

import numpy as np

from vllm_gaudi_unified.plan.arrays import empty, same_id_sum

_I64 = np.int64

#: A request with fewer new tokens whose context another request also reads stays on the shared tiles.
PROMPT_MIN_SHARED_ROWS = 16


def prompt_requests(q: np.ndarray, ctx: np.ndarray, pair_req: np.ndarray, phys: np.ndarray,
                    max_block_id: int, unit_tokens: int = 1) -> np.ndarray:
    """Bool `[R]`: the requests the prompt route takes (module docstring); `pair_req`/`phys` are the
    step's (request, cached block) pairs (`arrays.cached_pairs`); requests of at most `unit_tokens` new
    tokens (`PlanOptions.unique_tokens`: a verify step's) stay on the unique units."""
    sel = q > max(1, unit_tokens)
    if not sel.any():
        return sel
    sel |= (q == 1) & (ctx == 0)  # a one-token prompt: with it, a step of prompts is one call and nothing else
    if phys.size == 0:
        return sel
    # (not in a unit bucket: there every request of more new tokens than a unit takes this route, so the
    # units hold all the others' new pairs, `paths/unique.py: units_hold_requests`)
    short = sel & (q < PROMPT_MIN_SHARED_ROWS) & (unit_tokens == 1)
    if short.any():
        common = same_id_sum(phys, max_block_id) > 1  # a block listed by two requests (ids are per request)
        sharing = np.bincount(pair_req[common], minlength=q.size) > 0
        sel &= ~(short & sharing)
    return sel


#: The grid's rows x context keys (`P * Qp * Cb * block_size`) from which the device runs the prompt call split
#: (context keys, then the new keys `is_causal`: `paths/prompts.py: split_context`). Below it the second call,
#: the merge and the copies cost more than the masked pairs they save: measured on an H100 over 200 steps of
#: the chat trace (docs/benchmarks.md; 32 query heads), the split form lost 20-100 us a
#: step up to 2M such pairs and won from 4M (2 x 2k over 6k, 25M: 1.69 -> 1.24 ms).
SPLIT_MIN_PAIRS = 1 << 22

#: What a prompt's pair costs on the tiled paths, in prompt-grid pairs (`fill_grid`). The grid is one
#: fused SDPA call; the tiles are many small masked products, gathers and a merge, and a step of prompts
#: alone has no tiles at all. Measured on an H200 on the Gaudi route (CUDA graphs, 32/8/128, bf16): four
#: ragged prompts without context (100/1.5k/3k/700 tokens) take 1.1 ms in one grid of 18M pairs and 5.7 ms
#: with three of them (1.5M causal pairs) on the tiles; ragged chunks (256/1k/1.9k/700 over
#: 7k/300/1.5k/0) 4.0 ms in one grid and 7.5 ms with three of them (~7M pairs, mostly context) on the
#: tiles; a 2k chunk over 6k beside eight 40-token questions over 3k documents 8.3 ms in one grid of
#: 151M pairs and 4.6 ms with the questions on the tiles. A request moves to the tiles only where the
#: grid it no longer pads saves more than its pairs there and `TILES_CALL_COST` (about 0.8 ms: one
#: prompt of 100 tokens on the tiles beside three in the grid costs that much more than all four in it).
#: Grids under `GRID_MIN_PAIRS` pairs stay whole. On the 18 of steps 300-499 of the shared chat and RAG
#: traces where the rules differ: 52.4 / 56.8 ms with the grid kept 2/3 real, 41.7 / 47.2 ms with these.
TILED_CAUSAL_COST = 60
TILED_CONTEXT_COST = 15
TILES_CALL_COST = 1 << 24
GRID_MIN_PAIRS = 1 << 20


def grid_pairs(P, Qp, Cb, block_size: int):
    """(query row, key) pairs the device computes for a prompt grid `[P, Qp]` over `Cb` context blocks,
    in the final form: every row against every context key, and the new keys in an `is_causal` call
    (the lower triangle: a fused kernel skips the tiles above the diagonal) where the call has no
    context or runs split (`SPLIT_MIN_PAIRS`), else in one call with a bias (the whole square).
    Elementwise over arrays of grids (`fill_grid`'s candidates)."""
    ctx_pairs = P * Qp * Cb * block_size
    causal = (Cb == 0) | (ctx_pairs >= SPLIT_MIN_PAIRS)
    return ctx_pairs + P * np.where(causal, Qp * (Qp + 1) // 2, Qp * Qp)


def fill_grid(sel: np.ndarray, q: np.ndarray, nb_ctx: np.ndarray, block_size: int) -> np.ndarray:
    """The requests of `sel` (the prompt route's, `prompt_requests`) that stay in its one grid: its
    largest ones (by pairs), as many as make the grid plus the tiles of the rest cheapest
    (`TILED_CAUSAL_COST`, `TILED_CONTEXT_COST`, `TILES_CALL_COST`); the others take the tiled paths.
    The grid pads every prompt to the longest prompt and the most context blocks, so short questions
    beside a 2k chunk over a long document would each cost as much as that chunk."""
    idx = np.flatnonzero(sel)
    if idx.size < 2:
        return sel
    qs, cb = q[idx].astype(np.int64), nb_ctx[idx].astype(np.int64)
    causal = qs * (qs + 1) // 2
    context = qs * cb * block_size  # (context in whole blocks: what a grid row reads)
    order = np.argsort(-(causal + context), kind="stable")
    k = np.arange(1, idx.size + 1)
    grid = grid_pairs(k, np.maximum.accumulate(qs[order]), np.maximum.accumulate(cb[order]), block_size)
    if grid[-1] < GRID_MIN_PAIRS:
        return sel
    tiled = (TILED_CAUSAL_COST * causal + TILED_CONTEXT_COST * context)[order]
    left_to_tiles = tiled.sum() - np.cumsum(tiled)  # the tiles' cost of the requests after the first k
    left_to_tiles[:-1] += TILES_CALL_COST
    keep = int(np.argmin(grid + left_to_tiles)) + 1
    if keep == idx.size:
        return sel
    out = np.zeros_like(sel)
    out[idx[order[:keep]]] = True
    return out


def plan_prompts(sel: np.ndarray, q: np.ndarray, ctx: np.ndarray, nb_ctx: np.ndarray, bt: np.ndarray,
                 starts: np.ndarray, T: int):
    """Arrays of the prompt route for the requests `sel`: rows `[P, Qp]` (token of each query row, left
    aligned; `T` = no row), blocks `[P, Cb]` (context blocks in order, 0 past the context), context
    lengths `[P]`, new-token counts `[P]`. Pairs needed: every prompt token against its context."""
    idx = np.flatnonzero(sel)
    if idx.size == 0:
        return (empty((0, 0)), empty((0, 0)), empty((0,)), empty((0,))), 0
    qs, cs, nbs = q[idx], ctx[idx], nb_ctx[idx]
    col = np.arange(int(qs.max()))
    rows = np.where(col < qs[:, None], starts[idx][:, None] + col, T)
    cb = int(nbs.max())
    blocks = bt[idx, :cb].astype(_I64, copy=True) if cb else empty((idx.size, 0))
    if cb:
        blocks[np.arange(cb) >= nbs[:, None]] = 0
    return (rows, blocks, cs.astype(_I64, copy=True), qs.astype(_I64, copy=True)), int(np.dot(qs, cs))


def prompt_grid(rows: np.ndarray, lengths: np.ndarray, T: int) -> bool:
    """Whether a step of prompts alone has its prompts' rows as the grid of its first rows: row `i` of
    prompt `r` is token `r * Qp + i` wherever `i < lengths[r]`, and the grid fits the step's `T` rows.

    That holds when every prompt but the last has `Qp` tokens (one prompt, or a uniform batch), as
    vllm-gaudi's runner lays prompts out (`[batch, seq_len]`). The device then takes the queries as a
    view of the step's rows and writes its output the same way, where a gather each would cost a
    pass over them (the gather was an eighth of a 4 x 2k prefill on the H100)."""
    p, qp = rows.shape
    if p == 0 or qp == 0 or p * qp > T:
        return False
    real = np.arange(qp)[None, :] < lengths[:, None]
    return bool((rows == np.arange(p * qp, dtype=rows.dtype).reshape(p, qp))[real].all())


#: `prompt_ragged`'s bound: below this share of real pairs in the padded grid, CUDA's final form takes flash
#: varlen (segments of real rows, no padding computed; `attention.prompt_flash`) instead of the grid's SDPA
#: calls. Measured on an H100 (docs/benchmarks.md, device speed): ragged chunks at 1/8 of their grid
#: took 2.50 ms as a grid against vLLM's Triton 1.72; uniform prompts (fill 1) are faster as the grid.
RAGGED_FILL = 0.5


def prompt_ragged(lengths: np.ndarray, ctx: np.ndarray, prompts: tuple, block_size: int) -> bool:
    """Whether the prompts' pairs fill less than `RAGGED_FILL` of the grid `prompts` = `(P, Qp, Cb)` pads
    them to: each of `P * Qp` rows against `Cb` context blocks and, causal, half of `Qp` new keys. A
    function of the step and its bucket (host numbers), recorded in the plan and the graph key."""
    p, qp, cb = prompts
    if p == 0 or qp == 0 or lengths.size == 0:
        return False
    n = lengths.astype(np.float64)
    real = float(np.dot(n, ctx) + np.dot(n, n + 1) / 2)
    return real < RAGGED_FILL * p * qp * (cb * block_size + (qp + 1) / 2)


def bucket_grid(prompts_only: bool, prompts: tuple, query_len: int) -> bool:
    """`prompt_grid` for a step padded to a bucket: one prompt only, so that every step padded to the
    bucket takes the same code (one graph per bucket; a bucket with several prompts would depend on
    their lengths). A step of one prompt alone starts at row 0, so its rows are the grid."""
    return prompts_only and prompts[0] == 1 and 0 < prompts[1] <= query_len


def pad_prompts(plan, bucket, T: int, Tp: int):
    """The prompt arrays of `plan` padded to `bucket` (padding prompts have no row, no context, no token)."""
    P, Qp, Cb = bucket.prompts
    rows, blocks = plan.prompt_rows, plan.prompt_blocks
    p, qp = rows.shape
    out_rows = np.full((P, Qp), Tp, _I64)
    out_rows[:p, :qp] = np.where(rows == T, Tp, rows)
    out_blocks = np.zeros((P, Cb), _I64)
    out_blocks[:p, : blocks.shape[1]] = blocks
    grow = lambda a: np.concatenate([a, np.zeros(P - a.size, _I64)])  # noqa: E731
    return dict(prompt_rows=out_rows, prompt_blocks=out_blocks, prompt_ctx=grow(plan.prompt_ctx),
                prompt_len=grow(plan.prompt_len))
