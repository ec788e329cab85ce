"""Stand-ins for a group's rank actors, muxer, mailbox and metrics without Ray: their `.remote` calls are asyncio
tasks, so the chunk loop and the leases run as the replica runs them (tests/deployments/group/test_chunk_loop.py,
test_lease_admission.py, test_executor.py)."""
import asyncio

import numpy as np

from deployments.group.messages import ChunkReply, Fragment, RunChunk
from deployments.group.scheduler import ScheduledSession
from deployments.session.events import SnapshotRef
from deployments.session.requests import StartRequest
from deployments.settings import ServeSettings
from lingbot.config import get_preset
from tests.deployments.ingress import inputs

GEOMETRY = get_preset("tiny").geometry
SETTINGS = ServeSettings(pacing="fixed", pacing_lead_s=100.0, chunk_timeout_s=5.0, max_queued_controls=2)


class Remote:
    """`actor.method.remote(*args)`: the method runs as a task; what it returns is what awaiting gives."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class Rank:
    def __init__(self, rank: int, log: list, fail_at=None, hang_at=None, engine_s=0.01, steps=None, controls=None,
                 warm_after: int = 0):
        self.rank, self.log, self.fail_at, self.hang_at = rank, log, fail_at, hang_at
        self.engine_s, self.steps = engine_s, steps          # steps: a list the chunks' rungs go to
        self.controls = controls                             # a list each chunk's (session, index, controls) go to
        self.warm_after, self.prewarms = warm_after, {}      # a prewarm is ready at its warm_after-th chunk
        self.run_chunk, self.abort_chunk = Remote(self._run_chunk), Remote(self._noop)

    async def _noop(self, *args):
        pass

    async def _run_chunk(self, call: RunChunk):
        sid, index, muxer = call.session_id, call.index, call.muxer
        self.log.append((self.rank, sid, index, muxer is not None))
        if self.steps is not None and self.rank == 0:
            self.steps.append((sid, index, call.controls.steps))
        warm = None
        if call.controls.prewarm is not None:
            self.prewarms[sid] = self.prewarms.get(sid, 0) + 1
            warm = self.prewarms[sid] >= self.warm_after
        else:
            self.prewarms.pop(sid, None)
        if self.controls is not None and self.rank == 0:
            self.controls.append((sid, index, call.controls, warm))
        engine_s = self.engine_s(call.controls) if callable(self.engine_s) else self.engine_s
        await asyncio.sleep(0.001)
        if index == self.fail_at:
            raise RuntimeError(f"rank {self.rank} lost its device")
        if index == self.hang_at:
            await asyncio.sleep(3600)
        fragment = None
        if muxer is not None:
            fragment = muxer.encode.remote(sid, index, GEOMETRY.pixel_frames(index))
        return ChunkReply(False, {"denoise": 0.01}, engine_s, fragment,
                          (SnapshotRef(index, self.rank, "slot", "state"),), warm=warm)


class Muxer:
    def __init__(self):
        self.encode = Remote(self._encode)

    async def _encode(self, sid, index, frames):
        return Fragment(index, f"{sid}:{index}".encode(), frames, 0.001, 0.001)


class Mailbox:
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.take = Remote(self._take)

    async def _take(self, timeout_s):
        """Everything posted so far, in one batch (a long poll answers at once when something waits)."""
        try:
            first = await asyncio.wait_for(self.queue.get(), 0.05)
        except asyncio.TimeoutError:
            return {}
        batch: dict = {}
        for sid, interaction in [first] + [self.queue.get_nowait() for _ in range(self.queue.qsize())]:
            batch.setdefault(sid, []).append(interaction)
        return batch


class Metrics:
    class _Any:
        def __init__(self):
            self.seen = []

        def observe(self, value, tags=None):
            self.seen.append(value)

        set = observe

        def inc(self, tags=None):
            self.seen.append(1)

    def __init__(self):
        self.stage, self.rtf, self.stalls, self.chunks = self._Any(), self._Any(), self._Any(), self._Any()
        self.active_sessions = self._Any()


def start(chunks: int, **kw) -> StartRequest:
    return StartRequest("p", np.zeros((3, 64, 112), np.float32), 112, 64, chunks, None, 16.0, 1, None, [], **kw)


def session(sid: str, chunks: int, **start_kw) -> ScheduledSession:
    return ScheduledSession(sid, start(chunks, **start_kw), GEOMETRY, SETTINGS.max_queued_controls, max_in_flight=1)


def scheduled(sid: str, chunks=None, fps=16.0, now=0.0, script=()) -> ScheduledSession:
    """A session as the scheduler holds it, from a first-protocol start of `chunks` chunks (None: endless) at
    `fps`, made at `now`, with a key `script` (one tuple of keys per chunk)."""
    req = inputs.start(num_frames=inputs.frames_for_chunks(chunks) if chunks else None, fps=fps)
    req.action_script = list(script)
    if chunks is None:
        req.chunks = None
    return ScheduledSession(sid, req, now=now)
