"""The one prepared check for a lent GPU: what only a device can show, measured stage by stage in one run
that keeps every figure it measured, whatever fails after it.

    python -m perf.device_check --out /tmp/out                    # lingbot-world-v2-14b dims on cuda
    python -m perf.device_check --preset tiny --device cpu        # the same script end to end on any machine
        [--out DIR] [--deadline-s 480] [--steady 3] [--skip STAGE,...] [--no-compile] [--no-graphs]
        [--peak-seconds 2]

This module owns the stages, their order and guards, the deadline, and the run's output folder. The
stages run in order of value; each runs in its own guard, and its figures (or its error with the
traceback) are written as soon as it ends:

    setup         the preset with seeded random weights built straight on the device in its dtype (no
                  checkpoint, no text encoder: a random text embedding stands in for UMT5's output), the
                  attention kernel chosen at the steady-state shape, the device's measured matmul peak
    eager_dit     the DiT alone, eager: warm-up through every window length, then the steady chunk (prepare,
                  4 probes, commit), its FLOP/s from the cost model against the peak
    eager_whole   the whole chunk, eager (DiT, VAE decode, uint8, the frames' copy to the host) of a session
                  whose first frame reached its condition fixed point before (the serving steady state; the
                  condition encoder's own time per chunk until then is reported)
    compiled      regional compile: the DiT and the whole chunk; latents against eager's (COMPILE_TOLERANCE)
    no_sync       a DiT chunk with every host synchronisation an error (CUDA: set_sync_debug_mode("error"))
    graphs        the compiled regions as CUDA graphs: DiT and whole chunk; replay bitwise the compiled latents
    interleaving  two sessions run chunk by chunk leave each other's outputs intact
    snapshots     the whole chunk alone, with a synchronous copy of its snapshot to the host and with the
                  asynchronous one (side stream, pinned memory); the copies' own time with the device idle;
                  an asynchronous copy made while the next chunk runs is bitwise the synchronous one
    memory        what one session holds, measured and predicted alike: a DiT session against the budget
                  model's DiT parts, a whole session against its whole footprint, part by part
    lifecycle     RankLifecycle as a rank runs it (connect as a single rank, load from a safetensors folder
                  written by the project's checkpoint writer at the preset's dims for LIFECYCLE_LAYERS
                  blocks, warm up, measure, capacity); it frees the main model first, so it runs last

Deadline (`--deadline-s`, from the start of the run): before each stage its cost is estimated from what
earlier stages measured (a priori figures before any did); a stage that would not end before the deadline
is skipped and marked so, and the next, cheaper ones still may run. setup and eager_dit always run.

Output (`--out DIR`, default $OUT, else a new folder under the temp directory): `device_check.json`
(every stage: status, seconds, estimate, figures or error and traceback), `device_check.md` (the markdown
tables to paste into perf/README.md) and `device_check.log` (progress, the engine's log lines). The JSON
and the table are rewritten whole after every stage (a temporary file renamed over the old one, so a kill
never leaves half a file); a stage running when the process died shows as "running".
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import tempfile
import time

from lingbot.config import ConfigError, get_preset

from .check import DEFAULT_DEADLINE_S, Check
from .memory import few_layer_preset, held_bytes
from .report import modes_of, render_table
from .runner import STAGE_NAMES, STAGES, Output, Stage, run

__all__ = ["STAGES", "STAGE_NAMES", "Check", "Output", "Stage", "few_layer_preset", "held_bytes", "main",
           "modes_of", "render_table", "run"]


# ---------------------------------------------------------------------------------------------------
def _stage_list(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in STAGE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown stage {unknown[0]!r}; stages: {', '.join(STAGE_NAMES)}")
    return names


def _default_out() -> str:
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(tempfile.gettempdir(), f"lingbot-device-check-{stamp}")


def main(argv=None, prog=None) -> dict:
    """The check from the command line `argv` (default sys.argv[1:]); `prog`: the name the usage line gives
    (default argparse's, from sys.argv[0]). Returns the report as written to device_check.json."""
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
    ap.add_argument("--fail-stage", choices=STAGE_NAMES, default=None, help=argparse.SUPPRESS)   # tests only
    args = ap.parse_args(argv)
    if args.steady < 1:
        ap.error("--steady must be >= 1")
    if args.deadline_s <= 0:
        ap.error("--deadline-s must be > 0")
    try:
        get_preset(args.preset)
    except ConfigError as e:
        ap.error(str(e))
    out = Output(args.out or _default_out())
    engine = logging.getLogger("lingbot")
    level = engine.level
    engine.addHandler(out.handler)
    engine.setLevel(logging.INFO)
    try:
        out.log(f"device check: {args.preset} on {args.device}, deadline {args.deadline_s:g} s; "
                f"writing to {out.folder}")
        report = run(args, out, started)
        out.log("")
        out.log(out.table.read_text().rstrip("\n"))
        out.log("")
        out.log(f"wrote {out.json}, {out.table}, {out.log_path}")
    finally:
        engine.removeHandler(out.handler)
        engine.setLevel(level)
        out.close()
    return report
