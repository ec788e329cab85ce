"""The first-frame condition cache across sessions: time to the first chunk and the first ten chunks of a
session from an image seen before (warm: conditions replayed, no encoder) against a new image (cold),
alternating in one run.

    python -m perf.condition_cache [--preset tiny] [--rounds 3] [--chunks 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lingbot.builder import build_pipeline
from lingbot.camera import Controls


def session_times(pipeline, image, chunks: int) -> list[float]:
    session = pipeline.new_session(image, "a lighthouse on a cliff at dusk", seed=0)
    times = []
    for _ in range(chunks):
        t0 = time.perf_counter()
        session.step(Controls(keys=("w", "", "l")))
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.set_grad_enabled(False)
    pipeline = build_pipeline(args.preset, compile=False)
    p = pipeline.preset
    seen = torch.rand(3, p.height, p.width, generator=torch.Generator().manual_seed(0)) * 2 - 1
    session_times(pipeline, seen, 16)                        # reaches the fixed point: `seen` is now cached
    assert pipeline.condition_cache.get(pipeline.condition_cache.key(seen)) is not None, "no fixed point in 16"
    results = {"cold": [], "warm": []}
    for r in range(args.rounds):
        for kind in (("cold", "warm") if r % 2 == 0 else ("warm", "cold")):
            fresh = torch.rand(3, p.height, p.width, generator=torch.Generator().manual_seed(100 + r)) * 2 - 1
            results[kind].append(session_times(pipeline, seen if kind == "warm" else fresh, args.chunks))
    print(f"condition cache, {p.name} {p.width}x{p.height}, {args.rounds} alternating rounds, first {args.chunks} "
          f"chunks per session (in process: the first chunk's time is the engine's part of TTFC)")
    for kind, runs in results.items():
        first = statistics.median(t[0] for t in runs)
        total = statistics.median(sum(t) for t in runs)
        print(f"  {kind}: first chunk {first * 1e3:7.1f} ms   first {args.chunks} chunks {total * 1e3:8.1f} ms")
    ratio = statistics.median(sum(c) / sum(w) for c, w in zip(results["cold"], results["warm"]))
    ttfc = statistics.median(c[0] / w[0] for c, w in zip(results["cold"], results["warm"]))
    print(f"  cold/warm: first chunk {ttfc:.2f}x, first {args.chunks} chunks {ratio:.2f}x")


if __name__ == "__main__":
    main()
