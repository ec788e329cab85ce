"""Recordings without Ray (deployments/session/recording.py, deployments/storage.py): a session's fMP4 chunks become
one faststart MP4 with the owner's frames and a journal, on a folder or an fsspec store through the same code; a
full disk stops the recording and nothing else; retention and the quota delete the oldest first; a recording is
its key's."""
import asyncio
import json
import time

import numpy as np
import pytest

from deployments.session.events import ChunkReady, ModelFacts
from deployments.session.recording import Recordings, owner_hash
from deployments.session.requests import StartRequest
from deployments.storage import Store
from lingbot.config import get_preset
from lingbot.io.video import FragmentedMp4Encoder, mp4_boxes, read_frames, split_init_segment
from lingbot.runtime.journal import ChunkControls, WorldJournal, image_digest

W, H = 112, 64
FACTS = ModelFacts.of(get_preset("tiny"), random_weights=True, decoders=("tae", "wan"))


class Counted:
    def __init__(self):
        self.outcomes, self.bytes = [], 0

    def recorded(self, outcome, count):
        self.outcomes.append(outcome)
        self.bytes += count


def start_request(seed=3) -> StartRequest:
    image = np.random.default_rng(seed).uniform(-1, 1, (3, H, W)).astype(np.float32)
    return StartRequest("a harbour", image, W, H, 3, None, 16.0, seed, 4.0, [])


def session_chunks(chunks=3, resumed_at=None):
    """ChunkReady events as a group's muxer makes them (init segment first; a resumed stream's encoder sends its
    own init again, as the owner's wire would get it), and the frames they hold."""
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (9, H, W, 3), dtype=np.uint8) for _ in range(chunks)]
    encoder, events = FragmentedMp4Encoder(W, H, 16.0), []
    for i, f in enumerate(frames):
        data = encoder.encode_chunk(f)
        if i == resumed_at:
            data = encoder.init_segment + data
        controls = ChunkControls(keys=("w", "", "a"), steps=2 if i == 1 else None, profile=True)
        events.append(ChunkReady(i, data, 9, [], [], [], {}, 0.0, controls=controls))
    return events, np.concatenate(frames)


def record(recordings, events, tenant="addr:127.0.0.1", start=None):
    start = start or start_request()
    recorder = recordings.begin(start, FACTS, tenant)
    for event in events:
        recorder.delivered(event)
    return recorder, asyncio.run(recordings.finish(recorder))


@pytest.mark.parametrize("where", ["folder", "memory"])
def test_a_recording_is_the_owners_stream_as_one_faststart_mp4_with_its_journal(where, tmp_path):
    """Three chunks (the third after a resume: its init segment again) -> <id>.mp4 (ftyp, moov before mdat) whose
    frames are the owner's stream's, bit for bit, <id>.json (the start and each chunk's controls, no profile flag)
    and <id>.meta.json; a folder and fsspec's memory store alike."""
    url = str(tmp_path / "rec") if where == "folder" else f"memory://rec-{tmp_path.name}"
    counted = Counted()
    recordings = Recordings(Store(url), 3600.0, 2 ** 30, 2 ** 24, counted)
    events, _ = session_chunks(resumed_at=2)
    start = start_request()
    recorder, outcome = record(recordings, events, start=start)
    assert outcome == "written" and len(recorder.id) == 32
    store = recordings.store
    assert sorted(f.name for f in store.files()) == [f"{recorder.id}.json", f"{recorder.id}.meta.json",
                                                    f"{recorder.id}.mp4"]
    video = store.get_bytes(f"{recorder.id}.mp4")
    assert [box for box, _, _ in mp4_boxes(video)][:2] == [b"ftyp", b"moov"]
    owners = read_frames(events[0].data + events[1].data + split_init_segment(events[2].data)[1])
    recorded = read_frames(video)
    assert recorded.shape == (27, H, W, 3) and np.array_equal(recorded, owners)
    journal = WorldJournal.from_json(store.get_bytes(f"{recorder.id}.json"))
    assert (journal.preset, journal.seed, journal.prompt, journal.decoder, journal.flow_shift) == \
        ("tiny", 3, "a harbour", "tae", 4.0)
    assert journal.image_sha256 == image_digest(start.image)
    assert [c.quality for c in journal.chunks] == ["full", "steps2", "full"]
    assert not any(c.profile for c in journal.chunks)
    meta = json.loads(store.get_bytes(f"{recorder.id}.meta.json"))
    assert (meta["frames"], meta["chunks"], meta["bytes"], meta["owner"]) == (27, 3, len(video), None)
    assert counted.outcomes == ["written"] and counted.bytes == len(video)
    assert not list(recordings.spool.iterdir())                      # nothing left in the making


