"""H.264 video out through PyAV: an MP4 file (CLI) or fragmented MP4 bytes (streaming)."""
from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO, Union

import av
import numpy as np


class H264Writer:
    """Encodes uint8 RGB frames [F, H, W, 3] as H.264 yuv420p into MP4.

    fragmented=True writes fMP4 (empty_moov + default_base_moof + frag_keyframe), the layout Media Source
    Extensions play as it arrives."""

    def __init__(self, target: Union[str, Path, BinaryIO], width: int, height: int, fps: float,
                 fragmented: bool = False, crf: int = 23, preset: str = "veryfast"):
        if width % 2 or height % 2:
            raise ValueError(f"H.264 yuv420p needs an even size, got {width}x{height}")
        options = {"movflags": "frag_keyframe+empty_moov+default_base_moof"} if fragmented else {}
        self.container = av.open(target if not isinstance(target, Path) else str(target), mode="w",
                                 format="mp4", options=options)
        self.stream = self.container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = "yuv420p"
        self.stream.options = {"crf": str(crf), "preset": preset, "tune": "zerolatency"}
        self.frames_written = 0

    def write(self, frames: np.ndarray) -> None:
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            for packet in self.stream.encode(frame):
                self.container.mux(packet)
            self.frames_written += 1

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


def read_frames(source: Union[str, Path, bytes]) -> np.ndarray:
    """Decode every frame of an MP4 (path or bytes) to uint8 RGB [F, H, W, 3]."""
    target = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source)
    with av.open(target) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
