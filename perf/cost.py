"""Cost model: FLOPs per chunk of any preset (DiT forwards, VAE decode, condition encode), this machine's
measured matmul peak, and the fraction of it the engine achieves (measured chunk time, same run).

    python -m perf.cost [--preset tiny] [--device cpu] [--dtype float32] [--chunks 14] [--no-measure]
"""
from __future__ import annotations

import argparse
import statistics

from lingbot.config import get_preset
from perf.cost_model import chunk_flops, matmul_peak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="matmul dtype for the peak (default: the preset's)")
    ap.add_argument("--chunks", type=int, default=14)
    ap.add_argument("--no-measure", action="store_true", help="FLOPs only (e.g. for the 14B on a CPU box)")
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args(argv)
    preset = get_preset(args.preset)
    rows = [(k, chunk_flops(preset, k)) for k in (0, 1, 6)]
    rows.append(("6 (after fixed point)", chunk_flops(preset, 6, condition_encoded=False)))
    print(f"{preset.name} {preset.width}x{preset.height}: GFLOP per chunk")
    print(f"{'chunk':>22} {'DiT':>12} {'decode':>10} {'condition':>10} {'total':>12}")
    for k, f in rows:
        print(f"{k!s:>22} {f['dit'] / 1e9:>12.2f} {f['decode'] / 1e9:>10.2f} {f['condition'] / 1e9:>10.2f} "
              f"{f['total'] / 1e9:>12.2f}")
    if args.no_measure:
        return
    import torch

    from lingbot.builder import build_pipeline
    dtype = args.dtype or preset.dtype
    peak = matmul_peak(args.device, dtype)
    torch.set_grad_enabled(False)
    pipe = build_pipeline(preset, args.model_path, device=args.device)
    g = torch.Generator().manual_seed(0)
    session = pipe.new_session(torch.rand(3, preset.height, preset.width, generator=g) * 2 - 1, "a harbour", seed=0)
    times = []
    for _ in range(args.chunks):
        chunk = session.step()
        times.append(chunk.timings)
    fixed = session.condition.fixed_point_chunk
    steady = times[(fixed + 1 if fixed is not None else 6):]
    dit_s = statistics.median(sum(v for s, v in t.items() if s not in ("decode", "pixels", "condition"))
                              for t in steady)
    dec_s = statistics.median(t["decode"] for t in steady)
    f = chunk_flops(preset, 6, condition_encoded=fixed is None)
    print(f"matmul peak on {args.device} ({dtype}, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s")
    print(f"steady chunk: DiT {dit_s * 1e3:.1f} ms = {f['dit'] / dit_s / 1e9:.2f} GFLOP/s "
          f"({f['dit'] / dit_s / peak:.1%} of peak); decode {dec_s * 1e3:.1f} ms = {f['decode'] / dec_s / 1e9:.2f} "
          f"GFLOP/s ({f['decode'] / dec_s / peak:.1%} of peak)")


if __name__ == "__main__":
    main()
