"""Sequence parallel on this machine: SP-N against SP-1 per-chunk time (one run, side by side), bytes
sent per chunk per rank as counted by the Comm wrapper, and the analytical figure for a real preset.

    python -m perf.sp_time [--sp 2] [--chunks 10] [--preset tiny] [--real lingbot-world-v2-14b]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.parallel import Comm
from lingbot.parallel.launch import run_local
from perf.cost_model import sp_dit_bytes_per_chunk, sp_pixel_bytes_per_chunk


def measure(comm, preset: str, chunks: int):
    """Steady-chunk medians (index >= 6) of the DiT (prepare + probes + commit) and of the full pipeline
    step (+ condition encode + decode + pixels to root), and bytes sent in the last chunk."""
    from lingbot.builder import build_pipeline
    torch.set_grad_enabled(False)
    pipe = build_pipeline(preset, comm=comm)
    p = pipe.preset
    image = torch.rand(3, p.height, p.width, generator=torch.Generator().manual_seed(0)) * 2 - 1
    session = pipe.new_session(image, "a lighthouse at dusk", seed=0)
    dit, total, sent = [], [], []
    for _k in range(chunks):
        comm.reset_counts()
        t0 = time.perf_counter()
        chunk = session.step(Controls(keys=("w", "", "l")))
        total.append(time.perf_counter() - t0)
        dit.append(sum(v for s, v in chunk.timings.items() if s not in ("decode", "condition")))
        sent.append(dict(comm.bytes_sent))
    steady = slice(6, None)
    return (statistics.median(dit[steady]), statistics.median(total[steady]), sent[-1],
            session.condition.fixed_point_chunk)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--real", default="lingbot-world-v2-14b")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    one = measure(Comm(), args.preset, args.chunks)
    many = run_local(measure, args.sp, args.preset, args.chunks, timeout_s=300)
    print(f"{args.preset}, steady chunks {6}..{args.chunks - 1}, this machine ({os.cpu_count()} cores):")
    print(f"  SP-1: DiT {one[0] * 1e3:8.1f} ms   full step {one[1] * 1e3:8.1f} ms")
    for r, m in enumerate(many):
        print(f"  SP-{args.sp} rank {r}: DiT {m[0] * 1e3:8.1f} ms   full step {m[1] * 1e3:8.1f} ms")
    print(f"  ratio SP-{args.sp}/SP-1: DiT {many[0][0] / one[0]:.2f}x, full step {many[0][1] / one[1]:.2f}x")
    p = get_preset(args.preset)
    for r, m in enumerate(many):
        model = sp_dit_bytes_per_chunk(p.transformer, p.tokens_per_frame, args.sp, r, 4)
        pix = sp_pixel_bytes_per_chunk(p.height, p.width, 12, p.latent_hw[1], args.sp, r)
        counted = ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in sorted(m[2].items()))
        print(f"  rank {r} sent per chunk (counted): {counted}; analytical DiT all_to_all "
              f"{model['all_to_all'] / 1e6:.3f} MB, all_gather {model['all_gather'] / 1e6:.3f} MB, "
              f"pixels {pix / 1e6:.3f} MB")
    real = get_preset(args.real)
    for n in (4, 8):
        b = sp_dit_bytes_per_chunk(real.transformer, real.tokens_per_frame, n, 0, 2)
        pix = sp_pixel_bytes_per_chunk(real.height, real.width, 12, real.latent_hw[1], n, 1)
        print(f"{real.name} {real.width}x{real.height} SP-{n}, bf16, per chunk per rank: all_to_all "
              f"{b['all_to_all'] / 1e9:.2f} GB, head all_gather {b['all_gather'] / 1e6:.1f} MB, "
              f"uint8 pixels to root {pix / 1e6:.2f} MB per non-root rank")


if __name__ == "__main__":
    main()
