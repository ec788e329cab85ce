"""What each rung of the quality ladder costs per chunk (lingbot/runtime/rungs.py), and what a switch of decoders
costs: measured in process on a preset (default: tiny, CPU), side by side in one run, and modelled at 14B
(perf/cost_model.py, perf/decode_time.py).

    python -m perf.rungs [--preset tiny] [--chunks 8] [--threads 1]

Five sessions alike (same image, prompt, seed, keys; the Wan decoder their own, the tiny one loaded beside it)
run chunk by chunk in turn, one per rung (full, steps3, steps2, tiny, tiny_steps2), so the machine's load falls
on all of them alike; a chunk's time is its DiT stages (prepare, probes, commit) and its decode and pixels. The
sink (chunks 0-2) runs every step on every rung, so the medians are over the chunks after it.

Then the climb back from the tiny decoder to the Wan decoder, two ways on two more sessions: at once (the chunk
that switches decodes the 13 chunks of the ring first) and spread (one Wan decode a chunk ahead of the switch,
lingbot/runtime/decoding.py `prewarm`): the switching chunk's decode, and the extra a chunk pays while warming.
"""
from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from lingbot.builder import build_pipeline
from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.runtime.rungs import RUNGS, kept_steps
from perf.cost_model import preset_chunk_flops
from perf.decode_time import steady_step_flops
from perf.timing import KEYS, first_frame, time_in_turn, timed, whole_session

DIT_STAGES = ("prepare", "probe_0", "probe_1", "probe_2", "probe_3", "commit")
CHUNK_STAGES = (*DIT_STAGES, "decode", "pixels")


def modelled(preset_name: str = "lingbot-world-v2-14b", chunk: int = 24) -> dict[str, float]:
    """A steady chunk's FLOPs per rung at `preset_name`: the camera prepare, one forward per probe kept and the
    commit, and the decode of its 3 latent frames by the rung's decoder."""
    preset = get_preset(preset_name)
    f = preset_chunk_flops(preset, chunk)
    n, frames = len(preset.sampler.timesteps), preset.transformer.num_frames_per_block
    decode = {name: frames * steady_step_flops(preset, name) for name in ("wan", "tae")}
    return {r.name: f.prepare + f.forward * (len(kept_steps(n, r.steps)) + 1) + decode[r.decoder or "wan"]
            for r in RUNGS}


def _session(pipe, seed: int = 3):
    return whole_session(pipe, seed=seed, image=first_frame(pipe.preset, seed), prompt="a harbour at dusk",
                         decoder="wan", switch_to=["tae"])


def measure(pipe, chunks: int) -> dict[str, float]:
    """Median chunk time per rung (seconds), chunks past the sink (which runs every step on every rung)."""
    sink = pipe.runner.config.sink_chunks

    def chunk_at(rung):
        session = _session(pipe)
        return lambda: session.step(KEYS, steps=rung.steps if session.chunk_index >= sink else None,
                                    decoder=rung.decoder)
    times = time_in_turn({r.name: chunk_at(r) for r in RUNGS}, chunks, pipe.runner.device)
    return {name: t.stage_median(*CHUNK_STAGES, start=sink) for name, t in times.items()}


def measure_climb(pipe, chunks: int) -> dict[str, float]:
    """The climb from the tiny decoder back to the Wan decoder at chunk `chunks` - 1: the switching chunk's decode
    at once (the ring's 13 chunks first) and spread (one decode a chunk before it), the mean extra a chunk pays
    while the spread warm-up runs, and a steady Wan decode for scale (seconds)."""
    at_once, spread = _session(pipe), _session(pipe)
    n = at_once.decoding.warm_chunks("wan")
    last = chunks - 1
    extra = []
    for k in range(last):
        at_once.step(Controls(), decoder="tae")
        if k >= last - n - 1:
            extra.append(timed(pipe.runner.device, partial(spread.decoding.prewarm, "wan", k))[0])
        spread.step(Controls(), decoder="tae")
    assert spread.decoding.prewarm("wan", last), "the spread warm-up did not catch up"
    out = {}
    for name, session in (("at_once", at_once), ("spread", spread)):
        chunk = session.step(Controls())                              # back on its own decoder
        out[name] = chunk.timings["decode"]
    steady = at_once.step(Controls()).timings["decode"]
    return {**out, "warming_extra": statistics.mean(extra), "steady_wan_decode": steady, "warm_chunks": n}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--climb-chunks", type=int, default=18, help="chunks before the climb (>= 14: a full ring)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = build_pipeline(args.preset, seed=0, decoder=("wan", "tae"))
    measured = measure(pipe, args.chunks)
    model = modelled()
    n = len(get_preset(args.preset).sampler.timesteps)
    print(f"{'rung':>11} {'probes kept':>12} {'decoder':>8} {args.preset + ' chunk ms':>15} {'ratio':>6} "
          f"{'14B TFLOP':>10} {'ratio':>6}")
    for r in RUNGS:
        ratio, model_ratio = measured[r.name] / measured["full"], model[r.name] / model["full"]
        print(f"{r.name:>11} {kept_steps(n, r.steps)!s:>12} {r.decoder or 'wan':>8} {measured[r.name] * 1e3:>15.1f} "
              f"{ratio:>6.2f} {model[r.name] / 1e12:>10.1f} {model_ratio:>6.2f}")
    climb = measure_climb(pipe, args.climb_chunks)
    big = get_preset("lingbot-world-v2-14b")
    wan_tflop = big.transformer.num_frames_per_block * steady_step_flops(big, "wan") / 1e12
    print(f"\nclimb back to the Wan decoder ({climb['warm_chunks']} chunks of history):")
    print(f"  switching chunk's decode, at once: {climb['at_once'] * 1e3:.1f} ms; spread: {climb['spread'] * 1e3:.1f} "
          f"ms; a steady Wan decode: {climb['steady_wan_decode'] * 1e3:.1f} ms")
    print(f"  while spread, each chunk pays {climb['warming_extra'] * 1e3:.1f} ms more (one Wan decode)")
    print(f"  14B, modelled: at once {climb['warm_chunks'] + 1} Wan decodes in one chunk "
          f"({(climb['warm_chunks'] + 1) * wan_tflop:.0f} TFLOP), spread 1 a chunk ({wan_tflop:.1f} TFLOP)")


if __name__ == "__main__":
    main()
