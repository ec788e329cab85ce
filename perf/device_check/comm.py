"""The device check's NCCL and NVML stage: what a serving rank on a GPU runs besides the model, never run
by the other stages (the lifecycle stage connects at world size 1, which makes no process group).

- NVML: one read of the device's utilisation and memory the way a rank's device metrics read them
  (deployments/group/rank.py: torch.cuda.mem_get_info, and torch.cuda.utilization, which needs the
  nvidia-ml-py package: perf/README.md says how the GPU command brings it).
- NCCL: `Comm.init` at world size 1 on the check's device (the NCCL group with its gloo control and start
  groups, as a rank joins its group), then every collective the DiT and the decoders call through `Comm`,
  each checked for its result: the Ulysses all-to-all, the uneven all-gather, the gather to the root, the
  broadcast (which `Comm` skips at one rank: called on the group directly), the gloo control all-reduce
  and the start group's monitored barrier. Not point to point (send_to_root, the halo exchange): at one
  rank no code path sends any, and a rank sending to itself may hang NCCL (its watchdog would then end
  the process, and the stages after this one with it).
Off CUDA there is neither: the stage is not applicable (it does not pass)."""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lingbot.parallel.comm import Comm, free_port
from perf.timing import timed

from .check import Check, NotApplicable

COLLECTIVE_TIMEOUT_S = 60.0


def _nvml(device: torch.device) -> dict:
    free, total = torch.cuda.mem_get_info(device)
    out = {"memory_used_bytes": total - free, "memory_total_bytes": total}
    try:
        import pynvml
        out["pynvml"] = pynvml.__file__
    except ImportError as e:
        out["pynvml"] = f"not importable: {e}"
    try:
        out.update(utilization=float(torch.cuda.utilization(device)), nvml="ok")
    except Exception as e:                       # the rank reports NaN then, with a warning
        out.update(utilization=None, nvml=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return out


def _collectives(comm: Comm, device: torch.device) -> dict:
    """name -> (the call, its expected result) at world size 1: every rank's share is its own."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, 4, 128, generator=g, device=device).to(torch.bfloat16)      # rows of [heads, head_dim]

    def broadcast():
        y = x.clone()
        dist.broadcast(y, src=0, group=comm.group)
        return y

    def control():
        flag = torch.tensor([1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=comm.control_group)
        return flag

    def barrier():
        dist.monitored_barrier(group=comm.start_group, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                               wait_all_ranks=True)

    return {"all_to_all": (lambda: comm.all_to_all(x, [8], [8]), x),
            "all_gather_uneven": (lambda: comm.all_gather_uneven(x, 0, [8]), x),
            "gather_to_root": (lambda: comm.gather_to_root(x, 0, [8]), x),
            "broadcast": (broadcast, x),
            "control all_reduce (gloo)": (control, torch.tensor([1], dtype=torch.int32)),
            "start barrier (gloo)": (barrier, None)}


def world_of_one(device: torch.device) -> dict:
    """`Comm.init` at world size 1 on `device` (NCCL on CUDA; gloo elsewhere, as the tests run it), then every
    collective of `_collectives`, each with its result and time; the group destroyed after."""
    if device.type == "cuda" and device.index is None:      # a process group binds one device by its index
        device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    comm = Comm.init(0, 1, f"tcp://127.0.0.1:{free_port()}", device, timeout_s=COLLECTIVE_TIMEOUT_S)
    out = {"init_s": time.perf_counter() - t0, "device": str(device), "backend": dist.get_backend(comm.group),
           "collectives": {}}
    try:
        for name, (call, expected) in _collectives(comm, device).items():
            try:
                seconds, got = timed(device, call)
                ms = seconds * 1e3
                right = expected is None or torch.equal(got.cpu(), expected.cpu())
                out["collectives"][name] = {"result": "ok" if right else "wrong result", "ms": ms}
            except Exception as e:
                out["collectives"][name] = {"result": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    finally:
        dist.destroy_process_group()
    return out


def stage_comm(c: Check) -> None:
    if c.device.type != "cuda":
        raise NotApplicable(f"no NCCL or NVML on {c.device.type}")
    c.keep(**_nvml(c.device))
    version = torch.cuda.nccl.version()                # (major, minor, patch)
    c.keep(nccl_version=".".join(map(str, version)) if isinstance(version, tuple) else str(version))
    c.keep(**world_of_one(c.device))
    failed = [name for name, r in c.figures["collectives"].items() if r["result"] != "ok"]
    if failed or c.figures["nvml"] != "ok":
        raise RuntimeError(f"failed: {', '.join(failed + (['nvml'] if c.figures['nvml'] != 'ok' else []))}")
