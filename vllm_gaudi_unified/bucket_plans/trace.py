"""Scheduler traces: one scheduler step a line, JSON Lines, optionally gzip'ed.

Each step line is an object with

- `block_size`: int
- `query_lens`: per request, tokens scheduled this step
- `context_lens`: per request, tokens already in the KV cache before this step
- `block_ids`: per request, the physical block ids covering `context_len + query_len`
  tokens, in order

with the requests in the step's batch order. This is exactly what vLLM hands an
attention backend's metadata builder, which is where the vLLM integration records
it. A trace may start with one *header* line `{"trace_header": {...}}` holding the
settings it was made under (simulator or server settings); readers skip any line
without `query_lens`, so recorded traces and simulated ones read the same way.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from vllm_gaudi_unified.files import AtomicFile
from vllm_gaudi_unified.plan.arrays import MAX_BLOCK_SIZE, MAX_POSITION, MAX_STEP_TOKENS

_INT64_MAX = np.iinfo(np.int64).max
#: Block ids a trace may hold (an id of 2**62 already means a corrupt trace).
MAX_BLOCK_ID = 1 << 62


@dataclass(frozen=True)
class TraceStep:
    """One scheduler step as an attention backend sees it."""

    block_size: int
    query_lens: np.ndarray  #: int64[R]
    context_lens: np.ndarray  #: int64[R]
    block_ids: list  #: R lists of physical block ids

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    def block_table(self, pad: int = 0) -> np.ndarray:
        """int32[R, max blocks] block table, rows padded with `pad` past each request's blocks."""
        width = max((len(b) for b in self.block_ids), default=0)
        table = np.full((self.num_requests, max(width, 1)), pad, dtype=np.int32)
        for r, ids in enumerate(self.block_ids):
            table[r, : len(ids)] = ids
        return table

    def to_json(self) -> dict:
        return {
            "block_size": int(self.block_size),
            "query_lens": [int(x) for x in self.query_lens],
            "context_lens": [int(x) for x in self.context_lens],
            "block_ids": [[int(x) for x in b] for b in self.block_ids],
        }


@dataclass
class Trace:
    """A list of steps plus the header they were recorded under (may be empty)."""

    steps: list[TraceStep]
    header: dict = field(default_factory=dict)
    path: str | None = None

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def block_size(self) -> int:
        return self.steps[0].block_size if self.steps else int(self.header.get("block_size", 0))


class TraceError(ValueError):
    """A trace file that cannot be used (empty, malformed, mixed block sizes)."""


def _open_text(path: str, mode: str):
    if str(path).endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _int_list(obj: dict, key: str, where: str, lo: int, hi: int) -> np.ndarray:
    """`obj[key]`, a list of JSON integers (not bools, floats or strings) in [lo, hi]."""
    values = obj[key]
    if not isinstance(values, list) or not all(type(x) is int for x in values):
        raise TraceError(f"{where}: {key} must be a list of integers, got {json.dumps(values)[:80]}")
    arr = np.array(values, dtype=object if values and max(map(abs, values)) > _INT64_MAX else np.int64)
    if arr.size and (arr.min() < lo or arr.max() > hi):
        bad = next(x for x in values if not lo <= x <= hi)
        raise TraceError(f"{where}: {key} must be >= {lo}, got {bad}" if bad < lo else
                         f"{where}: {key} must be <= {hi}, got {bad}")
    return arr.astype(np.int64)


def _block_ids(obj: dict, where: str) -> list:
    """`block_ids`: a list of lists of non-negative integers below 2**62 (one parse for all)."""
    rows = obj["block_ids"]
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise TraceError(f"{where}: block_ids must be a list of lists of block ids")
    flat = [x for r in rows for x in r]
    arr = np.array(flat) if flat else np.zeros(0, np.int64)
    if arr.dtype.kind != "i":  # floats, strings, bools, ids beyond int64 (object / uint64)
        bad = next((x for x in flat if type(x) is not int or not 0 <= x < MAX_BLOCK_ID), flat[0] if flat else None)
        raise TraceError(f"{where}: block_ids holds {json.dumps(bad)}, not a block id (an integer in "
                         f"[0, {MAX_BLOCK_ID}))")
    if arr.size and (arr.min() < 0 or arr.max() >= MAX_BLOCK_ID):
        bad = int(arr[(arr < 0) | (arr >= MAX_BLOCK_ID)][0])
        raise TraceError(f"{where}: block_ids holds {bad}, not a block id (an integer in [0, {MAX_BLOCK_ID}))")
    return rows


