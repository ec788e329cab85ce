"""The group's muxer: one H.264 fMP4 encoder per session, fed by rank 0's uint8 frames point to point,
and the group's control mailbox (the ingress's direct line to its session's group, bypassing Serve's
routing). Plain Python; the group makes it a Ray actor with max_concurrency > 1."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from typing import Optional

import numpy as np

from lingbot.video import FragmentedMp4Encoder


class Muxer:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.encoders: dict[str, FragmentedMp4Encoder] = {}
        self.controls: dict[str, list] = defaultdict(list)
        self.closed: OrderedDict[str, None] = OrderedDict()   # calls run in any order: a close may overtake its open
        self.lock = threading.Lock()

    def open(self, session_id: str, fps: float) -> str:
        """Start a session's encoder; returns the MSE mime type of its stream."""
        encoder = FragmentedMp4Encoder(self.width, self.height, fps)
        with self.lock:
            if session_id not in self.closed:
                self.encoders[session_id] = encoder
        return encoder.mime

    def encode(self, session_id: str, index: int, frames: np.ndarray, sent_at: float) -> Optional[dict]:
        """Encode one chunk (None when the session is gone). `sent_at` is rank 0's perf_counter when it sent
        the frames (CLOCK_MONOTONIC is shared by the processes of one node: the difference is the transfer)."""
        t0 = time.perf_counter()
        with self.lock:
            encoder = self.encoders.get(session_id)
        if encoder is None:
            return None
        data = encoder.encode_chunk(frames)
        return {"index": index, "data": data, "frames": int(frames.shape[0]), "encode_s": time.perf_counter() - t0,
                "transfer_s": t0 - sent_at}

    def close(self, session_id: str) -> None:
        with self.lock:
            self.encoders.pop(session_id, None)
            self.controls.pop(session_id, None)
            self.closed[session_id] = None
            while len(self.closed) > 10000:
                self.closed.popitem(last=False)

    # ---- control mailbox ----------------------------------------------------------------------
    def post(self, session_id: str, item) -> None:
        with self.lock:
            if session_id not in self.closed:
                self.controls[session_id].append(item)

    def drain(self) -> dict:
        """Pending controls per session, in the order the client sent them (posts may land out of order:
        each item carries the ingress's sequence number)."""
        with self.lock:
            out = {k: sorted(v, key=lambda item: getattr(item, "seq", 0)) for k, v in self.controls.items() if v}
            for k in out:
                self.controls[k] = []
        return out
