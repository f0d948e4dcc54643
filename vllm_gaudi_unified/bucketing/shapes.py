"""Step shapes of a trace: each recorded step replayed through the core planner.

Bucketing never guesses a step's shape: it runs `plan_step` on the step exactly
as the attention backend will, and keeps `StepPlan.shape` (plus the score work
the step needs, for the algorithm-vs-padding split). Replaying is ~1 ms a step,
so long traces are cut into chunks planned by worker processes.
"""
from __future__ import annotations

import gzip
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from vllm_gaudi_unified.bucket import Bucket
from vllm_gaudi_unified.bucketing.cost import DIMS
from vllm_gaudi_unified.bucketing.settings import ServerSettings
from vllm_gaudi_unified.bucketing.trace import Trace, TraceError, TraceStep, read_trace, step_from_json
from vllm_gaudi_unified.plan import PlanOptions, plan_step

#: Phase strings indexed by their code: bit 4 = causal, 2 = shared, 1 = unique.
PHASES = tuple("".join(p if code & bit else "-" for p, bit in zip("csu", (4, 2, 1))) for code in range(8))


def phase_code(phase: str) -> int:
    return (4 if phase[0] == "c" else 0) | (2 if phase[1] == "s" else 0) | (1 if phase[2] == "u" else 0)


def codes_of(sizes: np.ndarray) -> np.ndarray:
    """Phase codes of shapes [N, 5] (DIMS order)."""
    s = np.asarray(sizes)
    return ((s[:, 4] > 0) * 4 + (s[:, 1] > 0) * 2 + (s[:, 2] > 0) * 1).astype(np.int64)


def bucket_from_sizes(sizes) -> Bucket:
    q, s, u, l, c = (int(x) for x in sizes)
    return Bucket(PHASES[(c > 0) * 4 + (s > 0) * 2 + (u > 0)], q, s, u, l, c)


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


def _plan_steps(steps: list[TraceStep], settings: ServerSettings) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.zeros((len(steps), len(DIMS)), np.int64)
    needed = np.zeros((len(steps), 3), np.int64)
    for i, s in enumerate(steps):
        p = plan_step(s.query_lens, s.context_lens, s.block_table(), s.block_size,
                      sliding_window=settings.sliding_window, options=settings.options)
        sizes[i] = p.shape.sizes
        w = p.work_needed
        needed[i] = (w.causal, w.shared, w.unique)
    return sizes, needed


def _plan_lines(args) -> tuple[np.ndarray, np.ndarray]:
    lines, settings, where = args
    steps = [step_from_json(json.loads(line), where) for line in lines]
    return _plan_steps(steps, settings)


def _read_step_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        raise TraceError(f"{path}: no such trace file")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line for line in f if '"query_lens"' in line]


def shapes_of_steps(steps: list[TraceStep], settings: ServerSettings, source: str = "") -> StepShapes:
    if not steps:
        raise TraceError(f"{source or 'trace'}: the trace holds no scheduler step")
    _check_block_size(steps[0].block_size, settings, source)
    sizes, needed = _plan_steps(steps, settings)
    return StepShapes(sizes, needed, steps[0].block_size, (source,) if source else ())


def shapes_of_trace(trace: str | Trace, settings: ServerSettings, jobs: int | None = None,
                    progress: bool = False, chunk: int = 500) -> StepShapes:
    """Replay every step of a trace (a path or a read Trace) through `plan_step`."""
    if isinstance(trace, Trace):
        return shapes_of_steps(trace.steps, settings, trace.path or "")
    lines = _read_step_lines(trace)
    if not lines:
        raise TraceError(f"{trace}: the trace holds no scheduler step")
    _check_block_size(int(json.loads(lines[0])["block_size"]), settings, trace)
    chunks = [(lines[i:i + chunk], settings, trace) for i in range(0, len(lines), chunk)]
    jobs = min(jobs or os.cpu_count() or 1, len(chunks))
    bar = _bar(len(lines), f"planning {os.path.basename(trace)}", progress)
    results = []
    if jobs <= 1:
        for c in chunks:
            results.append(_plan_lines(c))
            bar.update(len(c[0]))
    else:
        with ProcessPoolExecutor(jobs) as pool:
            for c, r in zip(chunks, pool.map(_plan_lines, chunks)):
                results.append(r)
                bar.update(len(c[0]))
    bar.close()
    block_sizes = {int(json.loads(c[0][0])["block_size"]) for c in chunks}
    if len(block_sizes) > 1:
        raise TraceError(f"{trace}: steps with different block sizes {sorted(block_sizes)}")
    return StepShapes(np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results]),
                      settings.block_size, (trace,))


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
