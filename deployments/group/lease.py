"""A group's session leases: each session is one long streaming call from its ingress (the lease Serve counts for
routing and autoscaling). A lease is admitted against the group's capacity and phase, opens the session on
every rank (restored from its snapshots when it resumes, else replayed) and in the muxer, yields Admitted and
then the session's events from the chunk loop, and frees the session everywhere when it ends or is cancelled.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from ..detach import outside_the_request
from ..session.codes import ErrorCode
from ..session.events import FINAL_EVENTS, Admitted, ModelFacts, Resumed, SessionDone, SessionFailed, SessionRequest
from .chunk_loop import ChunkLoop
from .executor import RankExecutor
from .ladder import sink_chunks
from .messages import SnapshotSchedule
from .scheduler import ScheduledSession
from .snapshots import SnapshotSeats
from .state import GroupState


class Leases:
    def __init__(self, group_id: str, settings, state: GroupState, capacity: int, model: ModelFacts,
                 ranks: RankExecutor, muxer, mailbox, chunks: ChunkLoop, metrics,
                 snapshot_seats: Optional[SnapshotSeats] = None):
        self.id = group_id
        self.settings = settings
        self.state = state
        self.capacity = capacity
        self.model = model
        self.ranks = ranks
        self.muxer = muxer
        self.mailbox = mailbox
        self.chunks = chunks
        self.metrics = metrics
        self.reserved = 0                              # sessions admitted or being admitted
        self.snapshot_seats = snapshot_seats           # which sessions keep snapshots (the host budget's)

    def _refusal(self, start=None) -> Optional[SessionFailed]:
        """Why this group takes no new session (of `start`) now (None: it takes one). With the quality ladder on,
        a group below its cap takes a session only while the floor rung holds for every session
        (QualityLadder.admits)."""
        if self.state.failed:
            return SessionFailed(ErrorCode.GROUP_UNAVAILABLE, "this group failed and is being replaced; retry")
        if not self.state.takes_sessions:
            return SessionFailed(ErrorCode.GROUP_UNAVAILABLE, "this group is being stopped (scale-down or "
                                 "redeploy); retry")
        if self.reserved >= self.capacity:
            return SessionFailed(ErrorCode.CAPACITY_EXHAUSTED, "group is full")
        if start is not None and self.reserved > 0 and not self.chunks.ladder.admits(
                start, self.chunks.sessions.values(), self.reserved - len(self.chunks.sessions)):
            sinking = self.reserved > len(self.chunks.sessions) or any(
                s.next_chunk < sink_chunks(s, self.model.sink_chunks) for s in self.chunks.sessions.values())
            return SessionFailed(ErrorCode.CAPACITY_EXHAUSTED, "group is full: its sessions are at the quality "
                                 "floor's real-time limit" + (" while a session's sink runs" if sinking else ""),
                                 seat_held=True)
        return None

    def capacities(self) -> dict:
        """Sessions at the deployment's fps the group holds: configured (the hard cap), and at real time at the top
        rung and at the floor as measured on this group (the ladder on; else the configured number for both)."""
        return {"configured": self.capacity, **self.chunks.ladder.capacities(self.capacity)}

    def _snapshot_schedule(self, session_id: str, keeper) -> Optional[SnapshotSchedule]:
        """How the session's ranks snapshot it: to its ingress's keeper every snapshot_interval_chunks, when it
        has a keeper and a seat in the host budget (None: no snapshots; a resume replays it)."""
        if self.snapshot_seats is not None:
            keeper = self.snapshot_seats.take(session_id, keeper)
        return None if keeper is None else SnapshotSchedule(keeper, self.settings.snapshot_interval_chunks)

    def _free(self, session_id: str) -> None:
        """Every actor of the group forgets the session (told, not awaited); a running chunk of it ends at its
        next step."""
        self.ranks.stop(session_id)
        self.ranks.close(session_id)
        self.muxer.close.remote(session_id)
        self.mailbox.close.remote(session_id)

    async def run(self, request: SessionRequest):
        """Streaming call held for the whole session: yields Admitted, then one ChunkReady per chunk, then
        SessionDone (or SessionFailed, or Moving); a resumed session (request.resume) yields Resumed once its
        ranks are where the failed group's were. Cancelling it (client gone, stop) frees the session within
        one step."""
        refusal = self._refusal(request.start)
        if refusal is not None:                        # checked and taken before any await: no over-admission
            yield refusal
            return
        self.reserved += 1
        sid, start, resume = request.session_id, request.start, request.resume
        session = ScheduledSession(sid, start, self.model.geometry, self.settings.max_queued_controls,
                                   max_in_flight=self.settings.resolved_max_in_flight_chunks)
        try:
            first, before = (0, 0) if resume is None else \
                (resume.next_index, None if resume.fresh_stream else resume.frames_delivered)
            try:                                       # milliseconds; bounded as every call to a group's actor
                mime = await asyncio.wait_for(self.muxer.open.remote(sid, start.fps, start.output, first, before),
                                              self.settings.chunk_timeout_s)
            except asyncio.TimeoutError:
                yield SessionFailed(ErrorCode.GROUP_UNAVAILABLE, "the group's muxer did not open the session within "
                                    f"{self.settings.chunk_timeout_s:g} s")
                return
            restore = resume.restore if resume is not None and len(resume.restore) == len(self.ranks) \
                else [None] * len(self.ranks)
            opened = await self.ranks.open(sid, start, self._snapshot_schedule(sid, request.keeper), restore)
            if any(o is None for o in opened):
                return                                 # cancelled while opening: the finally cleans up
            if resume is not None:
                restored = resume.snapshot_index + 1
                if any(o != restored for o in opened):  # a snapshot was lost, or another group size: replay all
                    if any(o != 0 for o in opened):
                        await self.ranks.reset(sid)
                    restored = 0
                session.resume_from(resume, restored)
            refusal = self._refusal()
            if refusal is not None and refusal.code != ErrorCode.CAPACITY_EXHAUSTED:
                yield refusal                          # Serve began stopping the group while it opened
                return
            outbox = self.chunks.add(session)
            self.metrics.active_sessions.set(len(self.chunks.sessions), tags={"group": self.id})
            yield Admitted(self.id, self.mailbox, mime, self.capacity, self.model, self.muxer)
            if resume is not None and not session.replay:
                yield Resumed(0, 0.0, session.next_chunk)   # nothing to replay: it continues at once
            if resume is not None and start.chunks is not None and resume.next_index >= start.chunks:
                yield SessionDone(start.chunks)           # it had delivered its last chunk already
                return
            while True:
                event = await outbox.get()
                yield event
                if isinstance(event, FINAL_EVENTS):
                    break                              # an InteractionRefused leaves the session on
        finally:
            self.reserved -= 1
            if self.snapshot_seats is not None:
                self.snapshot_seats.give(sid)
            session.stopped = True
            self.chunks.remove(sid)
            outside_the_request(self._free, sid)      # not the lease's children: its cancel would drop them
            self.metrics.active_sessions.set(len(self.chunks.sessions), tags={"group": self.id})
