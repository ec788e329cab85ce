"""The device check's run: the stages in order with their estimates (`STAGES`), the guards around each
(skipped past the deadline or by a flag, failed with its error and traceback, the rest still run), and the
output folder (`Output`: the JSON and the table rewritten atomically after every stage, the progress log)."""
from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lingbot.runtime.compile import compile_default
from lingbot.runtime.condition import CONDITION_CACHE_CHUNKS
from lingbot.runtime.snapshot_budget import snapshot_footprint

from .check import (
    COMPILE_TOLERANCE,
    DEFAULT_HOST_COPY_BYTES_PER_S,
    HOST_COPY_BYTES_PER_S,
    LIFECYCLE_LAYERS,
    LOAD_BYTES_PER_S,
    WRITE_BYTES_PER_S,
    Check,
    _free_memory,
    _quietly,
)
from .decoders import stage_tiny_decoder
from .memory import stage_lifecycle, stage_memory, stage_snapshots
from .report import modes_of, render_table
from .timing import (
    stage_compiled,
    stage_eager_dit,
    stage_eager_whole,
    stage_graphs,
    stage_interleaving,
    stage_no_sync,
    stage_setup,
)


# ---- estimates, in seconds, from what the check has measured so far -----------------------------
def _estimate_whole_session(c: Check) -> float:
    whole = c.chunk_s()[1]
    priming = 0.0 if c.conditions_primed else CONDITION_CACHE_CHUNKS * 0.2 * whole
    return (c.warm + c.steady) * whole + priming


def _estimate_compiled(c: Check, factor: float) -> float:
    dit, whole = c.chunk_s()
    return factor * c.compile_s() + (c.warm + c.steady) * (dit + whole)


def _estimate_snapshots(c: Check) -> float:
    whole = c.chunk_s()[1]
    copy = snapshot_footprint(c.preset).per_chunk / HOST_COPY_BYTES_PER_S.get(c.device.type,
                                                                             DEFAULT_HOST_COPY_BYTES_PER_S)
    return (3 + 3 * c.steady + 1) * whole + (c.steady + 3) * copy


def _estimate_memory(c: Check) -> float:
    dit, whole = c.chunk_s()
    return 2 * dit + c.warm * whole


def _estimate_lifecycle(c: Check) -> float:
    whole = c.chunk_s()[1]
    share = LIFECYCLE_LAYERS / c.preset.transformer.num_layers
    nbytes = share * (c.weights_bytes or 0)
    compile = 0.5 * c.compile_s() if compile_default(c.device) else 0.0     # the inductor caches are warm
    return 5 + nbytes / WRITE_BYTES_PER_S + nbytes / LOAD_BYTES_PER_S + compile + c.warm * whole * (share + 0.3)


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    run: Callable[[Check], dict]
    estimate: Callable[[Check], float]
    required: bool = False          # runs whatever the deadline says
    needs_pipeline: bool = True     # skipped when setup did not build it
    on_failure: Optional[Callable[[Check], None]] = None


