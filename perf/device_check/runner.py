"""The device check's run: the stages in order of risk with their estimates and modes (`STAGES`), the guards
around each (the serving flags and the stage's DiT regions set first; skipped past the deadline or by a
flag, not applicable, or failed with its error and traceback, its figures so far kept; the rest still run;
every thread's stack in the log when it overruns), and the output folder (`Output`: the JSON and the table
rewritten atomically after every figure, the progress log)."""
from __future__ import annotations

import datetime
import faulthandler
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
    DEFAULT_HOST_COPY_BYTES_PER_S,
    HOST_COPY_BYTES_PER_S,
    LIFECYCLE_LAYERS,
    LOAD_BYTES_PER_S,
    SERVING_FLAGS,
    STEP_TOLERANCE,
    WARM_COMPILE,
    WRITE_BYTES_PER_S,
    Check,
    NotApplicable,
    _free_memory,
    _quietly,
    read_flags,
    set_flags,
)
from .comm import stage_comm
from .decoders import stage_tf32, stage_tiny_decoder
from .environment import environment, gpu_state
from .memory import stage_lifecycle, stage_memory, stage_snapshots
from .report import modes_of, render_table
from .timing import (
    stage_compiled,
    stage_eager_dit,
    stage_eager_whole,
    stage_graphs,
    stage_interleaving,
    stage_no_sync,
    stage_rungs,
    stage_setup,
)


# ---- estimates, in seconds, from what the check has measured so far -----------------------------
def _estimate_whole_session(c: Check) -> float:
    whole = c.chunk_s()[1]
    priming = 0.0 if c.conditions_primed else CONDITION_CACHE_CHUNKS * 0.2 * whole
    return (c.warm + c.steady) * whole + priming


def _estimate_compiled(c: Check, compile_factor: float) -> float:
    dit, whole = c.chunk_s()
    return compile_factor * c.compile_s() + (c.warm + c.steady + 1) * (dit + whole)


def _estimate_snapshots(c: Check) -> float:
    whole = c.chunk_s()[1]
    copy = snapshot_footprint(c.preset).per_chunk / HOST_COPY_BYTES_PER_S.get(c.device.type,
                                                                             DEFAULT_HOST_COPY_BYTES_PER_S)
    return (3 + 3 * c.steady + 1) * whole + (c.steady + 5) * copy


def _estimate_memory(c: Check) -> float:
    dit, whole = c.chunk_s()
    return 2 * dit + c.warm * whole


def _estimate_lifecycle(c: Check) -> float:
    whole = c.chunk_s()[1]
    share = LIFECYCLE_LAYERS / c.preset.transformer.num_layers
    nbytes = share * (c.weights_bytes or 0)
    compile = WARM_COMPILE * c.compile_s() if compile_default(c.device) else 0.0
    return 5 + nbytes / WRITE_BYTES_PER_S + nbytes / LOAD_BYTES_PER_S + compile + c.warm * whole * (share + 0.3)


@dataclass(frozen=True)
class Stage:
    """One stage: `regions`, the DiT regions it measures (the runner puts them in place first; None: it runs
    no DiT of the pipeline); `risk`, what a failure there can do (0: raise; 1: compiled code, may raise from
    deep in inductor; 2: process-wide state, an NCCL communicator; 3: CUDA graphs, which can hang or leave
    the device unusable): the stages run in order of risk, so the riskier cannot cost the safer their run."""
    name: str
    title: str
    run: Callable[[Check], None]    # keeps its figures through Check.keep as it measures them
    estimate: Callable[[Check], float]
    regions: Optional[str] = None
    risk: int = 0
    required: bool = False          # runs whatever the deadline says
    needs_pipeline: bool = True     # skipped when setup did not build it
    builds_mode: bool = False       # the stage that builds `regions`: when it fails or is skipped, no later one does


