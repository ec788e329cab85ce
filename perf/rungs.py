"""What each step rung of the quality ladder costs per chunk (lingbot/runtime/rungs.py): measured in process on a
preset (default: tiny, CPU), side by side in one run, and modelled at 14B (perf/cost_model.py).

    python -m perf.rungs [--preset tiny] [--chunks 8] [--threads 1]

Three sessions alike (same image, prompt, seed, keys) run chunk by chunk in turn, one at full steps, one at 3,
one at 2, so the machine's load falls on all three alike; a chunk's DiT time is its prepare, probes and commit
(the condition and the decode are a rung's business only through the decoder, timed by perf/decode_time.py).
The sink (chunks 0-2) runs every step on every rung, so the medians are over the chunks after it.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from lingbot.builder import build_pipeline
from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.runtime.rungs import kept_steps
from perf.cost_model import preset_chunk_flops

STEPS = (None, 3, 2)
DIT_STAGES = ("prepare", "probe_0", "probe_1", "probe_2", "probe_3", "commit")


def modelled(preset_name: str = "lingbot-world-v2-14b", chunk: int = 24) -> dict:
    """A steady chunk's DiT FLOPs per rung at `preset_name`: the camera prepare plus one forward per probe kept
    and the commit."""
    preset = get_preset(preset_name)
    f = preset_chunk_flops(preset, chunk)
    n = len(preset.sampler.timesteps)
    return {steps: f.prepare + f.forward * (len(kept_steps(n, steps)) + 1) for steps in STEPS}


def measure(preset: str, chunks: int, seed: int = 3) -> dict:
    pipe = build_pipeline(preset, seed=0)
    image = torch.rand(3, pipe.preset.height, pipe.preset.width, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    sessions = {steps: pipe.new_session(image, "a harbour at dusk", seed=seed) for steps in STEPS}
    times = {steps: [] for steps in STEPS}
    for k in range(chunks):
        for steps, session in sessions.items():
            chunk = session.step(Controls(keys=("w", "", "d")), steps=steps)
            if k >= session.dit.kv.sink_chunks:
                times[steps].append(sum(chunk.timings.get(s, 0.0) for s in DIT_STAGES))
    return {steps: statistics.median(t) for steps, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    measured = measure(args.preset, args.chunks)
    model = modelled()
    n = len(get_preset(args.preset).sampler.timesteps)
    print(f"{'rung':>7} {'probes kept':>12} {args.preset + ' DiT ms':>14} {'ratio':>6} {'14B TFLOP':>10} {'ratio':>6}")
    for steps in STEPS:
        name = "full" if steps is None else f"steps{steps}"
        ratio, model_ratio = measured[steps] / measured[None], model[steps] / model[None]
        print(f"{name:>7} {kept_steps(n, steps)!s:>12} {measured[steps] * 1e3:>14.1f} {ratio:>6.2f} "
              f"{model[steps] / 1e12:>10.1f} {model_ratio:>6.2f}")


if __name__ == "__main__":
    main()