STAGES = (
    Stage("setup", "build, attention kernel, matmul peak", stage_setup, lambda c: 0.0, required=True,
          needs_pipeline=False),
    Stage("eager_dit", "eager DiT chunk", stage_eager_dit, lambda c: (c.warm + c.steady) * c.chunk_s()[0],
          required=True),
    Stage("eager_whole", "eager whole chunk with decode", stage_eager_whole, _estimate_whole_session),
    Stage("tiny_decoder", "the tiny decoder against fp32", stage_tiny_decoder, lambda c: 10.0),
    Stage("compiled", "regional compile", stage_compiled, lambda c: _estimate_compiled(c, 1.0),
          on_failure=Check.to_eager),
    Stage("no_sync", "no host sync on the DiT step path", stage_no_sync, lambda c: 3 * c.chunk_s()[0]),
    Stage("graphs", "compiled regions as CUDA graphs", stage_graphs, lambda c: _estimate_compiled(c, 1.3),
          on_failure=Check.to_eager),
    Stage("interleaving", "two sessions interleaved", stage_interleaving, lambda c: 9 * c.chunk_s()[0]),
    Stage("snapshots", "snapshot copies against the chunk", stage_snapshots, _estimate_snapshots),
    Stage("memory", "one session measured and predicted", stage_memory, _estimate_memory),
    Stage("lifecycle", "RankLifecycle from a safetensors folder", stage_lifecycle, _estimate_lifecycle,
          needs_pipeline=False),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


# ---------------------------------------------------------------------------------------------------
# the output folder
# ---------------------------------------------------------------------------------------------------
def _plain(value):
    """JSON for what json does not know (numpy and torch scalars, devices, paths): a number or a string."""
    if isinstance(value, (np.generic, torch.Tensor)) and getattr(value, "ndim", 1) == 0:
        return value.item()
    return str(value)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Output:
    """The run's folder: the JSON and the markdown table rewritten whole after every stage (written to a
    temporary file renamed over the old one: a reader or a kill never sees half a file); the log appended
    line by line, progress echoed to stdout."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.json = self.folder / "device_check.json"
        self.table = self.folder / "device_check.md"
        self.log_path = self.folder / "device_check.log"
        self._log = open(self.log_path, "a", buffering=1)
        self.handler = logging.StreamHandler(self._log)       # the engine's own log lines go to the log file
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def log(self, line: str) -> None:
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def write(self, report: dict) -> None:
        report["modes"] = modes_of(report)
        _write_atomically(self.json, json.dumps(report, indent=2, default=_plain) + "\n")
        try:
            table = render_table(report)
        except Exception as e:                     # a figure the table did not expect never costs the JSON
            table = f"(no table: {type(e).__name__}: {e}; the figures are in {self.json.name})\n"
        _write_atomically(self.table, table)

    def close(self) -> None:
        self._log.close()


# ---------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------
class InjectedFailure(RuntimeError):
    """Raised by --fail-stage: a stage that fails on purpose (tests of the guards)."""


def _fail_on_purpose(name: str) -> None:
    raise InjectedFailure(f"stage {name} failed on purpose (--fail-stage {name})")


def _skip_reason(stage: Stage, args, report: dict, estimate: Optional[float], elapsed: float) -> Optional[str]:
    if stage.name in args.skip:
        return "--skip"
    if stage.name == "compiled" and not args.compile:
        return "--no-compile"
    if stage.name == "graphs" and not args.graphs:
        return "--no-graphs"
    if stage.needs_pipeline and report["stages"]["setup"]["status"] != "ok":
        return "setup did not build the pipeline"
    if not stage.required and estimate is not None and elapsed + estimate > args.deadline_s:
        return (f"deadline: needs ~{estimate:.0f} s, {max(0.0, args.deadline_s - elapsed):.0f} s left "
                f"of {args.deadline_s:g} s")
    return None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return platform.machine()
    try:
        return torch.cuda.get_device_name(device)
    except Exception as e:                       # no CUDA here: setup will fail and say why
        return f"unknown ({type(e).__name__})"


def run(args, out: Output, started: Optional[float] = None) -> dict:
    """Every stage in order, each guarded; the report is written after each. `started`: when the deadline's
    clock started (perf_counter; default now)."""
    started = time.perf_counter() if started is None else started
    elapsed = lambda: time.perf_counter() - started
    c = Check(args, lambda line: out.log(f"[{elapsed():7.1f} s] {line}"))
    preset, device = c.preset, c.device
    cuda = device.type == "cuda" and torch.cuda.is_available()
    report = {
        "check": "lingbot_device_check", "preset": preset.name, "device": str(device),
        "device_name": _device_name(device),
        "torch": torch.__version__, "size": f"{preset.width}x{preset.height}", "dtype": preset.dtype,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "deadline_s": args.deadline_s, "steady": args.steady, "elapsed_s": 0.0,
        "compile_tolerance": COMPILE_TOLERANCE,
        "stages": {s.name: {"title": s.title, "status": "pending"} for s in STAGES},
    }
    out.write(report)
    with torch.no_grad():
        for stage in STAGES:
            record = report["stages"][stage.name]
            try:
                estimate = stage.estimate(c)
            except Exception as e:                # an estimate that cannot be made: the stage runs
                estimate = None
                c.progress(f"{stage.name}: no estimate ({type(e).__name__}: {e})")
            reason = _skip_reason(stage, args, report, estimate, elapsed())
            record["estimate_s"] = estimate
            if reason is not None:
                record.update(status="skipped", reason=reason)
                c.progress(f"{stage.name}: skipped ({reason})")
                report["elapsed_s"] = elapsed()
                out.write(report)
                continue
            record.update(status="running", started_s=elapsed())
            report["elapsed_s"] = elapsed()
            out.write(report)
            c.progress(f"{stage.name}: {stage.title} ..."
                       + ("" if estimate is None else f" (estimate {estimate:.0f} s, "
                                                      f"{args.deadline_s - elapsed():.0f} s left)"))
            if cuda:
                _quietly(torch.cuda.reset_peak_memory_stats, device)
            t0 = time.perf_counter()
            try:
                if args.fail_stage == stage.name:
                    _fail_on_purpose(stage.name)
                record["figures"] = stage.run(c)
                record["status"] = "ok"
            except KeyboardInterrupt:
                record.update(status="interrupted", seconds=time.perf_counter() - t0)
                report["elapsed_s"] = elapsed()
                out.write(report)
                raise
            except Exception as e:
                record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                if stage.on_failure is not None:
                    try:
                        stage.on_failure(c)
                    except Exception as cleanup:
                        record["cleanup_error"] = f"{type(cleanup).__name__}: {cleanup}"
            record["seconds"] = time.perf_counter() - t0
            if cuda:
                record["device_peak_bytes"] = _quietly(torch.cuda.max_memory_allocated, device)
            _quietly(_free_memory, device)
            report["elapsed_s"] = elapsed()
            out.write(report)
            c.progress(f"{stage.name}: {record['status']} in {record['seconds']:.1f} s"
                       + (f": {record['error']}" if record["status"] == "failed" else ""))
    return report
