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
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np


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


def step_from_json(obj: dict, where: str = "") -> TraceStep:
    try:
        q = np.asarray(obj["query_lens"], dtype=np.int64)
        c = np.asarray(obj["context_lens"], dtype=np.int64)
        b = obj["block_ids"]
        bs = int(obj["block_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{where}: not a trace step ({exc!r})") from None
    if not (len(q) == len(c) == len(b)) or len(q) == 0:
        raise TraceError(f"{where}: query_lens, context_lens and block_ids must have the same non-zero length")
    if bs <= 0:
        raise TraceError(f"{where}: block_size must be positive, got {bs}")
    if (q < 1).any() or (c < 0).any():
        raise TraceError(f"{where}: query_lens must be >= 1 and context_lens >= 0")
    need = -(-(q + c) // bs)
    have = np.fromiter((len(x) for x in b), dtype=np.int64, count=len(b))
    if (have < need).any():
        r = int(np.argmax(have < need))
        raise TraceError(f"{where}: request {r} has {have[r]} block ids for {q[r] + c[r]} tokens (needs {need[r]})")
    return TraceStep(bs, q, c, b)


def iter_trace(path: str) -> Iterator[TraceStep | dict]:
    """Yield the header dict (if any) first, then each step."""
    with _open_text(path, "r") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if "trace_header" in obj:
                yield dict(obj["trace_header"])
            elif "query_lens" in obj:
                yield step_from_json(obj, f"{path}:{lineno}")


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
        self._f = _open_text(path, "a" if append else "w")
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
        self._f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
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