STAGES = (
    Stage("setup", "matmul peak, build, attention kernel", stage_setup,
          lambda c: 10 + 2 * c.args.peak_seconds, required=True, needs_pipeline=False),
    Stage("eager_dit", "eager DiT chunk and one step", stage_eager_dit,
          lambda c: (c.warm + c.steady + 1) * c.chunk_s()[0], regions="eager", required=True),
    Stage("eager_whole", "eager whole chunk with decode", stage_eager_whole, _estimate_whole_session,
          regions="eager"),
    Stage("tiny_decoder", "the tiny decoder against IEEE fp32", stage_tiny_decoder, lambda c: 10.0),
    Stage("tf32", "the VAE's float32 convolutions: TF32 against IEEE", stage_tf32, lambda c: 10.0),
    Stage("compiled", "regional compile", stage_compiled, lambda c: _estimate_compiled(c, 1.0),
          regions="compiled", risk=1, builds_mode=True),
    Stage("no_sync", "no host sync on the DiT step path", stage_no_sync, lambda c: 3 * c.chunk_s()[0],
          regions="compiled", risk=1),
    Stage("rungs", "the quality ladder's rungs past the sink, and each decoder's chunk", stage_rungs,
          lambda c: (max(c.warm, c.preset.transformer.sink_chunks) + 4 * c.steady) * c.chunk_s()[0],
          regions="compiled", risk=1),
    Stage("snapshots", "snapshots on this host; their copies against the chunk", stage_snapshots,
          _estimate_snapshots, regions="compiled", risk=1),
    Stage("memory", "one session measured and predicted", stage_memory, _estimate_memory, regions="compiled",
          risk=1),
    Stage("comm", "NCCL at world size 1 and an NVML read", stage_comm, lambda c: 15.0, risk=2,
          needs_pipeline=False),
    Stage("graphs", "compiled regions as CUDA graphs", stage_graphs,
          lambda c: _estimate_compiled(c, WARM_COMPILE), regions="compiled+graphs", risk=3, builds_mode=True),
    Stage("interleaving", "two sessions interleaved", stage_interleaving, lambda c: 9 * c.chunk_s()[0],
          regions="compiled+graphs", risk=3),
    # frees the main model, so it runs last whatever its risk (compiled, warm caches, no graphs)
    Stage("lifecycle", "RankLifecycle from a safetensors folder", stage_lifecycle, _estimate_lifecycle,
          risk=1, needs_pipeline=False),
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

    @property
    def log_file(self):
        """The log's open file (faulthandler writes every thread's stack to it on a stage's overrun)."""
        return self._log

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
GIB = 2 ** 30
# a stage still running after WATCHDOG_FACTOR times its estimate, and at least the slack past it, has every
# thread's stack written to the log, again every as many seconds: a hang shows where it hangs
WATCHDOG_FACTOR = 2.0
WATCHDOG_SLACK_S = 60.0


def watchdog_s(estimate: Optional[float], slack_s: float) -> float:
    estimate = estimate or 0.0
    return max(WATCHDOG_FACTOR * estimate, estimate + slack_s)


def _skip_reason(stage: Stage, args, c: Check, estimate: Optional[float], elapsed: float) -> Optional[str]:
    if stage.name in args.skip:
        return "--skip"
    if stage.name == "compiled" and not args.compile:
        return "--no-compile"
    if stage.name == "graphs" and not args.graphs:
        return "--no-graphs"
    if stage.needs_pipeline and c.pipe is None:
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


def _run_stage(stage: Stage, c: Check, record: dict, save: Callable[[], None]) -> None:
    """One stage in its guard: the serving flags and the stage's regions set first; its figures kept as it
    measures them; its status, error and traceback in `record`."""
    set_flags(SERVING_FLAGS)                     # whatever the stage before left
    record["flags"] = read_flags()
    try:
        c.begin(stage.name, record["figures"], save)
        if stage.regions is not None:
            record["regions"] = c.enter(stage.regions)
        stage.run(c)
        record["status"] = "ok"
    except NotApplicable as e:
        record.update(status="not applicable", reason=str(e))
    except Exception as e:
        record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        if stage.builds_mode:
            try:
                c.mode_failed(stage.regions)
            except Exception as cleanup:
                record["cleanup_error"] = f"{type(cleanup).__name__}: {cleanup}"
    finally:
        c.stage = None


def run(args, out: Output, started: Optional[float] = None, stages: tuple[Stage, ...] = STAGES) -> dict:
    """Every stage in order, each guarded and watched; the report is written after each stage and each
    figure. `started`: when the deadline's clock started (perf_counter; default now)."""
    started = time.perf_counter() if started is None else started
    elapsed = lambda: time.perf_counter() - started
    c = Check(args, lambda line: out.log(f"[{elapsed():7.1f} s] {line}"))
    preset, device = c.preset, c.device
    cuda = device.type == "cuda" and torch.cuda.is_available()
    env = environment(device, args.commit)
    c.host_memory_bytes = int(args.host_gib * GIB) if args.host_gib else env["host_memory_bytes"]
    report = {
        "check": "lingbot_device_check", "preset": preset.name, "device": str(device),
        "device_name": _device_name(device), "environment": env,
        "size": f"{preset.width}x{preset.height}", "dtype": preset.dtype,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "deadline_s": args.deadline_s, "steady": args.steady, "elapsed_s": 0.0,
        "step_tolerance": STEP_TOLERANCE, "serving_flags": SERVING_FLAGS,
        "stages": {s.name: {"title": s.title, "status": "pending"} for s in stages},
    }

    def save() -> None:
        report["elapsed_s"] = elapsed()
        out.write(report)

    save()
    flags_before = read_flags()
    try:
        with torch.no_grad():
            for stage in stages:
                record = report["stages"][stage.name]
                try:
                    estimate = stage.estimate(c)
                except Exception as e:                # an estimate that cannot be made: the stage runs
                    estimate = None
                    c.progress(f"{stage.name}: no estimate ({type(e).__name__}: {e})")
                reason = _skip_reason(stage, args, c, estimate, elapsed())
                record["estimate_s"] = estimate
                if reason is not None:
                    record.update(status="skipped", reason=reason)
                    if stage.builds_mode:                 # the later stages that want it run the mode below
                        c.unavailable.add(stage.regions)
                    c.progress(f"{stage.name}: skipped ({reason})")
                    save()
                    continue
                # the log line first: a SIGTERM as soon as the report says "running" finds it in the log above
                # the stacks it writes
                c.progress(f"{stage.name}: {stage.title} ..."
                           + ("" if estimate is None else f" (estimate {estimate:.0f} s, "
                                                          f"{args.deadline_s - elapsed():.0f} s left)"))
                record.update(status="running", started_s=elapsed(), figures={})
                save()
                if cuda:
                    _quietly(torch.cuda.reset_peak_memory_stats, device)
                t0 = time.perf_counter()
                faulthandler.dump_traceback_later(watchdog_s(estimate, args.watchdog_slack_s), repeat=True,
                                                  file=out.log_file)
                try:
                    _run_stage(stage, c, record, save)
                except KeyboardInterrupt:
                    record.update(status="interrupted", seconds=time.perf_counter() - t0)
                    save()
                    raise
                finally:
                    faulthandler.cancel_dump_traceback_later()
                record["seconds"] = time.perf_counter() - t0
                if cuda:
                    record["device_peak_bytes"] = _quietly(torch.cuda.max_memory_allocated, device)
                _quietly(_free_memory, device)
                save()
                c.progress(f"{stage.name}: {record['status']} in {record['seconds']:.1f} s"
                           + (f": {record['error']}" if record["status"] == "failed" else "")
                           + (f" ({record['reason']})" if record["status"] == "not applicable" else ""))
    finally:
        set_flags(flags_before)
    report["environment_after"] = gpu_state(device)     # the clocks after the work
    save()
    return report
