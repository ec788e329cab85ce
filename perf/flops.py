"""FLOPs per chunk of a preset's DiT (default: lingbot-world-v2-14b at 480x832), by chunk index.

    python -m perf.flops [--preset NAME]
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


if __name__ == "__main__":
    main()
