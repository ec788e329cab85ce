"""Frames on the wire without a video codec: raw RGB, raw RGB as XOR deltas under gzip, WebP or JPEG per frame,
cut into batches (the SGLang realtime video protocol, docs/architecture.md "The second protocol").

Plain numpy/Pillow: the muxer builds batches, the ingress frames them, the client restores them.
Frames are uint8 [H, W, 3] (RGB, row-major); a batch's payload is its frames' bytes one after another.
"""
from __future__ import annotations

import io
import math
import zlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

RAW = "application/x-raw-rgb"
RAW_DELTA_GZIP = "application/x-raw-rgb-delta-gzip"
WEBP = "image/webp"
JPEG = "image/jpeg"
CONTENT_TYPES = {"raw": RAW, "webp": WEBP, "jpeg": JPEG}
RAW_FRAMES_PER_BATCH = 16
IMAGE_FRAMES_PER_BATCH = 6
DEFAULT_COMPRESSION = {"webp": 90, "jpeg": 95}   # the image codecs' quality setting (1-100)
MAX_BATCH_BYTES = 8 * 2 ** 20               # a WebSocket message stays well under the proxy's 16 MiB frame limit
_GZIP = 31                                  # zlib wbits: a gzip container


@dataclass(frozen=True)
class FrameFormat:
    """How a session's frames travel: `kind` raw | webp | jpeg (fmp4 is the other protocol's H.264 path);
    `compression`: the image codec's quality setting, 1-100, for webp/jpeg (the client's output_compression);
    images are scaled to at most `max_width` (aspect kept); `delta`: raw frames as XOR with the previous frame,
    gzipped per batch."""
    kind: str = "fmp4"
    compression: int = 0
    max_width: Optional[int] = None
    delta: bool = False

    @property
    def content_type(self) -> str:
        return RAW_DELTA_GZIP if self.kind == "raw" and self.delta else CONTENT_TYPES[self.kind]

    def per_batch(self, frame_bytes: int) -> int:
        """Frames per batch: 16 raw or 6 images, fewer when 16 raw frames would pass MAX_BATCH_BYTES."""
        if self.kind != "raw":
            return IMAGE_FRAMES_PER_BATCH
        return max(1, min(RAW_FRAMES_PER_BATCH, MAX_BATCH_BYTES // max(1, frame_bytes)))

    def image_size(self, width: int, height: int) -> tuple[int, int]:
        """The size frames travel at: raw keeps the source; images are scaled down to max_width."""
        if self.kind == "raw":
            return width, height
        return preview_size(width, height, self.max_width)


FMP4 = FrameFormat()                        # the first protocol's H.264 stream (no frame batches)


@dataclass(frozen=True)
class FrameBatch:
    """Up to 16 raw (6 image) frames of one chunk, as they go on the wire (FrameFormat.per_batch)."""
    num_frames: int
    payload: bytes
    lengths: tuple[int, ...] = ()           # webp/jpeg: each frame's bytes within the payload
    raw_size: int = 0                       # the frames' uncompressed RGB bytes
    delta_reference: bool = False           # delta-gzip: frame 0 is XORed with the previous batch's last frame


def preview_size(width: int, height: int, max_width: Optional[int]) -> tuple[int, int]:
    """(width, height) scaled to max_width when wider, the height rounded (at least 1)."""
    if not max_width or width <= max_width:
        return width, height
    return max_width, max(1, round(height * max_width / width))


def batch_slices(n: int, per_batch: int) -> list[slice]:
    """Consecutive slices of at most per_batch frames; one empty slice for no frames."""
    return [slice(i * per_batch, min(n, (i + 1) * per_batch)) for i in range(max(1, math.ceil(n / per_batch)))]


def xor_deltas(frames: np.ndarray, reference: Optional[np.ndarray]) -> np.ndarray:
    """Each frame XOR the frame before it (the first XOR `reference`, or as it is without one)."""
    out = np.empty_like(frames)
    if len(frames) == 0:
        return out
    out[0] = frames[0] if reference is None else frames[0] ^ reference
    np.bitwise_xor(frames[1:], frames[:-1], out=out[1:])
    return out


def delta_gzip(frames: np.ndarray, reference: Optional[np.ndarray], level: int = 1) -> bytes:
    packer = zlib.compressobj(level, zlib.DEFLATED, _GZIP)
    return packer.compress(xor_deltas(frames, reference).tobytes()) + packer.flush()


def restore_delta_gzip(payload: bytes, width: int, height: int, num_frames: int,
                       reference: Optional[np.ndarray]) -> np.ndarray:
    """The frames of a delta-gzip payload ([num_frames, height, width, 3] uint8)."""
    data = zlib.decompress(payload, _GZIP)
    expected = num_frames * width * height * 3
    if len(data) != expected:
        raise ValueError(f"delta-gzip payload holds {len(data)} bytes, expected {expected}")
    frames = np.frombuffer(data, np.uint8).reshape(num_frames, height, width, 3).copy()
    previous = reference
    for i in range(num_frames):
        if previous is not None:
            frames[i] ^= previous
        previous = frames[i]
    return frames


def encode_image(frame: np.ndarray, kind: str, compression: int, size: tuple[int, int]) -> bytes:
    from PIL import Image
    image = Image.fromarray(frame, "RGB")
    if image.size != size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    if kind == "webp":
        image.save(buf, "WEBP", quality=compression, method=0)
    else:
        image.save(buf, "JPEG", quality=compression, subsampling=0)
    return buf.getvalue()


@dataclass
class FrameBatcher:
    """One session's frames -> FrameBatches, chunk after chunk (delta-gzip chains across batches and chunks)."""
    fmt: FrameFormat
    width: int
    height: int
    last: Optional[np.ndarray] = field(default=None, repr=False)

    def batches(self, frames: np.ndarray) -> list[FrameBatch]:
        frames = np.ascontiguousarray(frames, dtype=np.uint8)
        out = []
        per_batch = self.fmt.per_batch(self.width * self.height * 3)
        for part in (frames[s] for s in batch_slices(len(frames), per_batch)):
            raw_size = part.nbytes
            if self.fmt.kind == "raw" and self.fmt.delta:
                out.append(FrameBatch(len(part), delta_gzip(part, self.last), (), raw_size, self.last is not None))
                if len(part):
                    self.last = part[-1].copy()
            elif self.fmt.kind == "raw":
                out.append(FrameBatch(len(part), part.tobytes(), (), raw_size))
            else:
                size = self.fmt.image_size(self.width, self.height)
                images = [encode_image(f, self.fmt.kind, self.fmt.compression, size) for f in part]
                out.append(FrameBatch(len(part), b"".join(images), tuple(len(b) for b in images), raw_size))
        return out


def split_images(payload: bytes, lengths) -> list[bytes]:
    out, at = [], 0
    for n in lengths:
        out.append(payload[at:at + n])
        at += n
    if at != len(payload):
        raise ValueError(f"payload_lengths add up to {at}, the payload has {len(payload)} bytes")
    return out


def decode_images(payload: bytes, lengths) -> np.ndarray:
    """webp/jpeg payload -> [n, h, w, 3] uint8."""
    from PIL import Image
    frames = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in split_images(payload, lengths)]
    return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)
