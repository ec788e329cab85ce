"""Per-chunk wall time of the in-process runner (default: tiny on this machine's CPU).

Runs one session past warm-up (chunks 0..5 fill the window) and reports the steady-state median over
`--steady` chunks, the stage split, and the camera-modulation cache A/B (on/off alternating, one run).

    python -m perf.chunk_time [--preset tiny] [--steady 12] [--model-path DIR] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lingbot.builder import build_dit_runner
from lingbot.camera import Controls
from lingbot.runtime.condition import LatentCondition

KEYS = [("w", "w", "w"), ("wa", "", "l"), ("", "i", "j")]


def run_session(runner, chunks: int, seed: int = 0) -> list:
    lh, lw = runner.latent_hw
    frames = chunks * runner.config.num_frames_per_block
    cond = LatentCondition(torch.randn(16, frames, lh, lw, generator=torch.Generator().manual_seed(seed),
                                       device="cpu").to(runner.device))
    session = runner.new_session(cond, prompt="a lighthouse on a cliff at dusk", seed=seed)
    results = []
    for k in range(chunks):
        t0 = time.perf_counter()
        r = session.run_chunk(Controls(keys=KEYS[k % len(KEYS)]), profile=runner.device.type != "cpu")
        if runner.device.type != "cpu":
            torch.accelerator.synchronize(runner.device)
        r.timings["total"] = time.perf_counter() - t0
        results.append(r)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-path", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--steady", type=int, default=12, help="steady-state chunks to time (>= 10)")
    p.add_argument("--ab-rounds", type=int, default=6, help="alternating rounds of the camera-cache A/B")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    runner = build_dit_runner(args.preset, args.model_path, device=args.device)
    warm = runner.config.window_chunks
    results = run_session(runner, warm + args.steady)
    steady = results[warm:]
    print(f"{args.preset} on {args.device} ({torch.get_num_threads()} threads): "
          f"{runner.preset.width}x{runner.preset.height}, {len(steady)} steady chunks (index >= {warm})")
    for stage in ["condition", "prepare", "probe_0", "probe_1", "probe_2", "probe_3", "commit", "total"]:
        vals = [r.timings[stage] * 1e3 for r in steady]
        print(f"  {stage:>8}: median {statistics.median(vals):8.2f} ms   min {min(vals):8.2f}   max {max(vals):8.2f}")
    warm_vals = [r.timings["total"] * 1e3 for r in results[1:warm]]
    print(f"  warm-up chunks 1..{warm - 1} median {statistics.median(warm_vals):.2f} ms")

    # A/B: camera modulation cached once per chunk (on) vs recomputed in all 5 forwards (off)
    times = {True: [], False: []}
    for _ in range(args.ab_rounds):
        for cached in (True, False):
            runner.cache_camera_modulation = cached
            rs = run_session(runner, warm + 4)[warm:]
            times[cached].append(statistics.median(r.timings["total"] for r in rs))
    ratios = [off / on for on, off in zip(times[True], times[False])]
    print(f"camera-modulation cache A/B ({args.ab_rounds} alternating rounds): off/on = "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"on {statistics.median(times[True]) * 1e3:.2f} ms, off {statistics.median(times[False]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
