"""What the device check records about the machine it ran on: the code (git commit), the software (Python,
torch, CUDA, cuDNN, Triton, transformers), the device (its driver, clocks and memory, through nvidia-smi),
the host's memory, and the backend flags in force. Nothing here may stop the run: a fact that cannot be
read is recorded as the reason it could not."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

import torch

from .check import read_flags

REPO = Path(__file__).resolve().parents[2]
GPU_QUERY = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "memory.total",
             "power.draw", "power.limit", "temperature.gpu")


def host_memory_bytes() -> int:
    """The host's physical memory as the OS reports it (a VM whose memory grows with use may report less)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout.strip()


def git_commit(given: Optional[str] = None, repo: Path = REPO) -> dict:
    """The commit checked out in `repo` and whether tracked files differ from it; where there is no git (a
    copy of the tree without .git, as the GPU machine gets), `given` (--commit)."""
    try:
        commit = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
        dirty = bool(_run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"]))
        return {"commit": commit, "dirty": dirty, "commit_from": "git"}
    except (OSError, subprocess.SubprocessError) as e:
        reason = f"no git here ({type(e).__name__})"
        return {"commit": given or None, "dirty": None, "commit_from": "--commit" if given else reason}


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_state(device: torch.device) -> dict:
    """The device's driver, clocks (MHz), memory, power and temperature from nvidia-smi; on other devices,
    not applicable."""
    if device.type != "cuda":
        return {"gpu": f"not applicable ({device.type})"}
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        row = _run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(GPU_QUERY)}",
                    "--format=csv,noheader,nounits"])
    except (OSError, subprocess.SubprocessError) as e:
        return {"gpu": f"nvidia-smi failed: {type(e).__name__}: {str(e)[:200]}"}
    return {"gpu": dict(zip(GPU_QUERY, (v.strip() for v in row.splitlines()[0].split(","))))}


def environment(device: torch.device, commit: Optional[str] = None) -> dict:
    cuda = device.type == "cuda" and torch.cuda.is_available()
    return {**git_commit(commit),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            **{name: _version(name) for name in ("triton", "transformers", "numpy", "safetensors", "nvidia-ml-py")},
            "platform": platform.platform(), "cpus": os.cpu_count(), "host_memory_bytes": host_memory_bytes(),
            **gpu_state(device), "flags": read_flags()}
