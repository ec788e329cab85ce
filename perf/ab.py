"""A/B harness: one workload with a switch on and off, alternating in one run; prints the off/on ratio of
the steady chunk time with its spread across rounds.

    python -m perf.ab --switch camera_cache      [--rounds 4] [--chunks 10] [--preset tiny]
    python -m perf.ab --switch fixed_point_skip  --chunks 16
    python -m perf.ab --switch pixel_mode --sp 2            (root_uint8_p2p vs root_float)
    python -m perf.ab --switch compile                      (regional torch.compile of the DiT blocks)
    python -m perf.ab --switch vae_cpu_kernels              (the VAE's CPU kernels: condition and decode)

Workload: one in-process session of --chunks chunks per measurement, the whole pipeline (condition, DiT,
decode, pixels) or the DiT alone (--workload dit, the default for camera_cache and compile); steady = chunks >=
--steady-from (default: 6, or after the fixed point for fixed_point_skip). The first chunk of each side
(where compile time lands) is printed apart.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lingbot.camera import Controls
from lingbot.parallel import Comm

SWITCHES = {
    # name: (what "on" means, setter(pipeline, on))
    "camera_cache": ("camera modulation once per chunk (off: in every forward)",
                     lambda p, on: setattr(p.runner, "cache_camera_modulation", on)),
    "fixed_point_skip": ("condition encoder stops at its fixed point (off: encodes every chunk)",
                         lambda p, on: setattr(p, "skip_fixed_point", on)),
    "pixel_mode": ("root_uint8_p2p (off: root_float)",
                   lambda p, on: setattr(p.decoder, "pixel_mode", "root_uint8_p2p" if on else "root_float")),
    "compile": ("regional torch.compile of the DiT blocks (off: eager)", lambda p, on: _set_compiled(p, on)),
    "vae_cpu_kernels": ("the VAE's CPU kernels: oneDNN conv3d for every shape, a plain sum-of-squares norm "
                        "(off: PyTorch's own choice, as diffusers runs)",
                        lambda p, on: p.decoder.vae.use_exact_kernels(not on)),
}


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


def rounds(comm, preset: str, switch: str, chunks: int, n_rounds: int, steady_from: int,
           workload: str = "pipeline") -> dict:
    """workload 'pipeline': whole chunks (condition, DiT, decode, pixels); 'dit': the DiT session alone
    (prepare, probes, commit) on given condition latents."""
    from lingbot.builder import build_pipeline
    from lingbot.runtime.condition import LatentCondition
    torch.set_grad_enabled(False)
    pipe = build_pipeline(preset, comm=comm, compile=False)
    p = pipe.preset
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, p.height, p.width, generator=g) * 2 - 1
    latents = torch.randn(16, 3 * chunks, *p.latent_hw, generator=g)
    setter = SWITCHES[switch][1]
    out = {True: [], False: [], "first": {True: [], False: []}}
    for r in range(n_rounds):
        order = (True, False) if r % 2 == 0 else (False, True)       # alternate which side goes first
        for on in order:
            setter(pipe, on)
            if workload == "dit":
                session = pipe.runner.new_session(LatentCondition(latents), prompt="a harbour at dawn", seed=r)
                step = session.run_chunk
            else:
                session = pipe.new_session(image, "a harbour at dawn", seed=r)
                step = session.step
            times = []
            for _k in range(chunks):
                t0 = time.perf_counter()
                step(Controls(keys=("w", "", "l")))
                times.append(time.perf_counter() - t0)
            out[on].append(statistics.median(times[steady_from:]))
            out["first"][on].append(times[0])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steady-from", type=int, default=None)
    ap.add_argument("--workload", choices=["pipeline", "dit"], default=None,
                    help="default: dit for camera_cache, pipeline otherwise")
    args = ap.parse_args(argv)
    dit_switches = ("camera_cache", "compile")
    workload = args.workload or ("dit" if args.switch in dit_switches else "pipeline")
    if workload == "dit" and args.switch not in dit_switches:
        ap.error(f"{args.switch} acts outside the DiT: use --workload pipeline")
    if args.switch == "pixel_mode" and args.sp < 2:
        ap.error("pixel_mode needs --sp >= 2")
    chunks = args.chunks or (16 if args.switch == "fixed_point_skip" else 10)
    steady_from = args.steady_from if args.steady_from is not None else (11 if args.switch == "fixed_point_skip" else 6)
    if chunks <= steady_from:
        ap.error(f"--chunks must exceed the steady start {steady_from}")
    if args.sp > 1:
        from lingbot.parallel.launch import run_local
        result = run_local(rounds, args.sp, args.preset, args.switch, chunks, args.rounds, steady_from, workload,
                           timeout_s=900)[0]
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        result = rounds(Comm(), args.preset, args.switch, chunks, args.rounds, steady_from, workload)
    ratios = [off / on for on, off in zip(result[True], result[False])]
    print(f"A/B {args.switch}: {SWITCHES[args.switch][0]}; {args.preset}, SP-{args.sp}, {workload} workload, "
          f"{args.rounds} alternating rounds, steady chunks {steady_from}..{chunks - 1}")
    print(f"  on : median {statistics.median(result[True]) * 1e3:8.1f} ms   rounds "
          + ", ".join(f"{v * 1e3:.1f}" for v in result[True]))
    print(f"  off: median {statistics.median(result[False]) * 1e3:8.1f} ms   rounds "
          + ", ".join(f"{v * 1e3:.1f}" for v in result[False]))
    print(f"  off/on = {statistics.median(ratios):.3f} (spread {min(ratios):.3f} .. {max(ratios):.3f})")
    first = {on: ", ".join(f"{v * 1e3:.0f}" for v in result["first"][on]) for on in (True, False)}
    print(f"  first chunk of each round (ms): on {first[True]}; off {first[False]}")


if __name__ == "__main__":
    main()
