"""Decode time per chunk, the Wan decoder against the tiny one (TAEHV taew2_1), side by side in one run, at the
tiny preset's size (its narrowed decoders) and at 480x832 (the real decoders' dims, random weights).

    python -m perf.decode_time [--device cpu] [--threads N] [--steps 24] [--wan-columns 8] [--tae-columns 0]

Both decoders run one latent frame per step (a steady chunk is 3 identical steps: lingbot/models/vae.py and
tae.py), so a steady chunk costs 3 steady steps; the script times steady steps (after the stream's first
latent frame, not timed) and reports 3x their median. At 480x832 on a CPU a chunk of the Wan decoder is
40.7 TFLOP, many minutes on two cores, so there it decodes a strip of `--wan-columns` latent columns of the
104 (the whole height) and its time is scaled by 104 / columns: its convolutions cost in proportion to the
width (its per-frame attention, 0.3% of its FLOPs at full width, is the exception). The tiny decoder runs
the full width (`--tae-columns 0`): on a narrow strip its small 2-D convolutions run far below their
full-width rate, so a strip would overstate it. FLOPs are counted on the meta device at the full size
(torch's FlopCounterMode); GFLOP/s is on what was timed. On an accelerator both run the full width by
default, in their serving dtypes (config.tae_dtype, the preset's vae_dtype), with the peak device memory.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from torch.utils.flop_counter import FlopCounterMode

from lingbot.config import Preset, get_preset, parse_dtype, tae_dtype
from lingbot.io.weights import build_random_tae, build_random_vae
from lingbot.models.tae import TinyDecoder
from lingbot.models.vae import CausalCache, WanVAE
from perf.timing import time_chunks

SIZES = {"tiny": "tiny", "480x832": "lingbot-world-v2-14b"}


def build(preset: Preset, decoder: str, device: torch.device):
    if decoder == "wan":
        return build_random_vae(preset.vae, preset.weights_seed or 0, parse_dtype(preset.vae_dtype)).to(device)
    return build_random_tae(preset.tae, preset.weights_seed or 0, tae_dtype(device), device)


def steady_step_flops(preset: Preset, decoder: str) -> float:
    """FLOPs of one steady latent-frame step at the preset's full size (meta device: shapes only)."""
    lh, lw = preset.latent_hw
    with torch.device("meta"):
        model = WanVAE(preset.vae) if decoder == "wan" else TinyDecoder(preset.tae)
        cache = CausalCache()
        model.decode(torch.zeros(1, 16, 1, lh, lw), cache)
        with FlopCounterMode(display=False) as counter:
            model.decode(torch.zeros(1, 16, 1, lh, lw), cache)
    return float(counter.get_total_flops())


@torch.no_grad()
def time_steps(model, latent_hw: tuple[int, int], steps: int, device: torch.device) -> tuple[list[float], int]:
    """Seconds of `steps` steady latent-frame steps (after an untimed first one); peak device bytes (cuda)."""
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, steps + 1, *latent_hw, generator=g).to(device)
    cache = CausalCache()
    model.decode(latents[:, :, :1], cache)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    frames = iter(latents[:, :, 1:].split(1, dim=2))                # [1, 16, 1, h, w] each
    times = time_chunks(lambda: model.decode(next(frames), cache), steps, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return times.seconds, peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default torch's); on cores shared with other work 1 is the steady figure: the "
                        "tiny decoder's many small kernels wait at every thread barrier for a descheduled thread")
    p.add_argument("--sizes", default="tiny,480x832", help=f"comma-separated of {list(SIZES)}")
    p.add_argument("--steps", type=int, default=24, help="steady latent-frame steps timed at the tiny size")
    p.add_argument("--big-steps", type=int, default=1, help="steady steps timed at 480x832")
    p.add_argument("--wan-columns", type=int, default=None,
                   help="latent columns the Wan decoder decodes at 480x832 (0: the full width; default 8 on cpu, "
                        "0 elsewhere)")
    p.add_argument("--tae-columns", type=int, default=0, help="the same for the tiny decoder (default the full width)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    wan_columns = args.wan_columns if args.wan_columns is not None else (8 if device.type == "cpu" else 0)
    frames = get_preset("tiny").transformer.num_frames_per_block
    print(f"decode per steady chunk ({frames} latent frames) on {device}, {torch.get_num_threads()} threads, "
          f"random weights")
    header = (f"{'size':>8} {'decoder':>8} {'widths':>18} {'dtype':>9} {'timed':>14} {'ms/chunk':>10} "
              f"{'GFLOP/chunk':>12} {'GFLOP/s':>8} {'peak MiB':>9} {'wan/tae':>8}")
    print(header)
    for size in args.sizes.split(","):
        preset = get_preset(SIZES[size])
        preset = dataclasses.replace(preset, weights_seed=preset.weights_seed or 0)
        lh, lw = preset.latent_hw
        steps = args.steps if size == "tiny" else args.big_steps
        per_chunk = {}
        for decoder in ("wan", "tae"):
            columns = wan_columns if decoder == "wan" else args.tae_columns
            strip = size != "tiny" and 0 < columns < lw
            hw = (lh, columns) if strip else (lh, lw)
            model = build(preset, decoder, device)
            times, peak = time_steps(model, hw, steps, device)
            step = statistics.median(times)
            chunk = frames * step * (lw / hw[1])                    # scaled to the full width on a strip
            flops = frames * steady_step_flops(preset, decoder)
            per_chunk[decoder] = chunk
            widths = f"base_dim {preset.vae.base_dim}" if decoder == "wan" else str(tuple(preset.tae.channels))
            dtype = str(model.dtype).replace("torch.", "")
            timed = f"{hw[0]}x{hw[1]} latent" if strip else "full"
            ratio = f"{per_chunk['wan'] / chunk:8.1f}" if decoder == "tae" else ""
            print(f"{size:>8} {decoder:>8} {widths:>18} {dtype:>9} {timed:>14} {chunk * 1e3:>10.1f} "
                  f"{flops / 1e9:>12.1f} {flops / chunk / 1e9:>8.1f} {peak / 2 ** 20:>9.0f} {ratio:>8}")
            del model


if __name__ == "__main__":
    main()
