"""Timing and memory: device events on CUDA (median, warmed up, L2 flushed), a host clock on CPU.

On CUDA a callable is timed as a replayed CUDA graph when `graph=True` (the
stand-in for an HPU graph per bucket: no launch gaps) and as plain eager calls
otherwise. `triton.testing.do_bench` is used when Triton is there; else CUDA
events around each call with a 256 MB buffer written in between to flush L2.
"""
from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture(fn, device: torch.device):
    """Warm `fn` up, capture it in a CUDA graph; returns (replay, output buffer of the captured call)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    sync(device)
    return graph.replay, out


def time_ms(fn, device: torch.device, *, reps: int = 50, warmup_ms: float = 25, rep_ms: float = 150) -> float:
    """Median milliseconds of one call."""
    if device.type != "cuda":
        for _ in range(2):
            fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    try:
        from triton.testing import do_bench
    except ImportError:  # pragma: no cover - CUDA without Triton
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=device)  # pragma: no cover
    for _ in range(3):  # pragma: no cover
        fn()
    times = []  # pragma: no cover
    for _ in range(reps):  # pragma: no cover
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)  # pragma: no cover


def host_ms(fn, reps: int = 5) -> tuple[float, object]:
    """Median host milliseconds of `fn()` (planning, copies with a sync inside) and its last result."""
    samples, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), out


def peak_bytes(fn, device: torch.device) -> int | None:
    """Device memory a call allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)
