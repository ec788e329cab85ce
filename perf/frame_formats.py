"""What each output format costs per chunk (12 frames) at the real 480x832, side by side in one run: bytes
on the wire, the bitrate of a session at its frame rate, the muxer's build time and the client's restore
time, for the first protocol's H.264 fMP4 and the second protocol's raw, delta-gzip, WebP and JPEG frames.

Two pictures: `pan`, a smooth textured scene moving 4 px per frame with fresh grain in every frame (what
a camera walk looks like), and
`noise`, uniform random pixels (the tiny preset's random weights produce noise-like frames: the worst case).

    python -m perf.frame_formats [--chunks 4] [--fps 16] [--width 832] [--height 480]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from lingbot.io.frames import FrameBatcher, FrameFormat, decode_images, restore_delta_gzip
from lingbot.io.video import FragmentedMp4Encoder, H264Settings, read_frames

FORMATS = [("fmp4 (x264 veryfast)", None), ("raw", FrameFormat("raw")),
           ("raw delta-gzip", FrameFormat("raw", delta=True)), ("webp q90", FrameFormat("webp", 90)),
           ("jpeg q95", FrameFormat("jpeg", 95)), ("jpeg q95, 416 wide", FrameFormat("jpeg", 95, max_width=416))]


def scene(kind: str, width: int, height: int, chunks: int) -> list[np.ndarray]:
    rng = np.random.RandomState(0)
    if kind == "noise":
        return [rng.randint(0, 256, (12, height, width, 3), dtype=np.uint8) for _ in range(chunks)]
    y, x = np.mgrid[0:height, 0:width + 4 * 12 * chunks].astype(np.float32)
    base = 128 + 60 * np.sin(x / 37.0)[..., None] * np.cos(y / 23.0)[..., None] \
        + np.array([30.0, -10.0, 20.0]) * np.sin((x + y) / 91.0)[..., None]
    base = base + rng.normal(0, 6, base.shape)                  # texture
    def frame(i):                                                # moved 4 px, with fresh grain (std 2) each frame
        return np.clip(base[:, 4 * i:4 * i + width] + rng.normal(0, 2, (height, width, 3)), 0, 255).astype(np.uint8)
    return [np.stack([frame(12 * k + i) for i in range(12)]) for k in range(chunks)]


def measure(fmt, chunks: list[np.ndarray], width: int, height: int, fps: float) -> dict:
    sizes, build, restore = [], [], []
    if fmt is None:
        encoder = FragmentedMp4Encoder(width, height, fps, H264Settings("libx264", "veryfast"))
        stream = b""
        for frames in chunks:
            t0 = time.perf_counter()
            data = encoder.encode_chunk(frames)
            build.append(time.perf_counter() - t0)
            sizes.append(len(data))
            stream += data
        t0 = time.perf_counter()
        read_frames(stream)
        restore = [(time.perf_counter() - t0) / len(chunks)] * len(chunks)
    else:
        batcher, reference = FrameBatcher(fmt, width, height), None
        for frames in chunks:
            t0 = time.perf_counter()
            batches = batcher.batches(frames)
            build.append(time.perf_counter() - t0)
            sizes.append(sum(len(b.payload) for b in batches))
            t0 = time.perf_counter()
            for b in batches:
                if fmt.kind != "raw":
                    decode_images(b.payload, b.lengths)
                elif fmt.delta:
                    w, h = fmt.image_size(width, height)
                    reference = restore_delta_gzip(b.payload, w, h, b.num_frames,
                                                   reference if b.delta_reference else None)[-1]
            restore.append(time.perf_counter() - t0)
    size = statistics.median(sizes[1:] or sizes)      # the first fMP4 chunk carries the init segment
    return {"bytes": size, "mbit_s": size * 8 / (12 / fps) / 1e6, "build_ms": statistics.median(build) * 1e3,
            "restore_ms": statistics.median(restore) * 1e3}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--fps", type=float, default=16.0)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    args = ap.parse_args(argv)
    raw_bytes = 12 * args.width * args.height * 3
    for kind in ("pan", "noise"):
        chunks = scene(kind, args.width, args.height, args.chunks)
        print(f"{kind}: one 12-frame chunk at {args.width}x{args.height}, {args.fps:g} fps "
              f"(median of {args.chunks} chunks; raw = {raw_bytes / 2 ** 20:.1f} MiB)")
        print(f"  {'format':<22} {'bytes/chunk':>12} {'vs raw':>8} {'Mbit/s':>8} {'build ms':>9} {'restore ms':>11}")
        for name, fmt in FORMATS:
            m = measure(fmt, chunks, args.width, args.height, args.fps)
            print(f"  {name:<22} {m['bytes']:>12,.0f} {m['bytes'] / raw_bytes:>8.3f} {m['mbit_s']:>8.1f} "
                  f"{m['build_ms']:>9.1f} {m['restore_ms']:>11.1f}")


if __name__ == "__main__":
    main()
