"""Host data to the device without making the host wait: the one way the session path (a session's start
and its chunks) moves host data - numpy arrays, lists, Python numbers, CPU tensors - onto its device.

Why: `torch.as_tensor(array, device="cuda")` or `cpu_tensor.to("cuda")` copies from pageable memory, which
CUDA runs synchronously: the host waits for everything already queued on the device (on the chunk path: the
VAE encode, the probes of another session) before it can queue the next kernel, so the device idles while
the host catches up; `torch.cuda.set_sync_debug_mode("error")` reports each such copy. `to_device` converts
on the host, stages the bytes in pinned (page-locked) memory and queues the copy with non_blocking=True: the
host returns at once and the copy runs in stream order, before any kernel queued after it. The staging
block comes from PyTorch's caching host allocator, which records the copy on its stream and does not hand
the block out again until the copy has run, so the staging tensor may be dropped at once. On the CPU there
is nothing to overlap: a plain copy.

tests/lingbot/runtime/test_host_copies.py fails when the session path moves host data to its device any
other way.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def to_device(data, device: torch.device | str, dtype: Optional[torch.dtype] = None) -> Tensor:
    """`data` (array, nested list, number or tensor) as a tensor on `device` in `dtype` (None: the data's own;
    numpy float64 stays float64, so pass dtype for what the device should hold). Never aliases `data`.

    Host data is converted on the host first (a float64 array -> float32 before the copy, not after), then
    staged in pinned memory and copied asynchronously; a tensor already on an accelerator is only cast (and
    moved between devices by the device)."""
    device = torch.device(device)
    if isinstance(data, Tensor) and data.device.type != "cpu":
        return data.to(device=device, dtype=dtype, copy=True)
    host = torch.as_tensor(data, dtype=dtype)                         # on the host, converted there
    if device.type == "cpu":
        return host.to(device, copy=True)
    # a fresh pinned block, even for pinned input: the caller may reuse its own buffer before the copy has run
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)
