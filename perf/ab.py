"""A/B harness: one workload with a switch on and off, alternating in one run; prints the off/on ratio of
the steady chunk time with its spread across rounds, the same for the first chunk and the whole session, and
each side's stage split (the medians of every stage a chunk reports).

    python -m perf.ab --switch camera_cache      [--rounds 4] [--chunks 10] [--preset tiny]
    python -m perf.ab --switch fixed_point_skip  --chunks 16
    python -m perf.ab --switch condition_cache   --rounds 3      (a first frame seen before against a new one)
    python -m perf.ab --switch pixel_mode --sp 2            (root_uint8_p2p vs root_float)
    python -m perf.ab --switch compile                      (regional torch.compile of the DiT blocks)
    python -m perf.ab --switch vae_cpu_kernels              (the VAE's CPU kernels: condition and decode)

Workload: one in-process session of --chunks chunks per measurement (perf/timing.py), the whole pipeline
(condition, DiT, decode, pixels) or the DiT alone (--workload dit, the default for camera_cache and compile);
steady = chunks >= --steady-from (each switch has its default). Every session of the pipeline workload starts
from the same first frame, whose conditions are encoded to their fixed point into the pipeline's condition
cache before the rounds: every session replays them, as a served first frame seen before does. The
condition_cache switch measures the other case: off takes the cache away, so every chunk up to the fixed point
runs the encoder, as for a new first frame. The first chunk of each side (where compile time lands) is
printed apart, round by round.
"""
from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from lingbot.builder import build_pipeline
from perf.timing import (
    KEYS,
    STEADY_FROM,
    ChunkTimes,
    dit_session,
    first_frame,
    prime_conditions,
    time_chunks,
    whole_chunk,
    whole_session,
)


@dataclass(frozen=True)
class Switch:
    meaning: str                                  # what "on" means (and "off")
    set: Callable[[object, bool], None]           # set(pipeline, on)
    workload: str = "pipeline"                    # the default workload: "pipeline" or "dit"
    chunks: int = 10                              # the default chunks per session
    steady_from: int = STEADY_FROM                # the default first steady chunk


def _set_compiled(pipeline, on: bool) -> None:
    """Swap every block's two regions between eager and compiled (compiled once, at the first 'on')."""
    from lingbot.runtime.compile import compile_blocks
    model = pipeline.runner.model
    if not hasattr(model, "ab_regions"):
        eager = [(b.attention_inputs, b.attention_output) for b in model.blocks]
        compile_blocks(model)
        model.ab_regions = {False: eager, True: [(b.attention_inputs, b.attention_output) for b in model.blocks]}
    for block, (inputs, output) in zip(model.blocks, model.ab_regions[on]):
        block.attention_inputs, block.attention_output = inputs, output


def _set_condition_cache(pipeline, on: bool) -> None:
    """The pipeline's condition cache (primed before the rounds) or none: a first frame never seen before."""
    if not hasattr(pipeline, "ab_condition_cache"):
        pipeline.ab_condition_cache = pipeline.condition_cache
    pipeline.condition_cache = pipeline.ab_condition_cache if on else None


SWITCHES = {
    "camera_cache": Switch("camera modulation once per chunk (off: in every forward)",
                           lambda p, on: setattr(p.runner, "cache_camera_modulation", on), workload="dit"),
    "fixed_point_skip": Switch("condition encoder stops at its fixed point (off: encodes every chunk)",
                               lambda p, on: setattr(p, "skip_fixed_point", on), chunks=16, steady_from=11),
    # the opening chunks are the question: every chunk counts (the fixed point is at chunk 10 on tiny)
    "condition_cache": Switch("the first frame's conditions replayed from the cache (off: a new first frame, "
                              "encoded up to its fixed point)", _set_condition_cache, steady_from=0),
    "pixel_mode": Switch("root_uint8_p2p (off: root_float)",
                         lambda p, on: setattr(p.decoder, "pixel_mode", "root_uint8_p2p" if on else "root_float")),
    "compile": Switch("regional torch.compile of the DiT blocks (off: eager)", _set_compiled, workload="dit"),
    "vae_cpu_kernels": Switch("the VAE's CPU kernels: oneDNN conv3d for every shape, a plain sum-of-squares norm "
                              "(off: PyTorch's own choice, as diffusers runs)",
                              lambda p, on: p.decoder.vae.use_exact_kernels(not on)),
}


