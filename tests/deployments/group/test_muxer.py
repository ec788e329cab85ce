"""The muxer without Ray: chunks of a session handed over out of order (as a threaded actor may run them)
are encoded in index order, at the size of the real model, into one stream that decodes frame for frame."""
import threading
import time

import numpy as np
import pytest

from deployments.group.muxer import Muxer
from lingbot.io.video import read_frames
from tests.waits import wait_until

W, H = 832, 480


def _chunk(index: int) -> np.ndarray:
    frames = 9 if index == 0 else 12
    rng = np.random.RandomState(index)
    return rng.randint(0, 255, (frames, H, W, 3), dtype=np.uint8)


def test_out_of_order_chunks_are_encoded_in_order():
    muxer = Muxer(W, H)
    assert muxer.ready() == "libx264"                           # no NVENC on a CPU machine: the fallback
    muxer.open("s", 16.0)
    results: dict[int, object] = {}

    def encode(index):
        results[index] = muxer.encode("s", index, _chunk(index), time.perf_counter())

    threads = [threading.Thread(target=encode, args=(i,)) for i in (2, 1, 0)]   # the latest first
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    assert [results[i].index for i in range(3)] == [0, 1, 2]
    stream = b"".join(results[i].data for i in range(3))
    assert read_frames(stream).shape == (33, H, W, 3)


class _Turn(threading.Condition):
    """The muxer's condition, counting the chunks that wait on it for their turn."""

    def __init__(self):
        super().__init__()
        self.waiting = 0

    def wait(self, timeout=None):
        self.waiting += 1                 # under the lock, which the wait gives up only after this
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


def test_close_releases_waiting_chunks_and_drops_late_ones():
    muxer = Muxer(W, H)
    muxer.turn = _Turn()
    muxer.open("s", 16.0)
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault(1, muxer.encode("s", 1, _chunk(1), 0.0)))
    waiter.start()
    wait_until(lambda: muxer.turn.waiting, 10, "chunk 1 to wait for chunk 0")
    muxer.close("s")                                             # chunk 0 never came: the session ended
    waiter.join(timeout=10)
    assert got == {1: None}
    assert muxer.encode("s", 0, _chunk(0), 0.0) is None
    muxer.open("s", 16.0)                                        # a close overtook its open: stays closed
    assert muxer.encode("s", 0, _chunk(0), 0.0) is None
    with pytest.raises(ValueError, match=r"H\.264 encoder 'vp9' is not one of"):
        from lingbot.io.video import pick_h264_encoder
        pick_h264_encoder("vp9")


def test_a_resumed_session_continues_the_fmp4_stream():
    """A session resumed on another group: the new muxer continues the stream the client holds (no second
    init segment, sequence numbers and times after the old ones), and the whole stream decodes in order."""
    import io

    import av

    w, h = 112, 64
    rng = np.random.RandomState(1)
    chunks = [rng.randint(0, 255, (9 if k == 0 else 12, h, w, 3), dtype=np.uint8) for k in range(4)]
    first = Muxer(w, h)
    first.open("s", 16.0)
    before = [first.encode("s", k, chunks[k], time.perf_counter()).data for k in range(2)]
    second = Muxer(w, h)                                         # another group's muxer
    second.open("s", 16.0, first_chunk=2, frames_before=21)
    after = [second.encode("s", k, chunks[k], time.perf_counter()).data for k in (2, 3)]
    assert before[0].startswith(b"\x00\x00\x00") and b"ftyp" in before[0][:16]
    assert b"ftyp" not in after[0] and b"moov" not in after[0]
    stream = b"".join(before + after)
    with av.open(io.BytesIO(stream)) as container:
        times = [f.pts for f in container.decode(video=0)]
    assert len(times) == 45 and times == sorted(times) and len(set(times)) == 45
    assert read_frames(stream).shape == (45, h, w, 3)
    with pytest.raises(RuntimeError, match="before the first chunk"):
        from lingbot.io.video import FragmentedMp4Encoder
        encoder = FragmentedMp4Encoder(w, h, 16.0)
        encoder.encode_chunk(chunks[0])
        encoder.continue_stream(1, 9)
