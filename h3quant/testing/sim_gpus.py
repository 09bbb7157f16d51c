"""SIMULATION of a machine with N CUDA GPUs, for the launch of tensor-parallel ranks on a
CPU-only machine (tests only; never used by the runtime).

``simulated_cuda_machine(count, nccl=True)`` makes this process's torch report CUDA available
with ``count`` devices (``torch.cuda.is_available`` / ``device_count``), take
``torch.cuda.set_device(i)`` (an index beyond ``count`` fails as torch does; ``current_device``
reports the last one set) and report NCCL built in or not (``torch.distributed
.is_nccl_available``); everything is restored on exit. Ranks forked inside the context inherit
it. Everything h3quant decides from those answers then runs as on a CUDA machine: the device
check, the backend choice (nccl) and its check, the device count, each rank's
``cuda:<local_rank>`` made current. What the machine lacks is left to the test: no tensor can
live on a simulated GPU (the ranks compute on the CPU, ``rank_setup``), and the NCCL transport
is gloo's on the CPU data (``dist_backend="gloo"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_CURRENT: list[int] = []  # the device set last (per process: a forked rank has its own copy)


@contextmanager
def simulated_cuda_machine(count: int = 2, *, nccl: bool = True) -> Iterator[None]:
    """SIMULATION of ``count`` CUDA devices (see the module docstring)."""

    def set_device(device: torch.device | str | int | None) -> None:
        if device is None:
            return
        i = device if isinstance(device, int) else torch.device(device).index
        i = 0 if i is None else int(i)
        if not 0 <= i < count:
            raise RuntimeError("CUDA error: invalid device ordinal (simulated)")
        _CURRENT[:] = [i]

    saved = {name: getattr(torch.cuda, name) for name in
             ("is_available", "device_count", "set_device", "current_device")}
    saved_nccl = dist.is_nccl_available
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: count
    torch.cuda.set_device = set_device
    torch.cuda.current_device = lambda: _CURRENT[0] if _CURRENT else 0
    dist.is_nccl_available = lambda: nccl
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        dist.is_nccl_available = saved_nccl
        _CURRENT.clear()