def test_a_full_disk_stops_the_recording_and_nothing_else(tmp_path):
    """The spool on /dev/full (every write fails with ENOSPC): delivered() never raises, the recording stops
    (outcome disk, counted), nothing is stored; a disk too slow for the video (recording_spool_bytes) stops it
    the same way (slow_disk)."""
    counted = Counted()
    recordings = Recordings(Store(str(tmp_path / "rec")), 3600.0, 2 ** 30, 2 ** 24, counted)
    events, _ = session_chunks()
    recorder = recordings.begin(start_request(), FACTS, "addr:x")
    recorder.file = open("/dev/full", "wb", buffering=0)     # (its spool opened there instead of in the folder)
    for event in events:
        recorder.delivered(event)
    assert asyncio.run(recordings.finish(recorder)) == "disk"
    slow = Recordings(Store(str(tmp_path / "slow")), 3600.0, 2 ** 30, len(events[0].data) + 10, counted)
    recorder, outcome = record(slow, events)
    assert outcome == "slow_disk" and recorder.stopped == "slow_disk"
    assert counted.outcomes == ["disk", "slow_disk"] and counted.bytes == 0
    assert recordings.store.files() == [] and slow.store.files() == []
    _, outcome = record(recordings, [])
    assert outcome == "empty" and recordings.store.files() == []


def test_retention_and_the_quota_delete_whole_recordings_oldest_first(tmp_path):
    store = Store(f"memory://sweep-{tmp_path.name}")
    for name in ("a", "b", "c", "d"):
        store.put_bytes(f"{name}.mp4", b"x" * 100)
        store.put_bytes(f"{name}.json", b"y" * 10)
    files = store.files()
    born = {f.name.split(".")[0]: f.modified for f in files}
    now = max(born.values())
    assert store.sweep(keep_s=3600, max_bytes=10 ** 6, now=now) == []
    # quota: 440 bytes held, 250 allowed: the two oldest go, whole (video and journal); a busy one is kept
    order = sorted(born, key=born.get)
    assert store.sweep(keep_s=3600, max_bytes=250, busy=frozenset({order[0]}), now=now) == order[1:3]
    assert sorted(f.name for f in store.files()) == sorted(f"{n}.{ext}" for n in (order[0], order[3])
                                                           for ext in ("mp4", "json"))
    assert store.sweep(keep_s=3600, max_bytes=10 ** 6, now=now + 3601) == [order[0], order[3]]
    assert store.files() == []


def test_a_recording_is_its_keys_and_only_a_recording_id_is_asked_for(tmp_path):
    recordings = Recordings(Store(str(tmp_path / "rec")), 3600.0, 2 ** 30, 2 ** 24, Counted())
    events, _ = session_chunks(chunks=1)
    keyed, _ = record(recordings, events, tenant="key:k1")
    open_one, _ = record(recordings, events, tenant="addr:10.0.0.1")
    assert owner_hash("key:k1") != owner_hash("key:k2") and owner_hash("addr:10.0.0.1") is None
    assert recordings.described(keyed.id, "key:k1")["chunks"] == 1
    assert recordings.described(keyed.id, "key:k2") is None and recordings.described(keyed.id, "") is None
    assert recordings.described(open_one.id, "")["frames"] == 9
    for bad in ("0" * 32, "../etc/passwd", keyed.id.upper(), keyed.id + ".mp4", ""):
        assert recordings.described(bad, "key:k1") is None
    expired = Recordings(recordings.store, 1e-9, 2 ** 30, 2 ** 24, Counted())
    assert expired.described(keyed.id, "key:k1") is None


def test_a_dead_ingress_spool_is_cleared_and_a_live_one_kept(tmp_path):
    import os
    store = Store(str(tmp_path / "rec"))
    spool = store.spool_dir()
    (spool / "dead.m4s").write_bytes(b"x")
    os.utime(spool / "dead.m4s", (time.time() - 7200, time.time() - 7200))
    (spool / "live.m4s").write_bytes(b"y")
    recordings = Recordings(store, 3600.0, 2 ** 30, 2 ** 24, Counted())
    recordings.executor.submit(lambda: None).result(10)          # (the clearing ran before it)
    assert sorted(p.name for p in spool.iterdir()) == ["live.m4s"]


def test_a_store_refuses_names_that_are_not_plain(tmp_path):
    store = Store(str(tmp_path / "s"))
    for bad in ("", "a/b", ".spool", "../x"):
        with pytest.raises(ValueError, match="is not a plain file name"):
            store.path(bad)
    assert store.size("nothing.mp4") is None and store.get_bytes("nothing.mp4") is None
    store.delete("nothing.mp4")                                  # (already gone: nothing to do)
