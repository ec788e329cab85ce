"""FLOPs per chunk of a preset's DiT (default: lingbot-world-v2-14b at 480x832), by chunk index.

    python -m perf.flops [--preset NAME]

Then a steady chunk's FLOPs under the K/V windows a session may ask for (realtime_causal_sink_size /
realtime_causal_kv_cache_num_frames), against the model's own.
"""
from __future__ import annotations

import argparse

from lingbot.config import get_preset
from perf.cost_model import preset_chunk_flops, visible_keys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="lingbot-world-v2-14b")
    args = parser.parse_args(argv)
    preset = get_preset(args.preset)
    cfg = preset.transformer
    print(f"{preset.name}: {preset.width}x{preset.height}, {preset.tokens_per_frame} tokens/latent frame, "
          f"{cfg.num_frames_per_block * preset.tokens_per_frame} query tokens/chunk, dim {cfg.dim}, "
          f"{cfg.num_layers} layers, {len(preset.sampler.timesteps)} probes + 1 commit")
    print(f"{'chunk':>5} {'keys':>7} {'prepare TF':>11} {'forward TF':>11} {'chunk TF':>10} "
          f"{'no-cam-cache TF':>16}")
    for k in (0, 1, 2, 3, 4, 5, 6, 10):
        f = preset_chunk_flops(preset, k)
        plain = preset_chunk_flops(preset, k, camera_cached=False)
        print(f"{k:>5} {visible_keys(cfg, preset.tokens_per_frame, k):>7} {f.prepare / 1e12:>11.1f} "
              f"{f.forward / 1e12:>11.1f} {f.total / 1e12:>10.1f} {plain.total / 1e12:>16.1f}")
    steady = preset_chunk_flops(preset, 6)
    print(f"steady state (chunk >= 6): {steady.total / 1e15:.3f} PFLOP per chunk "
          f"({steady.forwards} DiT forwards of {steady.forward / 1e12:.1f} TFLOP + {steady.prepare / 1e12:.1f} "
          f"TFLOP camera prepare)")
    print("a session's own window (sink, window chunks), a steady chunk:")
    print(f"{'sink':>5} {'window':>7} {'keys':>7} {'chunk TF':>9} {'saved':>7}")
    steady_at = 4 * cfg.window_chunks                           # far past any window's filling
    model = preset_chunk_flops(preset, steady_at).total
    for window in window_table(cfg.sink_chunks, cfg.window_chunks):
        f = preset_chunk_flops(preset, steady_at, window=window).total
        print(f"{window[0]:>5} {window[1]:>7} {visible_keys(cfg, preset.tokens_per_frame, steady_at, window):>7} "
              f"{f / 1e12:>9.1f} {1 - f / model:>7.1%}")


def window_table(sink: int, size: int) -> list[tuple[int, int]]:
    """The model's window, then smaller windows with its sink (down to sink + 2), then smaller sinks."""
    return ([(sink, w) for w in range(size, sink + 1, -1)] +
            [(s, size) for s in range(sink - 1, -1, -1)] + [(1, 3), (0, 2)])


if __name__ == "__main__":
    main()
