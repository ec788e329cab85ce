"""The group's chunk loop and delivery: which session's chunk runs next, running it on every rank, and putting it
on the session's stream (docs/architecture.md, "Scheduling and pacing", "Delivery overlaps the device").

A background task runs the sessions' chunks one at a time, earliest playback deadline first, within the pacing
lead (scheduler.py); every chunk is one call to every rank (RankExecutor.run_chunk). As soon as the ranks return a
chunk, the loop may start the next one: the chunk's delivery (its fragment from the muxer, then the session's
outbox, which its lease yields) runs as a task of its own, in chunk order per session, with at most
`max_in_flight_chunks` (resolved by device) per session waiting for delivery. A second task long-polls the
control mailbox and wakes the loop when a control arrives. A resumed session first replays the chunks its
restore point lacks (nothing is delivered), then goes on. Ray-free apart from the handles it is given: tests
drive it with stand-in actors.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from ..detach import fresh_task
from ..session.codes import ErrorCode
from ..session.events import ChunkReady, GroupEvent, InteractionRefused, ModelFacts, Resumed, SessionDone, SessionFailed
from .executor import RankExecutor
from .group_ladder import GroupLadder
from .messages import ChunkReply, Fragment
from .planner import ChunkPlan
from .scheduler import ScheduledSession, Scheduler
from .state import GroupState

log = logging.getLogger("ray.serve")

MAILBOX_POLL_S = 5.0       # a long poll: the mailbox answers at once when a control arrives


class SessionFailure(Exception):
    """A failure that concerns one session only (the group and its other sessions carry on)."""

    def __init__(self, session_id: str, message: str):
        super().__init__(message)
        self.session_id = session_id


@dataclass
class RunningChunk:
    session: ScheduledSession
    index: int
    may_restart: bool
    aborted: bool = False


class ChunkLoop:
    def __init__(self, group_id: str, settings, state: GroupState, ranks: RankExecutor, muxer, mailbox, metrics,
                 fail: Callable[[Exception], None], after_chunk: Callable[[], None] = lambda: None,
                 model: Optional[ModelFacts] = None):
        s = self.settings = settings
        self.group_id = group_id
        self.state = state
        self.ranks = ranks
        self.muxer = muxer
        self.mailbox = mailbox
        self.metrics = metrics
        self.fail = fail                               # the group's failure path (a rank or the muxer died)
        self.after_chunk = after_chunk
        self.scheduler = Scheduler(s.pacing_lead_s, s.pacing == "adaptive", s.pacing_margin_s, s.pacing_quantile)
        self.outboxes: dict[str, asyncio.Queue] = {}   # per session: the events its lease yields
        self.deliveries: dict[str, asyncio.Task] = {}  # per session: the delivery of its newest chunk
        self.loop_task: Optional[asyncio.Task] = None
        self.controls_task: Optional[asyncio.Task] = None
        self.wake: Optional[asyncio.Event] = None
        self.running: Optional[RunningChunk] = None    # the chunk the ranks are on now
        self.last_chunk_s = 0.0                        # how long the last chunk call took
        self.ladder = GroupLadder(s, model)            # each chunk's rung, the switch off/auto (ladder.py)

    @property
    def sessions(self) -> dict[str, ScheduledSession]:
        return self.scheduler.sessions

    # ---- sessions -----------------------------------------------------------------------------
    def add(self, session: ScheduledSession) -> asyncio.Queue:
        """Schedule `session`; returns its outbox."""
        outbox: asyncio.Queue = asyncio.Queue()
        self.outboxes[session.id] = outbox
        self.scheduler.add(session)
        self._ensure_tasks()
        return outbox

    def remove(self, session_id: str) -> None:
        self.scheduler.remove(session_id)
        self.ladder.forget(session_id)
        self.outboxes.pop(session_id, None)
        self.deliveries.pop(session_id, None)

    def post(self, session_id: str, event: GroupEvent) -> None:
        box = self.outboxes.get(session_id)
        if box is not None:
            box.put_nowait(event)

    def poke(self) -> None:
        """Make the loop look again (a session's state changed, or the group's phase)."""
        if self.wake is not None:
            self.wake.set()

    async def settle(self) -> None:
        """The chunk the ranks are on and the deliveries in flight finish (the loop ends: its phase stopped it)."""
        self.poke()
        if self.loop_task is not None:
            await asyncio.wait({self.loop_task}, timeout=self.settings.chunk_timeout_s)
        await asyncio.gather(*list(self.deliveries.values()), return_exceptions=True)

    def _ensure_tasks(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            self.wake = asyncio.Event()
            self.loop_task = fresh_task(self._loop())
        if self.controls_task is None or self.controls_task.done():
            self.controls_task = fresh_task(self._receive_controls())
        self.wake.set()

    # ---- controls -----------------------------------------------------------------------------
    async def _receive_controls(self) -> None:
        """Long-poll the mailbox while sessions run; queue each control on its session and wake the loop."""
        try:
            while self.sessions and not self.state.failed:
                batch = await self.mailbox.take.remote(MAILBOX_POLL_S)
                for sid, interactions in batch.items():
                    session = self.sessions.get(sid)
                    for interaction in interactions if session is not None else ():
                        if not session.planner.queue(interaction):
                            self.post(sid, InteractionRefused(
                                ErrorCode.TOO_MANY_CONTROLS, f"more than {session.planner.max_queued} interactions "
                                "queued; slow down", interaction.event_id))
                    if session is not None and interactions:
                        self._restart_for(session)
                if batch:
                    self.wake.set()
        except Exception as e:                        # the mailbox died: the group is gone with it
            self.fail(e)

    def _restart_for(self, session: ScheduledSession) -> None:
        """A control for `session` arrived: if its chunk is running and may restart, give the chunk up (the
        ranks stop it before its commit, or it finishes if too late). Never when the session is behind real
        time: its chunk would not be due again before one more chunk's work."""
        run = self.running
        if run is None or run.session is not session or not run.may_restart or run.aborted:
            return
        if session.clock.deadline() - time.monotonic() < self.last_chunk_s:
            return
        run.aborted = True
        self.ranks.abort(session.id, run.index)

    # ---- the loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        while self.sessions and self.state.runs_chunks:
            try:
                session, wait = self.scheduler.pick()
                if session is None:
                    self.wake.clear()
                    try:
                        # inf: nothing is due (sessions finished or at their in-flight bound) until a wake
                        await asyncio.wait_for(self.wake.wait(), timeout=None if math.isinf(wait) else wait)
                    except asyncio.TimeoutError:
                        pass
                    continue
                if session.replay:
                    await self._replay_chunk(session)
                else:
                    await self._run_chunk(session)
                self.after_chunk()
            except Exception as e:                    # a rank or the muxer failed: the group is gone with it
                self.fail(e)
                return

    async def _run_chunk(self, session: ScheduledSession) -> None:
        """Run the session's next chunk on every rank; its delivery goes on as a task of its own. With
        restart_stale_chunks, a control for the session that arrives while the chunk is in its probes gives
        the chunk up and runs it again with the control (at most once per chunk; see _restart_for)."""
        restarted = False
        while True:
            # its rung travels with its controls (and its journal)
            rung = self.ladder.rung_for(session, self.sessions.values(), session.next_chunk)
            plan = session.plan_next_chunk(rung, restarted)
            t0 = time.monotonic()
            self.running = RunningChunk(session, plan.index, may_restart=self.settings.restart_stale_chunks
                                        and not restarted)
            try:                                      # a failure here is a rank's: the group breaks
                replies = await self.ranks.run_chunk(session.id, plan.index, plan.controls, self.muxer)
            finally:
                aborted, self.running = self.running.aborted, None
                self.last_chunk_s = time.monotonic() - t0
            root = replies[0]
            if session.stopped:
                return
            if root.stopped and aborted:              # given up for a fresher control: run it again with it
                restarted = True
                continue
            if root.stopped:
                return
            break
        session.commit_plan(plan)                     # the ranks advanced the session: the chunk is in flight
        self.metrics.chunks.inc(tags={"group": self.group_id, "quality": plan.controls.quality})
        self.ladder.ran(session, self.sessions.values(), plan.index, plan.rung, max(r.engine_s for r in replies),
                        root.warm, root.timings)
        session.snapshots.take(reply.snapshots for reply in replies)
        previous = self.deliveries.get(session.id)
        self.deliveries[session.id] = fresh_task(self._deliver(session, plan, root, t0, previous))

    async def _replay_chunk(self, session: ScheduledSession) -> None:
        """A resumed session: run its next delivered chunk again with the controls it had (nothing goes to the
        muxer), so the ranks' state (K/V window, decoder cache, camera, RNG, prompt) is what it was. The
        last one posts Resumed."""
        replay = session.replay
        if replay.started is None:
            replay.started = time.monotonic()
        index = session.next_chunk
        replies = await self.ranks.run_chunk(session.id, index, replay.chunks[0], replay=True)
        if session.stopped or replies[0].stopped:
            return
        session.snapshots.take(reply.snapshots for reply in replies)
        session.replayed()
        if not session.replay:
            seconds = time.monotonic() - replay.started
            replayed = index + 1 - replay.restored
            log.info("group %s: session %s resumed from chunk %d after replaying %d chunks in %.2f s", self.group_id,
                     session.id, replay.restored, replayed, seconds)
            self.post(session.id, Resumed(replayed, seconds, replay.restored))

    # ---- delivery -----------------------------------------------------------------------------
    async def _deliver(self, session: ScheduledSession, plan: ChunkPlan, root: ChunkReply, t0: float,
                       previous: Optional[asyncio.Task]) -> None:
        """Await the chunk's fragment, then (after the session's previous chunk) put it on the stream."""
        delivered = False
        try:
            try:
                fragment: Optional[Fragment] = await root.fragment
            except Exception as e:
                raise SessionFailure(session.id, f"encoding failed: {type(e).__name__}") from e
            fragment_at = time.monotonic()
            if previous is not None:
                await previous                        # chunk order on the stream; it never raises
            if fragment is None or session.stopped:   # the session ended while its chunk was being encoded
                return
            done_at = time.monotonic()
            clock = session.clock
            stalls_before = clock.stalls
            clock.delivered(fragment.frames, done_at)
            delivered = True
            timings = dict(root.timings)
            timings.update(encode=fragment.encode_s, root_to_muxer=fragment.transfer_s,
                           outside_engine=(fragment_at - t0) - root.engine_s)
            for stage, seconds in timings.items():
                self.metrics.stage.observe(seconds, tags={"stage": stage})
            self.metrics.rtf.set((done_at - t0) / (fragment.frames / session.start.fps), tags={"group": self.group_id})
            if clock.stalls > stalls_before:
                self.metrics.stalls.inc(tags={"group": self.group_id})
            self.post(session.id, ChunkReady(plan.index, fragment.data, fragment.frames, plan.started, plan.active,
                                             plan.completed, timings, done_at - t0,
                                             {"dispatched": t0, "fragment": fragment_at,
                                              "lead_s": clock.pacer.lead_s, "slack_s": clock.last_slack or 0.0,
                                              "restarted": float(plan.restarted)},
                                             fragment.batches, plan.controls, plan.interactions,
                                             session.snapshots.give()))
            if session.start.chunks is not None and plan.index == session.start.chunks - 1:
                self.post(session.id, SessionDone(plan.index + 1))
        except SessionFailure as e:                   # this session's chunk could not be delivered
            log.warning("group %s: session %s failed: %s", self.group_id, e.session_id, e)
            session.stopped = True
            self.post(e.session_id, SessionFailed(ErrorCode.INTERNAL_ERROR, "this session failed; please start a "
                                                  "new one"))
            self.scheduler.remove(e.session_id)
        except Exception as e:                        # the muxer failed: the group is gone with it
            self.fail(e)
        finally:
            if not delivered:
                session.clock.undelivered()
            self.wake.set()                           # the session may start another chunk now
