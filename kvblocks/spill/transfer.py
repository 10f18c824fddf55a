"""Copies between the device and the spill tiers' host memory: pinned and asynchronous on a GPU.

On CUDA, KV leaving the device (write-back eviction) is copied into pinned host tensors and KV
restored from a tier is copied up from pinned staging buffers, both `non_blocking` on a side stream
of their own, so they overlap the compute queued on the current stream:
- down (`offload`): the side stream first waits for the work queued so far (the KV was gathered
  there), the sources are marked as used by it (`record_stream`: the allocator keeps their memory
  until the copy is done), and an event recorded after the copies is what the writer thread waits on
  before it reads the host tensors;
- up (`upload`): the copies run on the side stream into tensors allocated there, and the current
  stream waits on an event recorded after them, so any later kernel reads whole KV; the results are
  marked as used by the current stream. The pinned sources stay valid until the copy is done (torch's
  pinned allocator records the copy's stream).

Off CUDA (a CPU server, or a test of the host tier on the CPU) nothing is pinned and every copy is an
ordinary synchronous one: pinning needs a CUDA driver, and there is no copy to overlap.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import numpy as np
import torch

_side_streams: dict[int, Any] = {}


def is_cuda(device: torch.device | str | None) -> TypeGuard[torch.device | str]:
    return device is not None and torch.device(device).type == "cuda"


def side_stream(device: torch.device) -> Any:
    """The spill copies' own stream on `device` (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
    return _side_streams[index]


def offload(
    kv: list[torch.Tensor | None], device: torch.device | None
) -> tuple[list[torch.Tensor | None], Any]:
    """Host copies of `kv` and the event the reader of those copies waits on (None off a GPU)."""
    if not is_cuda(device):
        return [None if t is None else t.to("cpu", copy=True) for t in kv], None
    side = side_stream(torch.device(device))
    side.wait_stream(torch.cuda.current_stream(device))
    out: list[torch.Tensor | None] = []
    with torch.cuda.stream(side):
        for t in kv:
            if t is None:
                out.append(None)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(side)
            out.append(host)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
    event.record(side)
    return out, event


def upload(kv: list[torch.Tensor | None], device: torch.device | None) -> list[torch.Tensor | None]:
    """`kv` (host tensors, pinned on a GPU) on `device`; on CUDA ordered before the current stream's
    next kernels (see the module doc)."""
    if not is_cuda(device):
        return [None if t is None else t.to(device) for t in kv]
    current = torch.cuda.current_stream(device)
    side = side_stream(torch.device(device))
    with torch.cuda.stream(side):
        out = [None if t is None else t.to(device, non_blocking=True) for t in kv]
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ unannotated
    event.record(side)
    current.wait_event(event)
    for t in out:
        if t is not None:
            t.record_stream(current)
    return out


def pinned_copy(value: bytes | memoryview) -> torch.Tensor:
    """`value` in a pinned host tensor of bytes (CUDA only: pinning needs its driver)."""
    out = torch.empty(len(value), dtype=torch.uint8, pin_memory=True)
    out.numpy()[:] = np.frombuffer(value, dtype=np.uint8)
    return out
