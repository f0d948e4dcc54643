"""Step shapes of a trace: each recorded step replayed through the core planner's rules.

Bucketing never guesses a step's shape: it is the `StepPlan.shape` that
`plan_step` gives the step (plus the score work the step needs, for the
algorithm-vs-padding split). Two ways to get it, with identical results:

- `exact=True`: run `plan_step` itself on every step (~1 ms a step: it builds
  every index array the device needs);
- the default, *shape-only* replay (`batch_shapes`): the planner's own rules
  (`plan/rules.py`: which pairs are shared, the unique layout, the shared
  grouping with its hash and fallback, the causal tile spans), applied to a
  whole batch of steps at once and only counted, not built into arrays, from trace lines parsed straight into numpy (no
  per-request Python): about 3x faster end to end on a 10 000-step trace.
  Steps it does not model (a sliding window, batch-invariant options, a line
  in another layout, negative block ids) go through `plan_step`.
  `tests/test_bucket_shapes.py` checks it against `plan_step` step by step,
  and `benchmarks/bucketing_goals.py` on every trace it uses.

Long traces are cut into chunks replayed by worker processes.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from vllm_gaudi_unified.bucket import Bucket, bucket_from_sizes, codes_of
from vllm_gaudi_unified.bucket_plans.cost import DIMS
from vllm_gaudi_unified.bucket_plans.settings import ServerSettings
from vllm_gaudi_unified.bucket_plans.trace import Trace, TraceError, TraceStep, step_from_json, step_lines
from vllm_gaudi_unified.plan import plan_step
from vllm_gaudi_unified.plan.arrays import MAX_POSITION, MAX_STEP_TOKENS, ranges
from vllm_gaudi_unified.plan.rules import (causal_spans, group_columns, segment_starts, shared_pairs, shared_tiles,
                                           unique_reads_slice)

@dataclass
class StepShapes:
    """The shapes of many steps, as arrays."""

    sizes: np.ndarray  #: int64 [N, 5] unpadded shape of each step, DIMS order
    needed: np.ndarray  #: int64 [N, 3] score pairs the step needs (causal incl. self, shared, unique)
    block_size: int
    sources: tuple = ()  #: trace paths they came from

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def codes(self) -> np.ndarray:
        return codes_of(self.sizes)

    @staticmethod
    def concat(parts: list["StepShapes"]) -> "StepShapes":
        if not parts:
            raise TraceError("no steps to learn from")
        sizes = {p.block_size for p in parts}
        if len(sizes) > 1:
            raise TraceError(f"traces with different block sizes {sorted(sizes)} cannot make one plan")
        return StepShapes(np.concatenate([p.sizes for p in parts]), np.concatenate([p.needed for p in parts]),
                          parts[0].block_size, tuple(s for p in parts for s in p.sources))

    def buckets(self) -> list[Bucket]:
        return [bucket_from_sizes(s) for s in self.sizes]


def _exact_shape(step: TraceStep, settings: ServerSettings) -> tuple[tuple, tuple]:
    """Sizes and needed pairs of one step, from `plan_step` itself."""
    p = plan_step(step.query_lens, step.context_lens, step.block_table(), step.block_size,
                  sliding_window=settings.sliding_window, options=settings.options)
    w = p.work_needed
    return p.shape.sizes, (w.causal, w.shared, w.unique)


# ----------------------------------------------------------------------------- shape-only replay

#: A step line as the trace writer and the vLLM recorder write it (any spacing): block size,
#: query lens, context lens and the block id rows (without the outer brackets) as groups.
_LINE = re.compile(r'\s*\{\s*"block_size"\s*:\s*(\d+)\s*,\s*"query_lens"\s*:\s*\[([^\[\]]*)\]\s*,'
                   r'\s*"context_lens"\s*:\s*\[([^\[\]]*)\]\s*,\s*"block_ids"\s*:\s*\[(.*)\]\s*\}\s*$', re.S)
_OPEN, _CLOSE, _COMMA = ord("["), ord("]"), ord(",")
_EMPTY_ROW = re.compile(r"\[\s*\]")
#: Steps replayed together: bounds the [steps x block ids] table of block uses.
_BATCH = 256


class _Arrays:
    """Many steps as flat arrays: requests of step i are `req_step == i`, in order."""

    def __init__(self, block_size, q, ctx, flat, row_starts, req_step, num_steps):
        self.block_size, self.q, self.ctx, self.flat = block_size, q, ctx, flat
        self.row_starts, self.req_step, self.num_steps = row_starts, req_step, num_steps


def _ints(text: str, count: int) -> np.ndarray | None:
    """`count` ints from comma-separated text, or None if the text is anything else."""
    if count == 0:
        return np.zeros(0, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns (and stops early) on text it cannot read
        try:
            out = np.fromstring(text, dtype=np.int64, sep=",")
        except (DeprecationWarning, ValueError):
            return None
    return out if out.size == count else None


def _parse_lines(lines: list[str], block_size: int) -> _Arrays | None:
    """Step lines straight into numpy (one parse for all of them, no per-request Python), or None
    when a line is not a valid step in the usual key order, or has another block size (the caller
    then reads them with `step_from_json`, which takes any valid JSON and raises the precise
    error)."""
    parts = [_LINE.match(line) for line in lines]
    if not all(parts):
        return None
    if any(int(m.group(1)) != block_size for m in parts):
        return None
    qs, cs, rows = [m.group(2) for m in parts], [m.group(3) for m in parts], [m.group(4) for m in parts]
    nreq = np.array([r.count("[") for r in rows], np.int64)
    total = int(nreq.sum())
    q, ctx = _ints(",".join(qs), total), _ints(",".join(cs), total)
    if q is None or ctx is None or (nreq == 0).any():
        return None
    per_line = np.array([x.count(",") + 1 for x in qs], np.int64)
    if (per_line != nreq).any() or (np.array([x.count(",") + 1 for x in cs]) != nreq).any():
        return None
    body = ",".join(rows)
    if _EMPTY_ROW.search(body):
        return None
    raw = np.frombuffer(body.encode("ascii", "replace"), np.uint8)
    opens, closes = np.flatnonzero(raw == _OPEN), np.flatnonzero(raw == _CLOSE)
    if opens.size != total or closes.size != total or (opens > closes).any() or (closes[:-1] > opens[1:]).any():
        return None
    # Before the "]" of row i stand (ints in rows 0..i) - 1 commas: each row's inner ones plus one between rows.
    ends = np.cumsum(raw == _COMMA)[closes] + 1
    flat = _ints(body.replace("[", " ").replace("]", " "), int(ends[-1]))
    if flat is None:
        return None
    row_lens = np.diff(ends, prepend=0)
    if q.min() < 1 or ctx.min() < 0 or (row_lens < -(-(q + ctx) // block_size)).any():
        return None
    if q.max() > MAX_STEP_TOKENS or ctx.max() > MAX_POSITION or flat.min() < 0 or flat.max() >= 1 << 31:
        return None  # out of range (`step_from_json` names the line and value) or ids too large to batch
    req_step = np.repeat(np.arange(len(lines)), nreq)
    return _Arrays(block_size, q, ctx, flat, ends - row_lens, req_step, len(lines))


def _arrays_of_steps(steps: list[TraceStep]) -> _Arrays:
    nreq = np.array([s.num_requests for s in steps], np.int64)
    q = np.concatenate([s.query_lens for s in steps]).astype(np.int64)
    ctx = np.concatenate([s.context_lens for s in steps]).astype(np.int64)
    rows = [b for s in steps for b in s.block_ids]
    row_lens = np.fromiter((len(b) for b in rows), np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, count=int(row_lens.sum()))
    return _Arrays(steps[0].block_size, q, ctx, flat, np.cumsum(row_lens) - row_lens,
                   np.repeat(np.arange(len(steps)), nreq), len(steps))


def shape_only_supported(settings: ServerSettings) -> bool:
    """Whether `batch_shapes` models these settings (not a window, the invariant mode or verify units)."""
    return settings.sliding_window is None and not settings.options.batch_invariant and settings.options.unique_tokens == 1


def batch_shapes(a: _Arrays, options) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: sizes [N, 5] (DIMS order) equal to `plan_step(...).shape.sizes`, needed pairs
    [N, 3] equal to its `work_needed` (causal incl. self, shared, unique), and a bool [N] of
    steps to hand to `plan_step` instead (a negative block id, which it rejects, or a user-set
    hash collision, where it falls back to one shared group per block). No sliding window.

    The rules are `plan/rules.py`'s, the ones `plan_step` applies, here to every step at once
    (each step a segment) and counted: (request, block) pairs below each context
    (`shared_pairs`), the unique slots (`unique_reads_slice`: one per live block, or the slice
    `[0, max id]`), the shared groups (`group_columns`) and their tiles (`shared_tiles`), the
    causal tiles (`causal_spans`)."""
    bs, q, ctx, n = int(a.block_size), a.q, a.ctx, a.num_steps
    req_step = a.req_step
    R = np.bincount(req_step, minlength=n)
    T = np.bincount(req_step, weights=q, minlength=n).astype(np.int64)
    local_req = np.arange(q.size) - (np.cumsum(R) - R)[req_step]
    nb_ctx = (ctx + bs - 1) // bs
    ends = np.cumsum(nb_ctx)
    pair_req = np.repeat(np.arange(q.size), nb_ctx)
    pair_blk = np.arange(pair_req.size) - np.repeat(ends - nb_ctx, nb_ctx)  # block's index in its request
    phys = a.flat[pair_blk + np.repeat(a.row_starts, nb_ctx)]
    pair_step = np.repeat(req_step, nb_ctx)
    fallback = np.zeros(n, bool)
    if phys.size and phys.min() < 0:
        fallback[pair_step[phys < 0]] = True
        phys = np.maximum(phys, 0)
    pair_hi = np.full(pair_req.size, bs, np.int64)  # visible slots: all but in a request's last block
    has = nb_ctx > 0
    last = ends[has] - 1
    pair_hi[last] = ctx[has] - pair_blk[last] * bs
    span = int(phys.max()) + 1 if phys.size else 1
    is_shared = shared_pairs(pair_step * span + phys, q, nb_ctx)

    # unique
    uniq = ~is_shared
    u_step, u_phys = pair_step[uniq], phys[uniq]
    n_ids = np.bincount(u_step, minlength=n)
    max_id = np.full(n, -1, np.int64)
    if u_step.size:
        starts = segment_starts(u_step)
        max_id[u_step[starts]] = np.maximum.reduceat(u_phys, starts)
    use_slice = unique_reads_slice(n_ids, max_id, options)
    num_unique = np.where(n_ids == 0, 0, np.where(use_slice, max_id + 1, n_ids))
    unique_needed = np.bincount(u_step, weights=pair_hi[uniq], minlength=n).astype(np.int64)

    # shared
    kb = options.blocks_per_tile(bs)
    s_step, s_phys, s_blk, s_req = pair_step[is_shared], phys[is_shared], pair_blk[is_shared], pair_req[is_shared]
    shared_needed = np.bincount(s_step, weights=q[s_req] * pair_hi[is_shared], minlength=n).astype(np.int64)
    tiles_per_step = np.zeros(n, np.int64)
    if s_step.size:
        blk_span = int(s_blk.max()) + 1
        col_key = (s_step * span + s_phys) * blk_span + s_blk
        order = np.argsort(col_key, kind="stable")
        col_key = col_key[order]
        req_sorted = s_req[order]
        col_start = segment_starts(col_key)
        col_users = np.diff(np.r_[col_start, order.size])
        col_step = s_step[order][col_start]
        col_group, bad = group_columns(col_step, req_sorted, local_req[req_sorted], col_start, col_users)
        G = int(col_group.max()) + 1
        if bad.any():  # plan_step falls back to one group per column there: it plans those steps itself
            fallback[col_step[bad]] = True
        col_tokens = np.add.reduceat(q[req_sorted], col_start)
        g_tokens = np.zeros(G, np.int64)
        g_tokens[col_group] = col_tokens
        g_cols = np.bincount(col_group, minlength=G)
        g_step = np.zeros(G, np.int64)
        g_step[col_group] = col_step
        tiles = shared_tiles(g_tokens, g_cols, options, bs)
        tiles_per_step = np.bincount(g_step, weights=tiles, minlength=n).astype(np.int64)

    # causal: per query tile, key tiles from the first to the last key its tokens need
    tile = options.causal_tile
    causal_needed = np.bincount(req_step, weights=q * (q + 1) // 2, minlength=n).astype(np.int64)
    causal_tiles = np.zeros(n, np.int64)
    multi = q > 1
    if multi.any():
        steps_c = np.flatnonzero(np.bincount(req_step[multi], minlength=n) > 0)
        in_c = np.isin(req_step, steps_c)
        cq, c_step = q[in_c], req_step[in_c]
        tok_j, tok_req = ranges(np.zeros_like(cq), cq)
        tok_step = c_step[tok_req]
        first_tok = np.zeros(n, np.int64)
        first_tok[steps_c] = np.cumsum(T[steps_c]) - T[steps_c]
        t = np.arange(tok_j.size) - first_tok[tok_step]  # position in the step's flattened tokens
        first, active, first_k, last_k = causal_spans(tok_step * (int(T.max()) // tile + 1) + t // tile, t,
                                                      t - tok_j, tok_j >= 1, tile)
        count = np.where(active, last_k - first_k + 1, 0)
        causal_tiles = np.bincount(tok_step[first], weights=count, minlength=n).astype(np.int64)

    sizes = np.stack([T, tiles_per_step * kb, num_unique, R, causal_tiles], 1)
    needed = np.stack([causal_needed, shared_needed, unique_needed], 1)
    return sizes, needed, fallback


def _shape_rows(items, settings: ServerSettings, exact: bool, where: str,
                numbers: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sizes and needed work of steps given as trace lines (str, at line `numbers` of `where`) or TraceSteps."""
    n = len(items)
    sizes = np.zeros((n, len(DIMS)), np.int64)
    needed = np.zeros((n, 3), np.int64)
    todo = np.ones(n, bool)  # steps still to do through plan_step
    if not exact and shape_only_supported(settings):
        for lo in range(0, n, _BATCH):
            part = items[lo:lo + _BATCH]
            if isinstance(part[0], str):
                arrays = _parse_lines(part, settings.block_size)
            elif all(s.block_size == settings.block_size for s in part):
                arrays = _arrays_of_steps(part)
            else:
                arrays = None
            if arrays is None:
                continue
            s, w, fb = batch_shapes(arrays, settings.options)
            sizes[lo:lo + len(part)], needed[lo:lo + len(part)] = s, w
            todo[lo:lo + len(part)] = fb
    for i in np.flatnonzero(todo):
        item, at = items[i], where if numbers is None else f"{where}:{numbers[i]}"
        step = step_from_json(_json(item, at), at) if isinstance(item, str) else item
        _check_block_size(step.block_size, settings, at)
        sizes[i], needed[i] = _exact_shape(step, settings)
    return sizes, needed


def _plan_lines(args) -> tuple[np.ndarray, np.ndarray]:
    lines, settings, where, exact, numbers = args
    return _shape_rows(lines, settings, exact, where, numbers)


def shapes_of_steps(steps: list[TraceStep], settings: ServerSettings, source: str = "",
                    exact: bool = False) -> StepShapes:
    """Shapes of steps held in memory (e.g. from the simulator); `exact`: through `plan_step`."""
    if not steps:
        raise TraceError(f"{source or 'trace'}: the trace holds no scheduler step")
    _check_block_size(steps[0].block_size, settings, source)
    sizes, needed = _shape_rows(steps, settings, exact, source)
    return StepShapes(sizes, needed, steps[0].block_size, (source,) if source else ())


def shapes_of_trace(trace: str | Trace, settings: ServerSettings, jobs: int | None = None,
                    progress: bool = False, chunk: int = 1000, exact: bool = False) -> StepShapes:
    """Replay every step of a trace (a path or a read Trace); `exact`: through `plan_step`."""
    if isinstance(trace, Trace):
        return shapes_of_steps(trace.steps, settings, trace.path or "", exact)
    lines, numbers = step_lines(trace)
    if not lines:
        raise TraceError(f"{trace}: the trace holds no scheduler step")
    first = f"{trace}:{numbers[0]}"
    _check_block_size(step_from_json(_json(lines[0], first), first).block_size, settings, first)
    chunks = [(lines[i:i + chunk], settings, trace, exact, numbers[i:i + chunk])
              for i in range(0, len(lines), chunk)]
    jobs = min(jobs or os.cpu_count() or 1, len(chunks))
    bar = _bar(len(lines), f"planning {os.path.basename(trace)}", progress)
    results = []
    if jobs <= 1:
        for c in chunks:
            results.append(_plan_lines(c))
            bar.update(len(c[0]))
    else:
        # The workers ignore SIGINT: a Ctrl-C reaches the whole process group, and only this process says
        # it was interrupted (one line); the queued chunks are dropped instead of run to the end. SIGINT
        # is held while the workers fork: one arriving then would otherwise hit a fork hook, where Python
        # prints and drops the KeyboardInterrupt, in a child that does not ignore it yet and here.
        with _sigint_held():
            pool = ProcessPoolExecutor(jobs, initializer=_ignore_sigint)
            planned = pool.map(_plan_lines, chunks)  # submits every chunk: the fork context forks here
        try:
            for c, r in zip(chunks, planned):
                results.append(r)
                bar.update(len(c[0]))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    bar.close()
    return StepShapes(np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results]),
                      settings.block_size, (trace,))


@contextlib.contextmanager
def _sigint_held():
    """A SIGINT meanwhile is recorded, and raised again on leaving (Python runs handlers in the main
    thread, whichever thread takes the signal: one that only records keeps it from the fork hooks)."""
    got = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: got.append(True))
    except ValueError:  # not the main thread: signals are not delivered here anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if got and previous is not signal.SIG_IGN:
            signal.raise_signal(signal.SIGINT)


def _ignore_sigint() -> None:
    """A worker's initializer: ignore SIGINT (until then: the recorder inherited from `_sigint_held`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _json(line: str, where: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None


def _check_block_size(block_size: int, settings: ServerSettings, source: str) -> None:
    if block_size != settings.block_size:
        raise TraceError(f"{source}: trace block_size {block_size} differs from the settings' block_size "
                         f"{settings.block_size}")


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False)
