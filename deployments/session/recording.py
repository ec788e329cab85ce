"""Recordings: a session's video kept as one MP4 and its journal, served later at GET /v1/recordings/{id}
(docs/architecture.md, "Recordings").

While the session streams, each chunk its owner got (the fMP4 fragments, the init segment once) is appended to
a spool file by the ingress's one recording thread (`Recordings.executor`): nothing waits on the disk on the
event loop. The journal (lingbot/runtime/journal.py) grows by each chunk's controls. When the session ends the
spool is remuxed into a faststart MP4 (packets copied, no re-encode), stored with the journal and a small
description (`<id>.mp4`, `<id>.json`, `<id>.meta.json`) in the store (deployments/storage.py: a folder or an
fsspec URL), and the store is swept (recording_keep_s, recordings_max_bytes, oldest first).

A recording never fails its session: a full or failing disk, or one too slow for the video
(recording_spool_bytes waiting), stops the recording (counted by outcome) and the session goes on. A recording
id is 128 random bits; with api_keys the recording is the key's that started the session (a hash of it is kept).

Plain Python: no Ray, no Starlette."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Optional

from lingbot.io.video import remux_faststart, split_init_segment
from lingbot.runtime.journal import ChunkControls, WorldJournal, image_digest

from ..storage import Store
from .events import ChunkReady, ModelFacts
from .requests import StartRequest

log = logging.getLogger("ray.serve")


def owner_hash(tenant: str) -> Optional[str]:
    """Whose a recording is: the hash of the key that started its session (None: no key, the id is enough)."""
    return hashlib.sha256(tenant.encode()).hexdigest() if tenant.startswith("key:") else None


class Recorder:
    """One session's recording in the making."""

    def __init__(self, recordings: Recordings, start: StartRequest, facts: ModelFacts, tenant: str):
        self.recordings = recordings
        self.id = secrets.token_hex(16)
        self.start = start
        self.owner = owner_hash(tenant)
        self.journal = WorldJournal(facts.preset, facts.random_weights, start.width, start.height, start.fps,
                                    start.seed, start.prompt, "", start.decoder or facts.decoders[0],
                                    start.flow_shift, start.window, start.trajectory)
        self.spool = recordings.spool / f"{self.id}.m4s"
        self.file = None                  # the spool, opened by the recording thread
        self.has_init = False
        self.frames = 0
        self.pending = 0                  # bytes handed to the thread, not written yet
        self.lock = threading.Lock()
        self.stopped: Optional[str] = None    # why the recording stopped early: disk, slow_disk
        self.finished = False
        self.first_chunk = 0              # the video's first chunk (a saved world resumed: the chunks after it)

    def continues(self, chunks: list[ChunkControls]) -> None:
        """The session resumed a saved world of these chunks: the journal holds them too (it replays the video's
        chunks only after them), the video starts after them."""
        self.journal.chunks, self.first_chunk = [replace(c, profile=False) for c in chunks], len(chunks)

    def delivered(self, event: ChunkReady) -> None:
        """A chunk the owner got: its bytes to the spool (off the loop, never waits), its controls to the journal."""
        if self.stopped or self.finished or not event.data:
            return
        data = event.data
        if self.has_init and data[4:8] == b"ftyp":      # a resumed stream's init segment again: kept once
            data = split_init_segment(data)[1]
        self.has_init = True
        with self.lock:
            if self.pending + len(data) > self.recordings.spool_bytes:
                self.stopped = "slow_disk"
                log.warning("recording %s: %d bytes wait for the disk; the recording stops", self.id, self.pending)
                return
            self.pending += len(data)
        self.journal.chunks.append(ChunkControls() if event.controls is None else replace(event.controls,
                                                                                           profile=False))
        self.frames += event.num_frames
        self.recordings.executor.submit(self._write, data)

    def _write(self, data: bytes) -> None:
        try:
            if self.stopped:
                return
            if self.file is None:
                self.file = open(self.spool, "wb")
            self.file.write(data)
            self.file.flush()
        except OSError as e:                             # a full or failing disk: the recording stops
            self.stopped = "disk"
            log.warning("recording %s: writing failed (%s); the recording stops, the session goes on", self.id, e)
        finally:
            with self.lock:
                self.pending -= len(data)

    def finish(self) -> str:
        """(The recording thread) The spool remuxed and stored, the store swept; the outcome: written, empty,
        disk, slow_disk or failed."""
        self.finished = True
        try:
            if self.file is not None:
                self.file.close()
            if self.stopped:
                return self.stopped
            if not self.journal.chunks or self.file is None:
                return "empty"
            return self._store()
        except OSError as e:
            log.warning("recording %s: not stored (%s)", self.id, e)
            return "disk"
        except Exception:                                # (PyAV's errors among them): a server fault, logged
            log.exception("recording %s: not stored", self.id)
            return "failed"
        finally:
            self.spool.unlink(missing_ok=True)

    def _store(self) -> str:
        store = self.recordings.store
        video = self.spool.with_suffix(".mp4")
        try:
            frames = remux_faststart(self.spool, video, self.start.fps)
            size = video.stat().st_size
            self.journal.image_sha256 = image_digest(self.start.image)
            store.put_file(video, f"{self.id}.mp4")
        finally:
            video.unlink(missing_ok=True)
        store.put_bytes(f"{self.id}.json", self.journal.to_json().encode())
        meta = {"id": self.id, "owner": self.owner, "created": time.time(), "frames": frames,
                "chunks": len(self.journal.chunks), "first_chunk": self.first_chunk, "bytes": size,
                "fps": self.start.fps, "width": self.start.width, "height": self.start.height}
        store.put_bytes(f"{self.id}.meta.json", json.dumps(meta).encode())   # last: the recording is complete
        self.recordings.metrics.recorded("written", size)
        return "written"


