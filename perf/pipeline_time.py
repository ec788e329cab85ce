"""Full in-process pipeline per-chunk time (condition encode, prepare, denoise, commit, decode), and the
condition-encoder fixed-point skip A/B (on/off alternating in one run, steady chunks only).

    python -m perf.pipeline_time [--preset tiny] [--chunks 16] [--rounds 2] [--model-path DIR] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lingbot.builder import build_pipeline
from lingbot.camera import Controls

STAGES = ["condition", "prepare", "denoise", "commit", "decode", "total"]


def run_session(pipeline, chunks: int, skip: bool, seed: int = 0) -> tuple[list[dict], int]:
    pipeline.skip_fixed_point = skip
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(3, pipeline.preset.height, pipeline.preset.width, generator=g) * 2 - 1
    session = pipeline.new_session(image, "a lighthouse on a cliff at dusk", seed=seed)
    rows = []
    for _k in range(chunks):
        t0 = time.perf_counter()
        chunk = session.step(Controls(keys=("w", "", "l")))
        frames = chunk.frames.cpu()                    # what leaves the device
        total = time.perf_counter() - t0
        tm = chunk.timings
        rows.append({"condition": tm["condition"], "prepare": tm["prepare"],
                     "denoise": sum(v for s, v in tm.items() if s.startswith("probe_")),
                     "commit": tm["commit"], "decode": tm["decode"], "total": total, "frames": len(frames)})
    return rows, session.condition.fixed_point_chunk


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-path", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunks", type=int, default=16, help="chunks per session (steady = after the fixed point)")
    p.add_argument("--rounds", type=int, default=2, help="alternating on/off rounds")
    args = p.parse_args(argv)
    pipeline = build_pipeline(args.preset, args.model_path, device=args.device)
    results = {True: [], False: []}
    fixed_at = None
    for _ in range(args.rounds):
        for skip in (True, False):
            rows, fp = run_session(pipeline, args.chunks, skip)
            results[skip].append(rows)
            fixed_at = fp if skip else fixed_at
    if fixed_at is None:
        print(f"fixed point not reached within {args.chunks} chunks; run more chunks")
        return
    steady_from = fixed_at + 1
    print(f"{args.preset} on {args.device}: {pipeline.preset.width}x{pipeline.preset.height}, fixed point at chunk "
          f"{fixed_at}; medians over chunks {steady_from}..{args.chunks - 1} of {args.rounds} sessions each")
    print(f"{'stage':>10} {'skip on ms':>11} {'skip off ms':>12}")
    for stage in STAGES:
        on = statistics.median(r[stage] for rows in results[True] for r in rows[steady_from:]) * 1e3
        off = statistics.median(r[stage] for rows in results[False] for r in rows[steady_from:]) * 1e3
        print(f"{stage:>10} {on:>11.2f} {off:>12.2f}")
    per_round = [statistics.median(r["total"] for r in off_rows[steady_from:])
                 - statistics.median(r["total"] for r in on_rows[steady_from:])
                 for on_rows, off_rows in zip(results[True], results[False])]
    ratio = [statistics.median(r["total"] for r in off_rows[steady_from:])
             / statistics.median(r["total"] for r in on_rows[steady_from:])
             for on_rows, off_rows in zip(results[True], results[False])]
    print(f"fixed-point skip saves {statistics.median(per_round) * 1e3:.1f} ms per steady chunk "
          f"(off/on = {statistics.median(ratio):.3f}, rounds: {', '.join(f'{r:.3f}' for r in ratio)})")
    first = results[True][0]
    warm = statistics.median(r["total"] for r in first[1:steady_from])
    print(f"warm-up medians (chunks 1..{fixed_at}): total {warm * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
