"""Sequence parallel on this machine: SP-N against SP-1 per-chunk time (one run, side by side), bytes
sent per chunk per rank as counted by the Comm wrapper, and the analytical figure for a real preset.

    python -m perf.sp_time [--sp 2] [--chunks 12] [--preset tiny] [--real lingbot-world-v2-14b]

Not a switch of perf.ab: the two sides are different worlds (SP-1 in this process, SP-N in N spawned ranks
over gloo), not one pipeline set two ways. `measure` is also the in-process side of perf.serve_overhead.
"""
from __future__ import annotations

import argparse
import os
from functools import partial

import torch

from lingbot.builder import build_pipeline
from lingbot.config import get_preset
from lingbot.parallel import Comm
from lingbot.parallel.launch import run_local
from perf.cost_model import sp_dit_bytes_per_chunk, sp_pixel_bytes_per_chunk
from perf.timing import STEADY_FROM, time_chunks, whole_chunk, whole_session


def measure(comm, preset: str, chunks: int) -> dict:
    """Steady-chunk medians (index >= 6) of the DiT (prepare + probes + commit) and of the whole chunk (+ the
    condition encode, the decode and the pixels to the root), the bytes this rank sent in the last chunk, and
    the condition's fixed-point chunk (its first frame is new: the encoder runs until then)."""
    torch.set_grad_enabled(False)
    pipe = build_pipeline(preset, comm=comm)
    session = whole_session(pipe)
    sent = []

    def count(index, seconds, chunk) -> None:
        sent.append(dict(comm.bytes_sent))
        comm.reset_counts()
    comm.reset_counts()
    times = time_chunks(partial(whole_chunk, session), chunks, pipe.runner.device, each=count)
    return {"dit_s": times.dit_median(), "step_s": times.median(), "sent": sent[-1],
            "fixed_point_chunk": session.condition.fixed_point_chunk}


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
    print(f"{args.preset}, steady chunks {STEADY_FROM}..{args.chunks - 1}, this machine ({os.cpu_count()} cores):")
    print(f"  SP-1: DiT {one['dit_s'] * 1e3:8.1f} ms   whole chunk {one['step_s'] * 1e3:8.1f} ms")
    for r, m in enumerate(many):
        print(f"  SP-{args.sp} rank {r}: DiT {m['dit_s'] * 1e3:8.1f} ms   whole chunk {m['step_s'] * 1e3:8.1f} ms")
    print(f"  ratio SP-{args.sp}/SP-1: DiT {many[0]['dit_s'] / one['dit_s']:.2f}x, "
          f"whole chunk {many[0]['step_s'] / one['step_s']:.2f}x")
    p = get_preset(args.preset)
    for r, m in enumerate(many):
        model = sp_dit_bytes_per_chunk(p.transformer, p.tokens_per_frame, args.sp, r, 4)
        pix = sp_pixel_bytes_per_chunk(p.height, p.width, 12, p.latent_hw[1], args.sp, r)
        counted = ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in sorted(m['sent'].items()))
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
