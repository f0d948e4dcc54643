"""Host-to-device copies of a step's index arrays (`batch.py`).

`to_device` puts many host arrays on a device as int64 tensors in one host-to-device copy: every array is
written into one int64 host buffer at an aligned offset, the buffer is copied once, and each tensor is a view
of its slice. A copy per array costs a call and a device allocation each (~17 for a decode step, ~34 for a step
in parts); on the CPU the tensors are the arrays themselves (no copy). `copied_event` is what a host buffer
kept from step to step waits on before it is written again (`batch.StepBuffers`).
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
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += 0 if a is None else -(-a.size // ALIGN) * ALIGN
    host = np.empty(end, np.int64)
    for a, at in zip(arrays, offsets):
        if a is not None and a.size:
            host[at:at + a.size] = a.reshape(-1)  # (any dtype and strides: cast and gathered in one pass)
    buf = torch.from_numpy(host).to(device, non_blocking=True)
    return [None if a is None else buf.as_strided(a.shape, _strides(a.shape), at) for a, at in zip(arrays, offsets)]


def _strides(shape: tuple) -> tuple:
    """Element strides of a C-contiguous tensor of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


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
