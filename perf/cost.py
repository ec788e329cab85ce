"""Cost model, one command: the FLOPs of a preset's chunks and what this machine achieves of its peak.

    python -m perf.cost [--preset tiny] [--device cpu] [--dtype float32] [--chunks 14]
    python -m perf.cost --preset lingbot-world-v2-14b --no-measure      (FLOPs only: the 14B on a CPU box)

Prints, from perf/cost_model.py (analytical for the DiT, torch's FLOP counter on the meta device for the VAE):
- the DiT by chunk index: the keys a forward attends, the camera prepare, one forward, the chunk (4 probes + 1
  commit), and the chunk without the camera-modulation cache;
- the whole chunk: DiT, VAE decode, condition encode (none after the encoder's fixed point);
- a steady chunk under each K/V window a session may ask for (realtime_causal_sink_size /
  realtime_causal_kv_cache_num_frames), against the model's own window;
then (without --no-measure) the measured matmul peak and the achieved fraction of it: a session of --chunks
whole chunks timed (perf/timing.py), its steady chunks after the fixed point.
"""
from __future__ import annotations

import argparse
from functools import partial

from lingbot.config import Preset, get_preset
from perf.cost_model import chunk_flops, matmul_peak, preset_chunk_flops, visible_keys


def window_table(sink: int, size: int) -> list[tuple[int, int]]:
    """The model's window, then smaller windows with its sink (down to sink + 2), then smaller sinks."""
    return ([(sink, w) for w in range(size, sink + 1, -1)] +
            [(s, size) for s in range(sink - 1, -1, -1)] + [(1, 3), (0, 2)])


def print_flops(preset: Preset) -> None:
    cfg, tokens = preset.transformer, preset.tokens_per_frame
    steady = preset_chunk_flops(preset, 6)
    scale, unit = (1e12, "TFLOP") if steady.total > 1e13 else (1e9, "GFLOP")
    print(f"{preset.name}: {preset.width}x{preset.height}, {tokens} tokens/latent frame, "
          f"{cfg.num_frames_per_block * tokens} query tokens/chunk, dim {cfg.dim}, {cfg.num_layers} layers, "
          f"{len(preset.sampler.timesteps)} probes + 1 commit; {unit}")
    print(f"DiT by chunk index\n{'chunk':>5} {'keys':>7} {'prepare':>10} {'forward':>10} {'chunk':>10} "
          f"{'no camera cache':>16}")
    for k in (0, 1, 2, 3, 4, 5, 6, 10):
        f, plain = preset_chunk_flops(preset, k), preset_chunk_flops(preset, k, camera_cached=False)
        print(f"{k:>5} {visible_keys(cfg, tokens, k):>7} {f.prepare / scale:>10.2f} {f.forward / scale:>10.2f} "
              f"{f.total / scale:>10.2f} {plain.total / scale:>16.2f}")
    print(f"steady (chunk >= 6): {steady.forwards} DiT forwards of {steady.forward / scale:.2f} + "
          f"{steady.prepare / scale:.2f} camera prepare = {steady.total / scale:.2f} {unit} per chunk")
    print(f"whole chunk\n{'chunk':>22} {'DiT':>10} {'decode':>10} {'condition':>10} {'total':>10}")
    rows = [(k, chunk_flops(preset, k)) for k in (0, 1, 6)]
    rows.append(("6 (after fixed point)", chunk_flops(preset, 6, condition_encoded=False)))
    for k, f in rows:
        print(f"{k!s:>22} {f['dit'] / scale:>10.2f} {f['decode'] / scale:>10.2f} {f['condition'] / scale:>10.2f} "
              f"{f['total'] / scale:>10.2f}")
    print(f"a session's own window (sink, window chunks), a steady DiT chunk\n{'sink':>5} {'window':>7} {'keys':>7} "
          f"{'chunk':>10} {'saved':>7}")
    steady_at = 4 * cfg.window_chunks                           # far past any window's filling
    model = preset_chunk_flops(preset, steady_at).total
    for window in window_table(cfg.sink_chunks, cfg.window_chunks):
        f = preset_chunk_flops(preset, steady_at, window=window).total
        print(f"{window[0]:>5} {window[1]:>7} {visible_keys(cfg, tokens, steady_at, window):>7} {f / scale:>10.2f} "
              f"{1 - f / model:>7.1%}")


def print_achieved(preset: Preset, device: str, dtype: str, chunks: int, model_path=None) -> None:
    import torch

    from lingbot.builder import build_pipeline
    from perf.timing import STEADY_FROM, time_chunks, whole_chunk, whole_session
    peak = matmul_peak(device, dtype)
    torch.set_grad_enabled(False)
    pipe = build_pipeline(preset, model_path, device=device)
    session = whole_session(pipe)
    times = time_chunks(partial(whole_chunk, session), chunks, pipe.runner.device)
    fixed = session.condition.fixed_point_chunk
    start = fixed + 1 if fixed is not None else STEADY_FROM
    dit_s, dec_s = times.dit_median(start), times.stage_median("decode", start=start)
    f = chunk_flops(preset, 6, condition_encoded=fixed is None)
    print(f"matmul peak on {device} ({dtype}, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s")
    print(f"steady chunk (chunks {start}..{chunks - 1}): DiT {dit_s * 1e3:.1f} ms = {f['dit'] / dit_s / 1e9:.2f} "
          f"GFLOP/s ({f['dit'] / dit_s / peak:.1%} of peak); decode {dec_s * 1e3:.1f} ms = "
          f"{f['decode'] / dec_s / 1e9:.2f} GFLOP/s ({f['decode'] / dec_s / peak:.1%} of peak)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="matmul dtype for the peak (default: the preset's)")
    ap.add_argument("--chunks", type=int, default=14, help="whole chunks timed (steady: after the fixed point)")
    ap.add_argument("--no-measure", action="store_true", help="FLOPs only (e.g. for the 14B on a CPU box)")
    ap.add_argument("--model-path", default=None)
    args = ap.parse_args(argv)
    preset = get_preset(args.preset)
    print_flops(preset)
    if not args.no_measure:
        print_achieved(preset, args.device, args.dtype or preset.dtype, args.chunks, args.model_path)


if __name__ == "__main__":
    main()