def rounds(comm, preset: str, switch: str, chunks: int, n_rounds: int, workload: str = "pipeline",
           device: str = "cpu", model_path: str | None = None) -> dict[bool, list[ChunkTimes]]:
    """Each round one session with the switch on and one with it off (the side that goes first alternates);
    workload 'pipeline': whole chunks (condition, DiT, decode, pixels); 'dit': the DiT session alone (prepare,
    probes, commit) on random condition latents. Under SP every rank runs it (lingbot.parallel.launch)."""
    torch.set_grad_enabled(False)
    pipe = build_pipeline(preset, model_path, device=device, comm=comm, compile=False)
    image = first_frame(pipe.preset)
    if workload == "pipeline" and pipe.condition_cache is not None:
        prime_conditions(pipe, image)

    def chunk_of_new_session(seed: int):
        if workload == "dit":
            return partial(dit_session(pipe.runner, chunks, seed=seed).run_chunk, KEYS)
        return partial(whole_chunk, whole_session(pipe, seed=seed, image=image))
    chunk_of_new_session(n_rounds)()    # a warm-up chunk: the prompt's text encoding lands here, not in a round
    out: dict[bool, list[ChunkTimes]] = {True: [], False: []}
    for r in range(n_rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            SWITCHES[switch].set(pipe, on)
            out[on].append(time_chunks(chunk_of_new_session(r), chunks, pipe.runner.device))
    return out


def _ratio(on: list[float], off: list[float]) -> str:
    ratios = [b / a for a, b in zip(on, off)]
    return f"off/on = {statistics.median(ratios):.3f} (spread {min(ratios):.3f} .. {max(ratios):.3f})"


def report(result: dict[bool, list[ChunkTimes]], steady_from: int) -> list[str]:
    """The printed lines: steady medians, first chunks and whole sessions, each side's stage split."""
    steady = {on: [t.median(steady_from) for t in result[on]] for on in (True, False)}
    lines = []
    for on in (True, False):
        lines.append(f"  {'on ' if on else 'off'}: median {statistics.median(steady[on]) * 1e3:8.1f} ms   rounds "
                     + ", ".join(f"{v * 1e3:.1f}" for v in steady[on]))
    lines.append(f"  {_ratio(steady[True], steady[False])}")
    first = {on: [t.first for t in result[on]] for on in (True, False)}
    lines.append("  first chunk of each round (ms): " + "; ".join(
        f"{'on' if on else 'off'} " + ", ".join(f"{v * 1e3:.0f}" for v in first[on]) for on in (True, False))
        + f"; {_ratio(first[True], first[False])}")
    total = {on: [t.total for t in result[on]] for on in (True, False)}
    lines.append(f"  whole session ({len(result[True][0].seconds)} chunks): on {statistics.median(total[True]):.2f} s, "
                 f"off {statistics.median(total[False]):.2f} s; {_ratio(total[True], total[False])}")
    lines.append(f"  stage medians over the steady chunks, ms:\n    {'stage':<12} {'on':>9} {'off':>9}")
    for stage in result[True][0].stage_names():
        ms = {on: statistics.median(t.stage_median(stage, start=steady_from) for t in result[on]) * 1e3
              for on in (True, False)}
        lines.append(f"    {stage:<12} {ms[True]:>9.2f} {ms[False]:>9.2f}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model-path", default=None, help="a model folder (default: the preset's random weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=None, help="chunks per session (default: the switch's)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steady-from", type=int, default=None, help="the first steady chunk (default: the switch's)")
    ap.add_argument("--workload", choices=["pipeline", "dit"], default=None,
                    help="default: dit for camera_cache and compile, pipeline otherwise")
    args = ap.parse_args(argv)
    switch = SWITCHES[args.switch]
    workload = args.workload or switch.workload
    if workload == "dit" and switch.workload != "dit":
        ap.error(f"{args.switch} acts outside the DiT: use --workload pipeline")
    if args.switch == "pixel_mode" and args.sp < 2:
        ap.error("pixel_mode needs --sp >= 2")
    chunks = args.chunks or switch.chunks
    steady_from = args.steady_from if args.steady_from is not None else switch.steady_from
    if chunks <= steady_from:
        ap.error(f"--chunks must exceed the steady start {steady_from}")
    if args.sp > 1:
        from lingbot.parallel.launch import run_local
        result = run_local(rounds, args.sp, args.preset, args.switch, chunks, args.rounds, workload, args.device,
                           args.model_path, device=args.device, timeout_s=900)[0]
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        result = rounds(None, args.preset, args.switch, chunks, args.rounds, workload, args.device, args.model_path)
    print(f"A/B {args.switch}: {switch.meaning}; {args.preset}, SP-{args.sp}, {workload} workload, "
          f"{args.rounds} alternating rounds, steady chunks {steady_from}..{chunks - 1}")
    print("\n".join(report(result, steady_from)))


if __name__ == "__main__":
    main()