def step_from_json(obj, where: str = "") -> TraceStep:
    """A step line as a `TraceStep`, or a TraceError naming `where` (file:line), the key and the value."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object (a trace line is {{\"block_size\": ..., \"query_lens\": ...}})")
    missing = [k for k in ("block_size", "query_lens", "context_lens", "block_ids") if k not in obj]
    if missing:
        raise TraceError(f"{where}: not a trace step, missing {', '.join(missing)}")
    bs = obj["block_size"]
    if type(bs) is not int or not 1 <= bs <= MAX_BLOCK_SIZE:
        raise TraceError(f"{where}: block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {json.dumps(bs)}")
    q = _int_list(obj, "query_lens", where, 1, MAX_STEP_TOKENS)
    c = _int_list(obj, "context_lens", where, 0, MAX_POSITION)
    b = _block_ids(obj, where)
    if not (len(q) == len(c) == len(b)) or len(q) == 0:
        raise TraceError(f"{where}: query_lens, context_lens and block_ids must have the same non-zero length")
    if int(q.sum()) > MAX_STEP_TOKENS:
        raise TraceError(f"{where}: query_lens sum to {int(q.sum())}, more than {MAX_STEP_TOKENS} tokens a step")
    need = -(-(q + c) // bs)
    have = np.fromiter((len(x) for x in b), dtype=np.int64, count=len(b))
    if (have < need).any():
        r = int(np.argmax(have < need))
        raise TraceError(f"{where}: request {r} has {have[r]} block ids for {q[r] + c[r]} tokens (needs {need[r]})")
    return TraceStep(bs, q, c, b)


#: The `format` of a bucket plan file (bucket_plan.FORMAT; spelled here so that traces import no plans).
_PLAN_FORMAT = "vllm-gaudi-unified/bucket-plan"


def _json_line(line: str, where: str, path: str | None = None):
    """One line's JSON; a bucket plan where a trace is expected is named as such, not as invalid JSON."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        if path is not None and _is_plan(path):
            _not_a_trace(path)
        raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
    if path is not None and isinstance(obj, dict) and obj.get("format") == _PLAN_FORMAT:
        _not_a_trace(path)
    return obj


def _is_plan(path: str) -> bool:
    try:
        with _open_text(path, "r") as f:
            return f'"{_PLAN_FORMAT}"' in f.read(400)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError):
        return False


def _not_a_trace(path: str):
    raise TraceError(f"{path}: a bucket plan, not a trace (a trace is JSON Lines of scheduler steps, from "
                     "`buckets simulate` or the plugin's recording; give the plan as PLAN)")


def iter_trace(path: str) -> Iterator[TraceStep | dict]:
    """Yield the header dict (if any) first, then each step; TraceError names the file and line."""
    lineno = 0
    try:
        with _open_text(path, "r") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                obj = _json_line(line, f"{path}:{lineno}", path)
                if not isinstance(obj, dict):
                    step_from_json(obj, f"{path}:{lineno}")  # raises: not a JSON object
                if "trace_header" in obj:
                    yield dict(obj["trace_header"])
                elif "query_lens" in obj:
                    yield step_from_json(obj, f"{path}:{lineno}")
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}:{lineno + 1}: unreadable (truncated or corrupt gzip, or not text: {exc})") from None


