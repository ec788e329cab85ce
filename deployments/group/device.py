"""A rank's device: which one Ray assigned to the rank's actor, and its utilisation and memory for the
group's device metrics (plain Python; Ray is asked only for the assignment)."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from .messages import DeviceStats

log = logging.getLogger(__name__)


def assigned_device(kind: str, assigned: dict, env: dict) -> str:
    """The torch device of the accelerator Ray assigned to this actor (`get_accelerator_ids()`: GPU or NPU
    ids as the node numbers them). Ray also narrows CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES to
    the assignment, and torch numbers the visible devices from 0: the index is the id's position there
    (the id itself when the variable is unset, e.g. with Ray's NOSET_*_VISIBLE_DEVICES)."""
    resource, variable = {"cuda": ("GPU", "CUDA_VISIBLE_DEVICES"),
                          "npu": ("NPU", "ASCEND_RT_VISIBLE_DEVICES")}[kind]
    ids = [str(i) for i in assigned.get(resource, [])]
    if not ids:
        raise RuntimeError(f"this rank was assigned no {resource} by Ray (rank_devices must be > 0 for {kind})")
    visible = [v.strip() for v in env.get(variable, "").split(",") if v.strip()]
    if visible:
        if ids[0] not in visible:
            raise RuntimeError(f"assigned {resource} {ids[0]} is not in {variable}={env[variable]}")
        return f"{kind}:{visible.index(ids[0])}"
    return f"{kind}:{int(ids[0])}"


def rank_device(kind: str) -> torch.device:
    """This actor's device of `kind` (cpu, cuda, npu)."""
    if kind == "cpu":
        return torch.device("cpu")
    import ray
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers the npu device type with torch)
    assigned = ray.get_runtime_context().get_accelerator_ids()
    return torch.device(assigned_device(kind, assigned, os.environ))


class DeviceProbe:
    """One rank's device stats. Accelerators are asked through torch, which numbers devices as this process
    sees them, so the stats are this rank's device whatever index the node gives it. On CPU the device is the
    rank's process: its CPU time per wall second (percent of one core) and its resident memory."""

    def __init__(self, device: torch.device, rank: int):
        self.device = device
        self.rank = rank
        self.last_cpu: Optional[tuple[float, float]] = None     # CPU: the previous sample (wall, CPU seconds)
        self.warned_utilization = False

    def stats(self) -> Optional[DeviceStats]:
        if self.device.type == "cpu":
            return self._process()
        if self.device.type != "cuda":
            return None
        try:
            free, total = torch.cuda.mem_get_info(self.device)
        except Exception as e:                # a driver hiccup must not take the rank down
            log.warning("rank %d: device memory unavailable: %s", self.rank, e)
            return None
        try:
            utilization = float(torch.cuda.utilization(self.device))      # through NVML (nvidia-ml-py)
        except Exception as e:
            if not self.warned_utilization:
                log.warning("rank %d: device utilisation unavailable (NVML): %s", self.rank, e)
                self.warned_utilization = True
            utilization = float("nan")
        return DeviceStats(utilization, total - free)

    def _process(self) -> DeviceStats:
        import psutil
        proc = psutil.Process()
        now, cpu = time.monotonic(), sum(proc.cpu_times()[:2])
        last, self.last_cpu = self.last_cpu, (now, cpu)
        utilization = float("nan") if last is None else 100.0 * (cpu - last[1]) / max(now - last[0], 1e-9)
        return DeviceStats(utilization, proc.memory_info().rss)
