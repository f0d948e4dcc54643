"""Where a plan's arrays live: new arrays per call, or host memory kept from step to step.

Why keep memory: on the 2-core host a step's fresh arrays cost more in page
faults than in arithmetic (the mixed 8192-token step of `benchmarks/planning.py`
faulted ~700 pages a call, about 2 ms, more than all its numpy work), and a
graph replay wants its inputs at the same address every step. A server plans
into `PlanBuffers` (the vLLM metadata builder does, through `batch.StepBuffers`,
which copies them to the device in one copy); a plan made into buffers holds
views of them and is valid until the next plan into the same buffers.
"""
from __future__ import annotations

from math import prod

import numpy as np

_I64 = np.int64


class FreshArrays:
    """New arrays on every call (the default): a plan owns its arrays."""

    def array(self, name: str, shape, dtype=_I64) -> np.ndarray:
        """Uninitialised `shape` array for the plan field (or scratch) `name`."""
        return np.empty(shape, dtype)

    def zeros(self, name: str, shape, dtype=_I64) -> np.ndarray:
        return np.zeros(shape, dtype)

    def full(self, name: str, shape, value, dtype=_I64) -> np.ndarray:
        return np.full(shape, value, dtype)

    def keep(self, name: str, values: np.ndarray) -> np.ndarray:
        """`values` as the array `name` (no copy: the plan may own them)."""
        return values

    def holds(self, name: str, values: np.ndarray) -> bool:
        """`values` is the array last handed out as `name` (so it already lives here)."""
        return False

    def scratch(self, name: str, n: int, dtype) -> np.ndarray:
        """Uninitialised working memory of `n` elements, never part of a plan."""
        return np.empty(n, dtype)


FRESH = FreshArrays()


class PlanBuffers(FreshArrays):
    """One growing 1-D host buffer per array name; `array(name, shape)` is a view of its first elements.

    `reserve` sizes buffers up front (a bucket plan's largest bucket), so a server's steps never
    allocate; a step that needs more grows the buffer, keeping its content, which is what lets
    `pad_plan` pad a plan in place."""

    def __init__(self, reserve: dict[str, int] | None = None):
        self._buffers: dict[str, np.ndarray] = {}
        self._views: dict[str, np.ndarray] = {}  # the last array handed out per name
        self._scratch: dict[str, np.ndarray] = {}  # plain numpy: never copied to a device, never pinned
        for name, n in (reserve or {}).items():
            self._grow(name, n, _I64)

    def array(self, name, shape, dtype=_I64):
        flat = type(shape) is int
        n = shape if flat else prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._grow(name, n, dtype)
        view = self._views[name] = buf[:n] if flat else buf[:n].reshape(shape)
        return view

    def zeros(self, name, shape, dtype=_I64):
        a = self.array(name, shape, dtype)
        a.fill(0)
        return a

    def full(self, name, shape, value, dtype=_I64):
        a = self.array(name, shape, dtype)
        a.fill(value)
        return a

    def keep(self, name, values):
        if values is self._views.get(name):
            return values
        a = self.array(name, values.size if values.ndim == 1 else values.shape, values.dtype)  # (an int: no reshape)
        np.copyto(a, values)
        return a

    def holds(self, name, values):
        return values is self._views.get(name)

    def scratch(self, name, n, dtype):
        buf = self._scratch.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._scratch[name] = np.empty(max(n, 16, 0 if buf is None else 2 * buf.size), dtype)
        return buf[:n]

    def buffer(self, name: str) -> np.ndarray | None:
        """The whole buffer behind `name` (None before its first use)."""
        return self._buffers.get(name)

    def _grow(self, name, n, dtype):
        old = self._buffers.get(name)
        new = np.empty(max(n, 16, 0 if old is None else 2 * old.size), dtype)
        if old is not None and old.dtype == dtype:
            new[: old.size] = old  # a plan being padded keeps its content
        self._buffers[name] = new
        return new

