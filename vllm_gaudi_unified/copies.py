"""Host-to-device copies of a step's index arrays (`batch.py`).

`to_device` puts many host arrays on a device as int64 tensors in one host-to-device copy: every array is
written into one int64 host buffer at an aligned offset, the buffer is copied once, and each tensor is a view
of its slice. A copy per array costs a call and a device allocation each (~17 for a decode step, ~34 for a step
in parts); on the CPU the tensors are the arrays themselves (no copy). `KeptCopy` makes the same one copy
through memory kept from step to step (a server's steps: `batch.StepBuffers`), at the same addresses for
arrays of the same shapes.
"""
from __future__ import annotations

import numpy as np
import torch

#: Each array starts at a multiple of this many int64s (128 bytes) in the one buffer copied: every view is
#: as aligned as a tensor of its own.
ALIGN = 16


def on_cpu(device) -> bool:
    """Whether `device` (None: the host) is the CPU: tensors there are the host arrays, with no copy."""
    if device is None:
        return True
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:N, hpu)") from None


def to_device(arrays, device) -> list:
    """Each of `arrays` (numpy integer or bool arrays, any layout, or None) as an int64 tensor of its shape on
    `device` (None stays None): on the CPU (`on_cpu`) the array itself where it is int64 and contiguous, else
    an int64 copy of it; elsewhere a view of one buffer that one non-blocking host-to-device copy fills."""
    if on_cpu(device):
        return [None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
    offsets, end = packed(arrays)
    host = np.empty(end, np.int64)
    _write(host, arrays, offsets)
    return _views(torch.from_numpy(host).to(device, non_blocking=True), arrays, offsets)


def packed(arrays) -> tuple[list, int]:
    """(each array's offset in one int64 buffer, in order, at multiples of `ALIGN`; the buffer's size): a
    function of the arrays' sizes alone (None and empty arrays take no room)."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += 0 if a is None else -(-a.size // ALIGN) * ALIGN
    return offsets, end


def _write(host: np.ndarray, arrays, offsets) -> None:
    for a, at in zip(arrays, offsets):
        if a is not None and a.size:
            host[at:at + a.size] = a.reshape(-1)  # (any dtype and strides: cast and gathered in one pass)


def _views(buf: torch.Tensor, arrays, offsets) -> list:
    return [None if a is None else buf.as_strided(a.shape, _strides(a.shape), at) for a, at in zip(arrays, offsets)]


def _strides(shape: tuple) -> tuple:
    """Element strides of a C-contiguous tensor of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


class KeptCopy:
    """`to_device`'s one copy through memory kept from step to step: one int64 host block (page-locked with
    `pin`, pageable where pinning fails) and one int64 device block of its size. A step's arrays are cast
    into the host block at the offsets of `packed` and ONE non-blocking copy moves the span they use; the
    tensors are views of the device block. Offsets follow the arrays' shapes alone, so steps whose arrays
    have the same shapes (the steps padded to one bucket) get the same addresses, step after step, and a
    step allocates nothing (the views of each set of shapes are made once: `MAX_LAYOUTS`); a step larger
    than the blocks (beyond `reserve`, rare) lays out larger ones, at new addresses. The host block is
    written again only after the last copy from it is done (`wait`)."""

    #: Sets of shapes whose offsets and views are kept (a bucket plan's steps: one per bucket; unpadded steps:
    #: as many as they come, so the kept ones are dropped at this many)
    MAX_LAYOUTS = 1024

    def __init__(self, device: torch.device, pin: bool, reserve=()):
        """`reserve`: the most elements of each array (the blocks hold them all at once)."""
        self.device, self.pin = device, pin
        self._copied = None  # event after the last copy
        self._grow(sum(-(-n // ALIGN) * ALIGN for n in reserve))

    def _grow(self, n: int) -> None:
        self.wait()  # (the host block being replaced may still be read by the last copy)
        try:
            host = torch.empty(n, dtype=torch.int64, pin_memory=self.pin)
        except RuntimeError:  # no pinned memory on this backend: pageable, the copy then waits for itself
            self.pin = False
            host = torch.empty(n, dtype=torch.int64)
        self.host, self._host_array = host, host.numpy()
        self.block = torch.empty(n, dtype=torch.int64, device=self.device)
        self._layouts: dict[tuple, tuple] = {}  # the arrays' shapes -> (offsets, end, views in `block`)

    def wait(self) -> None:
        """Block until the last copy is done (its host memory is free)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def __call__(self, arrays) -> list:
        """Each of `arrays` (as `to_device` takes them) as an int64 tensor of its shape in the device block."""
        shapes = tuple(None if a is None else a.shape for a in arrays)
        layout = self._layouts.get(shapes)
        if layout is None:
            offsets, end = packed(arrays)
            if end > self.block.numel():
                self._grow(max(end, 2 * self.block.numel()))
            if len(self._layouts) >= self.MAX_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[shapes] = offsets, end, _views(self.block, arrays, offsets)
        offsets, end, views = layout
        self.wait()
        _write(self._host_array, arrays, offsets)
        if end:
            self.block[:end].copy_(self.host[:end], non_blocking=True)
            self._copied = copied_event(self.device)
        return list(views)


def copied_event(device: torch.device):
    """An event recorded now on `device`'s current stream (a backend without events: its `synchronize`
    synchronizes the device)."""
    try:
        event = torch.Event(device=device)
        event.record()
        return event
    except (RuntimeError, AttributeError, TypeError):
        return _Synchronize(device)


class _Synchronize:
    def __init__(self, device):
        self.device = device

    def synchronize(self):
        getattr(torch, self.device.type).synchronize()