class Recordings:
    """The ingress's recordings: the store, the one thread that writes them, the sessions recording now."""

    def __init__(self, store: Store, keep_s: float, max_bytes: int, spool_bytes: int, metrics):
        self.store = store
        self.keep_s, self.max_bytes, self.spool_bytes = keep_s, max_bytes, spool_bytes
        self.metrics = metrics
        self.spool = store.spool_dir()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="recordings")
        self.active: dict[str, Recorder] = {}
        self.finishing: set[asyncio.Task] = set()       # (held: the loop keeps only weak references to tasks)
        self.executor.submit(self._clear_stale_spool)

    def _clear_stale_spool(self, stale_s: float = 3600.0) -> None:
        """Spool files of recordings whose ingress died (a live one is written every chunk): deleted."""
        for path in self.spool.glob("*"):
            try:
                if time.time() - path.stat().st_mtime > stale_s:
                    path.unlink()
            except OSError:
                pass

    @classmethod
    def from_settings(cls, settings, metrics) -> Optional[Recordings]:
        """None (logged) where recordings_dir cannot be opened: sessions asking to be recorded are told."""
        try:
            store = Store(settings.recordings_dir)
        except Exception as e:                           # (a bad URL, a missing fsspec backend, no permission)
            log.error("recordings_dir %r cannot be used (%s: %s); sessions are not recorded",
                      settings.recordings_dir, type(e).__name__, e)
            return None
        return cls(store, settings.recording_keep_s, settings.recordings_max_bytes, settings.recording_spool_bytes,
                   metrics)

    def begin(self, start: StartRequest, facts: ModelFacts, tenant: str) -> Recorder:
        recorder = Recorder(self, start, facts, tenant)
        self.active[recorder.id] = recorder
        return recorder

    def finish_later(self, recorder: Recorder) -> asyncio.Task:
        """finish(recorder) as a task of its own, which outlives the session that started it."""
        task = asyncio.ensure_future(self.finish(recorder))
        self.finishing.add(task)
        task.add_done_callback(self.finishing.discard)
        return task

    async def finish(self, recorder: Recorder) -> str:
        """Store the recording (on the recording thread) and sweep; the outcome, counted."""
        outcome = await asyncio.get_running_loop().run_in_executor(self.executor, self._finish, recorder)
        if outcome != "written":
            self.metrics.recorded(outcome, 0)
        return outcome

    def _finish(self, recorder: Recorder) -> str:
        try:
            return recorder.finish()
        finally:
            self.active.pop(recorder.id, None)
            try:
                gone = self.store.sweep(self.keep_s, self.max_bytes, frozenset(self.active))
                if gone:
                    log.info("recordings: %d deleted (recording_keep_s, recordings_max_bytes)", len(gone))
            except OSError as e:
                log.warning("recordings: the sweep failed (%s)", e)

    def described(self, recording_id: str, tenant: str) -> Optional[dict]:
        """(Blocking) A finished recording's description for the client `tenant`; None when there is none, it
        expired, or it is another key's (answered alike)."""
        if not (len(recording_id) == 32 and all(c in "0123456789abcdef" for c in recording_id)):
            return None
        raw = self.store.get_bytes(f"{recording_id}.meta.json")
        if raw is None:
            return None
        meta = json.loads(raw)
        if meta.get("owner") is not None and meta["owner"] != owner_hash(tenant):
            return None
        if time.time() - meta["created"] > self.keep_s:
            return None
        return meta
