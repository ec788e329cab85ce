"""The one prepared check for a lent GPU: what only a device can show, measured stage by stage in one run
that keeps every figure it measured, whatever fails after it.

    python3 -m perf.device_check --out $OUT --host-gib 128        # lingbot-world-v2-14b dims on cuda
    python3 -m perf.device_check --preset tiny --device cpu       # the same script end to end on any machine
        [--deadline-s 480] [--steady 3] [--skip STAGE,...] [--no-compile] [--no-graphs] [--peak-seconds 2]
        [--commit SHA] [--host-gib GIB]

The command for the GPU machine, with its wheel and its deadline, is in perf/README.md ("On a GPU").

This module owns the command line; runner.py the stages, their order and guards, the deadline and the
output folder. Each stage runs in its own guard, with the backend flags serving runs under (cuDNN's
autotuner on, TF32 at torch's defaults) and the DiT regions it measures set first, whatever the stage
before left; its figures are written one by one as they are measured, so a failure late in a stage keeps
the ones before it. The stages run in order of risk (a hang or a broken device in a later one cannot cost
an earlier one its figures), and a stage past twice its estimate (and a minute) has every thread's stack
written to the log:

    setup         the device's measured matmul peak; the preset with seeded random weights built straight on
                  the device in its dtype (no checkpoint, no text encoder: a random text embedding stands in
                  for UMT5's output); the attention kernel chosen at the steady-state shape
    eager_dit     the DiT alone, eager: warm-up through every window length, then the steady chunk (prepare,
                  4 probes, commit), its FLOP/s from the cost model; one denoising step kept for comparisons
    eager_whole   the whole chunk, eager (DiT, VAE decode, uint8, the frames' copy to the host) of a session
                  whose first frame reached its condition fixed point before (the serving steady state; the
                  condition encoder's own time per chunk until then is reported)
    tiny_decoder  the tiny decoder at the preset's size in its serving dtype: time, FLOP/s, the memory it
                  adds, its cache; against IEEE float32
    tf32          the VAE's float32 convolutions as served (TF32 on CUDA) against IEEE: the condition
                  encoder against the rounding a bf16 DiT applies, the Wan decoder in 8-bit levels
    compiled      regional compile: the DiT, one step and the whole chunk; the step against eager's
                  (STEP_TOLERANCE, judged), chunk 0's latents (reported)
    no_sync       a DiT chunk with every host synchronisation an error (CUDA: set_sync_debug_mode("error"))
    rungs         the quality ladder's step rungs (full, steps3, steps2) on one DiT session past its sink,
                  `steady` chunks each: their times and ratios to full beside the forward counts' ratios;
                  a steady chunk's decode by each decoder, so every rung's whole chunk (the decoder rungs
                  too), the Wan decode's share of a full chunk and a climb's one-shot warm-up
    snapshots     what a deployment on this host does with snapshots (lingbot/runtime/snapshot_budget.py,
                  `plan_snapshots`); the whole chunk alone, with a synchronous copy of its snapshot to the
                  host and with the asynchronous one (side stream, pinned memory); the copies' own time with
                  the device idle; an asynchronous copy made while the next chunk runs is bitwise the
                  synchronous one
    memory        what one session holds, measured and predicted alike: a DiT session against the budget
                  model's DiT parts, a whole session against its whole footprint, part by part
    comm          NCCL at world size 1 (Comm.init, every collective the DiT and the decoders call) and one
                  NVML read of utilisation and memory as a rank's metrics read them; not applicable off CUDA
    graphs        the compiled regions as CUDA graphs: DiT, one step and whole chunk; replay bitwise the
                  compiled latents
    interleaving  two sessions run chunk by chunk (as CUDA graphs) leave each other's outputs intact
    lifecycle     RankLifecycle as a rank runs it (connect as a single rank, load from a safetensors folder
                  written by the project's checkpoint writer at the preset's dims for LIFECYCLE_LAYERS
                  blocks, warm up, measure, capacity: that small model's); it frees the main model first, so
                  it runs last

compiled, no_sync, snapshots and memory measure the compiled regions (what serving runs on an accelerator);
graphs and interleaving the CUDA graphs. A mode whose own stage failed is not built again: the stages that
want it run the mode below it and say so.

Deadline (`--deadline-s`, from the start of the run): before each stage its cost is estimated from what
earlier stages measured (a priori figures before any did); a stage that would not end before the deadline
is skipped and marked so, and the next, cheaper ones still may run. setup and eager_dit always run.

Output (`--out DIR`, default $OUT, else a new folder under the temp directory): `device_check.json`
(the environment: commit, versions, driver, clocks, flags; every stage: status, seconds, estimate, flags,
regions, figures, error and traceback), `device_check.md` (the markdown tables to paste into
perf/README.md) and `device_check.log` (progress, the engine's log lines, stack dumps). The JSON and the
table are rewritten whole after every figure (a temporary file renamed over the old one, so a kill never
leaves half a file); a stage running when the process died shows as "running", and a SIGTERM (the
command's `timeout`) writes every thread's stack to the log first.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import logging
import os
import signal
import tempfile
import time

from lingbot.config import ConfigError, get_preset

from .check import DEFAULT_DEADLINE_S, SERVING_FLAGS, Check, read_flags
from .memory import few_layer_preset, held_bytes
from .report import modes_of, render_table
from .runner import STAGE_NAMES, STAGES, WATCHDOG_SLACK_S, Output, Stage, run

__all__ = ["SERVING_FLAGS", "STAGES", "STAGE_NAMES", "Check", "Output", "Stage", "few_layer_preset", "held_bytes",
           "main", "modes_of", "read_flags", "render_table", "run"]


# ---------------------------------------------------------------------------------------------------
def _stage_list(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown stage {unknown[0]!r}; stages: {', '.join(STAGE_NAMES)}")
    return names


def _failures(text: str) -> dict:
    """--fail-stage a,b@figure: stage -> None (fails at its start) or the figure after which it fails."""
    out = {}
    for item in (i for i in text.split(",") if i):
        name, _, figure = item.partition("@")
        if name not in STAGE_NAMES:
            raise argparse.ArgumentTypeError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
        out[name] = figure or None
    return out


def _default_out() -> str:
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(tempfile.gettempdir(), f"lingbot-device-check-{stamp}")


def main(argv=None, prog=None, stages: tuple[Stage, ...] = STAGES) -> dict:
    """The check from the command line `argv` (default sys.argv[1:]); `prog`: the name the usage line gives
    (default argparse's, from sys.argv[0]); `stages`: the stages to run (tests of the guards give their
    own). Returns the report as written to device_check.json."""
    started = time.perf_counter()
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="lingbot-world-v2-14b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="folder for device_check.json, .md and .log "
                                                "(default: $OUT, else a new folder under the temp directory)")
    ap.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                    help="a stage whose estimate would end after this many seconds from the start is skipped")
    ap.add_argument("--steady", type=int, default=3, help="steady chunks timed per measurement")
    ap.add_argument("--skip", type=_stage_list, default=[], help=f"stages not to run: {','.join(STAGE_NAMES)}")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also compiled regions as CUDA graphs (on CPU: compiled without graphs)")
    ap.add_argument("--peak-seconds", type=float, default=2.0, help="how long the matmul peak is measured")
    ap.add_argument("--commit", default=None, help="the commit the tree is at, recorded where there is no git")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="the host's memory for the snapshot plan (default: as the OS reports it; a VM whose "
                         "memory grows with use reports less than it has)")
    # tests only: stages that fail on purpose (at their start, or after a figure: stage@figure); the watchdog's
    # slack past a stage's estimate
    ap.add_argument("--fail-stage", type=_failures, default={}, help=argparse.SUPPRESS)
    ap.add_argument("--watchdog-slack-s", type=float, default=WATCHDOG_SLACK_S, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steady < 1:
        ap.error("--steady must be >= 1")
    if args.deadline_s <= 0:
        ap.error("--deadline-s must be > 0")
    try:
        get_preset(args.preset)
    except ConfigError as e:
        ap.error(str(e))
    if args.host_gib is not None and args.host_gib <= 0:
        ap.error("--host-gib must be > 0")
    out = Output(args.out or _default_out())
    engine = logging.getLogger("lingbot")
    level = engine.level
    engine.addHandler(out.handler)
    engine.setLevel(logging.INFO)
    # a crash in native code, and the command's timeout (SIGTERM), leave every thread's stack in the log
    # (where faulthandler is already on, as under pytest, it stays as it was)
    crashes = not faulthandler.is_enabled()
    if crashes:
        faulthandler.enable(file=out.log_file, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=out.log_file, all_threads=True, chain=True)
    try:
        out.log(f"device check: {args.preset} on {args.device}, deadline {args.deadline_s:g} s; "
                f"writing to {out.folder}")
        report = run(args, out, started, stages)
        out.log("")
        out.log(out.table.read_text().rstrip("\n"))
        out.log("")
        out.log(f"wrote {out.json}, {out.table}, {out.log_path}")
    finally:
        faulthandler.unregister(signal.SIGTERM)
        if crashes:
            faulthandler.disable()
        engine.removeHandler(out.handler)
        engine.setLevel(level)
        out.close()
    return report
