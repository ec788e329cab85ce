"""H.264 encode time of one chunk (12 frames) at the real 480x832, per encoder and setting, in one run:
x264 presets and thread counts, and NVENC where this machine has it (a GPU node's driver).

    python -m perf.encode_time [--chunks 6] [--width 832] [--height 480]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from lingbot.io.video import FragmentedMp4Encoder, H264Settings, pick_h264_encoder

SETTINGS = [H264Settings("libx264", "ultrafast", threads=1), H264Settings("libx264", "ultrafast"),
            H264Settings("libx264", "veryfast", threads=1), H264Settings("libx264", "veryfast"),
            H264Settings("h264_nvenc", "p1")]


def chunk_times(settings: H264Settings, width: int, height: int, chunks: int) -> list[float]:
    rng = np.random.RandomState(0)
    base = rng.randint(0, 255, (height, width, 3), dtype=np.uint8)
    encoder = FragmentedMp4Encoder(width, height, 16.0, settings)
    times = []
    for k in range(chunks):
        # a moving, textured picture: each frame shifts the base image (noise alone would be unrealistically hard)
        frames = np.stack([np.roll(base, 4 * (12 * k + i), axis=1) for i in range(12)])
        t0 = time.perf_counter()
        encoder.encode_chunk(frames)
        times.append(time.perf_counter() - t0)
    return times[1:]                                   # the first chunk carries the encoder's start-up


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    args = ap.parse_args(argv)
    nvenc = pick_h264_encoder("auto", args.width, args.height) == "h264_nvenc"
    print(f"H.264 encode of one 12-frame chunk at {args.width}x{args.height} (median of {args.chunks - 1} chunks)")
    for s in SETTINGS:
        name = f"{s.encoder} {s.preset} threads={s.threads or 'auto'}"
        if s.encoder == "h264_nvenc" and not nvenc:
            print(f"  {name:<34} not available on this machine")
            continue
        times = chunk_times(s, args.width, args.height, args.chunks)
        print(f"  {name:<34} {statistics.median(times) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
