"""The group's muxer: per session, one H.264 fMP4 encoder (or, for the second protocol, a FrameBatcher of
raw, delta-gzip, WebP or JPEG frames), fed by rank 0's uint8 frames point to point. Plain Python; the
group makes it a Ray actor with max_concurrency > 1 (sessions encode in parallel).

Chunks of one session may overlap here (the ranks run chunk k+1 while chunk k is encoded), and the calls
of a threaded actor run in any order, so each session's chunks are encoded strictly in index order: a
chunk waits for its predecessor (or for the session to close).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import numpy as np

from lingbot.io.frames import FMP4, FrameBatcher, FrameFormat
from lingbot.io.video import FragmentedMp4Encoder, H264Settings, pick_h264_encoder

from ..memory import held_refs
from .messages import Fragment
from .tombstones import Tombstones

log = logging.getLogger(__name__)

ORDER_TIMEOUT_S = 120.0       # how long a chunk waits for its predecessor's encode before failing


class _Stream:
    def __init__(self, encoder):
        self.encoder = encoder                # FragmentedMp4Encoder or FrameBatcher
        self.next_index = 0
        self.keyframe_wanted = False          # the next chunk starts where a decoder can (a viewer joined)


class Muxer:
    def __init__(self, width: int, height: int, settings: Optional[H264Settings] = None):
        self.width, self.height = width, height
        settings = settings or H264Settings(encoder="auto")
        self.settings = H264Settings(pick_h264_encoder(settings.encoder, width, height), settings.preset,
                                     settings.crf, settings.threads)
        log.info("muxer: H.264 with %s (%s)", self.settings.encoder, self.settings.preset)
        self.streams: dict[str, _Stream] = {}
        self.closed = Tombstones()            # calls run in any order: a close may overtake its open
        self.turn = threading.Condition()     # guards streams / closed; wakes chunks waiting for their turn

    def ready(self) -> str:
        return self.settings.encoder

    def open(self, session_id: str, fps: float, fmt: FrameFormat = FMP4, first_chunk: int = 0,
             frames_before: Optional[int] = 0) -> str:
        """Start a session's encoder; returns the MSE mime type of its stream (fmp4), else the content type of
        its frame batches. A resumed session starts at `first_chunk`, its client holding `frames_before`
        frames: the fMP4 stream continues after them (None: a new client, its stream starts anew)."""
        if fmt.kind == "fmp4":
            encoder = FragmentedMp4Encoder(self.width, self.height, fps, self.settings)
            if first_chunk and frames_before is not None:
                encoder.continue_stream(first_chunk, frames_before)
        else:
            encoder = FrameBatcher(fmt, self.width, self.height)
        stream = _Stream(encoder)
        stream.next_index = first_chunk
        with self.turn:
            if session_id not in self.closed:
                self.streams[session_id] = stream
        return encoder.mime if fmt.kind == "fmp4" else fmt.content_type

    def encode(self, session_id: str, index: int, frames: np.ndarray, sent_at: float) -> Optional[Fragment]:
        """Encode chunk `index` once chunk index-1 is done (None when the session is gone). `sent_at` is rank
        0's perf_counter when it sent the frames (CLOCK_MONOTONIC is shared by the processes of one node:
        the difference is the transfer)."""
        t0 = time.perf_counter()
        with self.turn:
            ok = self.turn.wait_for(lambda: self._turn_of(session_id, index), timeout=ORDER_TIMEOUT_S)
            stream = self.streams.get(session_id)
            if stream is None:
                return None
            if not ok:
                raise RuntimeError(f"chunk {index} of session {session_id} waited {ORDER_TIMEOUT_S:g} s for "
                                   f"chunk {stream.next_index}")
        t1 = time.perf_counter()
        with self.turn:
            keyframe, stream.keyframe_wanted = stream.keyframe_wanted, False
        try:
            if isinstance(stream.encoder, FrameBatcher):
                if keyframe:
                    stream.encoder.last = None        # delta-gzip: the chunk's first batch stands alone
                data, batches = b"", tuple(stream.encoder.batches(frames))
            else:
                data, batches = stream.encoder.encode_chunk(frames, keyframe), ()
        finally:
            with self.turn:
                stream.next_index = index + 1
                self.turn.notify_all()
        return Fragment(index, data, int(frames.shape[0]), time.perf_counter() - t1, t0 - sent_at, batches)

    def want_keyframe(self, session_id: str) -> None:
        """The session's next chunk to be encoded starts with a keyframe (an IDR; a delta-gzip batch that stands
        alone): a viewer joined its stream, or fell behind and skips to the next one."""
        with self.turn:
            stream = self.streams.get(session_id)
            if stream is not None:
                stream.keyframe_wanted = True

    def _turn_of(self, session_id: str, index: int) -> bool:
        stream = self.streams.get(session_id)
        return stream is None or stream.next_index == index

    def close(self, session_id: str) -> None:
        with self.turn:
            self.streams.pop(session_id, None)
            self.closed.add(session_id)
            self.turn.notify_all()

    def census(self) -> dict[str, int]:
        """Sessions with an encoder (0 once none is open) and the object references it holds."""
        with self.turn:
            streams = len(self.streams)
        return {"sessions": streams, "object_refs": held_refs()}
