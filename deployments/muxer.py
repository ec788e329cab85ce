"""The group's muxer: one H.264 fMP4 encoder per session, fed by rank 0's uint8 frames point to point.
Plain Python; the group makes it a Ray actor with max_concurrency > 1 (sessions encode in parallel)."""
from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from lingbot.io.video import FragmentedMp4Encoder

from .messages import Fragment
from .sessions import Tombstones


class Muxer:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.encoders: dict[str, FragmentedMp4Encoder] = {}
        self.closed = Tombstones()            # calls run in any order: a close may overtake its open
        self.lock = threading.Lock()

    def ready(self) -> bool:
        return True

    def open(self, session_id: str, fps: float) -> str:
        """Start a session's encoder; returns the MSE mime type of its stream."""
        encoder = FragmentedMp4Encoder(self.width, self.height, fps)
        with self.lock:
            if session_id not in self.closed:
                self.encoders[session_id] = encoder
        return encoder.mime

    def encode(self, session_id: str, index: int, frames: np.ndarray, sent_at: float) -> Optional[Fragment]:
        """Encode one chunk (None when the session is gone). `sent_at` is rank 0's perf_counter when it sent
        the frames (CLOCK_MONOTONIC is shared by the processes of one node: the difference is the transfer)."""
        t0 = time.perf_counter()
        with self.lock:
            encoder = self.encoders.get(session_id)
        if encoder is None:
            return None
        data = encoder.encode_chunk(frames)
        return Fragment(index, data, int(frames.shape[0]), time.perf_counter() - t0, t0 - sent_at)

    def close(self, session_id: str) -> None:
        with self.lock:
            self.encoders.pop(session_id, None)
            self.closed.add(session_id)