def step_lines(path: str) -> tuple[list[str], list[int]]:
    """The step lines of a trace file, unparsed, and their line numbers (for readers that parse many at
    once); other lines must be JSON objects (headers).
    A truncated or corrupt file is a TraceError naming the file and the line."""
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such trace file")
    opener = gzip.open if path.endswith(".gz") else open
    lines, numbers, lineno = [], [], 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if '"query_lens"' in line:
                    lines.append(line)
                    numbers.append(lineno)
                elif line.strip() and not isinstance(_json_line(line, f"{path}:{lineno}", path), dict):
                    step_from_json(None, f"{path}:{lineno}")  # raises: not a JSON object
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}:{lineno + 1}: unreadable (truncated or corrupt gzip, or not text: {exc})") from None
    return lines, numbers


def read_header(path: str) -> dict:
    """The trace's header (`{"trace_header": {...}}` on its first line), or {} when it has none."""
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such trace file")
    try:
        with _open_text(path, "r") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    obj = _json_line(line, f"{path}:{lineno}", path)
                    return dict(obj["trace_header"]) if isinstance(obj, dict) and "trace_header" in obj else {}
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: unreadable (truncated or corrupt gzip, or not text: {exc})") from None
    return {}


def read_trace(path: str, limit: int | None = None) -> Trace:
    """Read a whole trace; raises TraceError if it holds no step or mixes block sizes."""
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such trace file")
    header: dict = {}
    steps: list[TraceStep] = []
    for item in iter_trace(path):
        if isinstance(item, dict):
            header = item
            continue
        steps.append(item)
        if limit is not None and len(steps) >= limit:
            break
    if not steps:
        raise TraceError(f"{path}: the trace holds no scheduler step")
    sizes = {s.block_size for s in steps}
    if len(sizes) > 1:
        raise TraceError(f"{path}: steps with different block sizes {sorted(sizes)}")
    return Trace(steps, header, path)


class TraceWriter:
    """Appends steps to a trace file, one line each; what the vLLM integration records with.

    >>> with TraceWriter("steps.jsonl.gz", header={"max_num_seqs": 256}) as w:
    ...     w.append_step(query_lens, context_lens, block_ids, block_size)
    """

    def __init__(self, path: str, header: dict | None = None, append: bool = False):
        self.path = path
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        # A new trace is written atomically: it appears whole at close(), or not at all (files.py).
        self._atomic = None if append else AtomicFile(path)
        self._f = _open_text(path, "a") if append else self._atomic.file
        self.num_steps = 0
        if header:
            self._f.write(json.dumps({"trace_header": header}) + "\n")

    def append_step(self, query_lens, context_lens, block_ids, block_size: int) -> None:
        """`block_ids`: per request, a sequence of ids (or a 2-D array holding at least the
        blocks each request needs; extra columns are cut to ceil((context+query)/block_size))."""
        q = [int(x) for x in query_lens]
        c = [int(x) for x in context_lens]
        rows = []
        for r, ids in enumerate(block_ids):
            need = -(-(q[r] + c[r]) // block_size)
            rows.append([int(x) for x in list(ids)[:need]])
        self._f.write(json.dumps({"block_size": int(block_size), "query_lens": q, "context_lens": c,
                                  "block_ids": rows}, separators=(",", ":")) + "\n")
        self.num_steps += 1

    def write(self, step: TraceStep) -> None:
        self.append_step(step.query_lens, step.context_lens, step.block_ids, step.block_size)

    def close(self) -> None:
        if self._atomic is None:
            self._f.close()
        else:
            self._atomic.commit()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self._atomic is not None:
            self._atomic.discard()  # a failed or interrupted run leaves the old file, or none
        else:
            self.close()


def write_trace(path: str, steps: Iterable[TraceStep], header: dict | None = None) -> int:
    """Write steps to `path` (gzip'ed when it ends in .gz); returns the number written."""
    with TraceWriter(path, header) as w:
        for s in steps:
            w.write(s)
        return w.num_steps


def append_step(path: str, query_lens, context_lens, block_ids, block_size: int) -> None:
    """Append one step to a trace file (opens and closes it; for occasional use)."""
    with TraceWriter(path, append=True) as w:
        w.append_step(query_lens, context_lens, block_ids, block_size)
