"""WorldGroup: one Serve replica = one sequence-parallel group (docs/architecture.md).

The replica owns a placement group [replica] + one bundle per rank + [muxer] (STRICT_PACK, bundles from
ServeSettings.placement_bundles), starts the rank actors pinned to their bundles, joins them in one
process group, and starts the muxer (H.264) and the control mailbox (client controls). Each session is
one long-lived streaming call (`session`): the lease that Serve counts for routing and autoscaling. A
background loop runs the sessions' chunks one at a time, earliest playback deadline first, within the
pacing lead; every chunk is one call to every rank. As soon as the ranks return a chunk, the loop may
start the next one: the chunk's delivery (its fragment from the muxer, then the session's stream) runs
as a task of its own, in chunk order per session, with at most `in_flight_chunks` per session waiting
for delivery (1 on CPU, where it would only compete for the cores). A second task long-polls the
mailbox and wakes the loop when a control arrives.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lingbot.config import get_preset

from .mailbox import ControlMailbox
from .messages import (
    Admitted,
    ChunkReady,
    ChunkReply,
    DeviceStats,
    Fragment,
    GroupEvent,
    Moving,
    RankInfo,
    Resumed,
    SessionDone,
    SessionError,
    SessionRequest,
)
from .metrics import Metrics
from .muxer import Muxer
from .rank import RankWorker
from .sessions import ChunkPlan, ScheduledSession, Scheduler
from .settings import ServeSettings

log = logging.getLogger("ray.serve")

MAILBOX_POLL_S = 5.0       # a long poll: the mailbox answers at once when a control arrives
WATCH_S = 1.0              # how often the group checks that its ranks, muxer and mailbox are alive
EXIT_DELAY_S = 1.0         # a failed group exits this soon after telling its sessions (Serve replaces it)
# a stopping group moves its sessions at the latest this long before Serve kills it: it covers seeing the
# stop late (a poll, a busy controller), the chunk the ranks are on, and the flush of the last snapshots
DRAIN_MARGIN_S = 30.0
FLUSH_TIMEOUT_S = 10.0     # a draining group waits this long for the snapshots of its sessions' last chunks
DRAIN_FILL_MAX_S = 10.0    # a draining group runs its sessions ahead (drain_lead_s) for at most this long
DRAIN_WAIT_NEW_S = 30.0    # how long a stopping group waits for a new group before going to the old ones
STOPPING = SessionError("group_unavailable", "this group is being stopped (scale-down or redeploy); retry")


class SessionFailure(Exception):
    """A failure that concerns one session only (the group and its other sessions carry on)."""

    def __init__(self, session_id: str, message: str):
        super().__init__(message)
        self.session_id = session_id


def device_metric_tags(group: str, stats: list[Optional[DeviceStats]]) -> list[tuple[DeviceStats, dict]]:
    """(stats, tags) of every rank that reported its device, tagged with the rank that measured it."""
    return [(st, {"group": group, "rank": str(rank)}) for rank, st in enumerate(stats) if st is not None]


def replica_unique_id() -> str:
    """The Serve replica's id (as the dashboard and the replica's actor name show it), or a fresh one when
    the group runs outside Serve. Sessions, metrics and logs name the group by it."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return uuid.uuid4().hex[:8]


def serve_replica_states() -> dict[str, tuple[str, float]]:
    """(state: RUNNING, STOPPING, ...; start time, wall clock) of every replica of this replica's deployment
    by replica id, as the Serve controller reports them (the details `serve status` and the dashboard show).
    Serve tells a replica nothing while it waits for the replica's requests to end before stopping it: here
    those requests are the sessions, so a group asks."""
    from ray import serve
    from ray.serve.context import _get_global_client
    context = serve.get_replica_context()
    details = _get_global_client().get_serve_details()
    deployment = details["applications"][context.app_name]["deployments"][context.deployment]
    return {r["replica_id"]: (r["state"], r.get("start_time_s") or 0.0) for r in deployment.get("replicas", ())}


STARTING_STATES = ("STARTING", "UPDATING", "RECOVERING")
NEW_GROUP_SLACK_S = 10.0   # a group started this long before the first stop was seen still counts as new


def drain_due(me: str, states: dict[str, tuple[str, float]], rollout: float, stopping_since: float, now: float,
              grace_s: float) -> Optional[str]:
    """Whether (and why) a group Serve is stopping moves its sessions now; None: not yet, they go on here.
    `states`: serve_replica_states(); `rollout`: when (wall clock) a stopping group of the deployment was
    first seen (this one, or an earlier one of the same redeploy); `stopping_since`, `now`: monotonic.
    - "new group": a group started since the rollout began runs (a redeploy's, or a scale-up's: it has
      room; the old ones still running may be full);
    - "scale-down": other groups run and none is starting (Serve is only removing this one; the load fell);
    - "no new group": other groups run, and the new one has not come up for DRAIN_WAIT_NEW_S (most likely it
      waits for the devices this one holds): the old ones take the sessions if they have room (else the
      sessions wait for the new group in resume_wait_s);
    - "deadline": DRAIN_MARGIN_S before Serve's graceful_shutdown_timeout_s runs out, with or without a
      group to go to (a cluster with no room for a new group while this one holds its devices)."""
    running = {rid: start for rid, (state, start) in states.items() if rid != me and state == "RUNNING"}
    if any(start >= rollout - NEW_GROUP_SLACK_S for start in running.values()):
        return "new group"
    if running and not any(state in STARTING_STATES for state, _ in states.values()):
        return "scale-down"
    if running and now >= stopping_since + DRAIN_WAIT_NEW_S:
        return "no new group"
    if now >= stopping_since + grace_s - DRAIN_MARGIN_S:
        return "deadline"
    return None


@dataclass
class RunningChunk:
    state: ScheduledSession
    index: int
    may_restart: bool
    aborted: bool = False


class WorldGroup:
    def __init__(self, settings: dict):
        s = self.settings = ServeSettings(**settings)
        self.id = replica_unique_id()
        pg = get_current_placement_group()

        def pinned(bundle: int):
            if pg is None:
                return None
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)

        t0 = time.monotonic()
        rank_actor = ray.remote(RankWorker)
        self.ranks = [rank_actor.options(**s.rank_actor_options(), max_concurrency=4,
                                         scheduling_strategy=pinned(s.rank_bundle(r))).remote(settings, r, s.sp)
                      for r in range(s.sp)]
        init_method = ray.get(self.ranks[0].address.remote(), timeout=s.group_start_timeout_s)
        joins = [r.join.remote(init_method) for r in self.ranks]       # all first, then wait: they rendezvous
        infos: list[RankInfo] = ray.get(joins, timeout=s.group_start_timeout_s)
        self.capacity = min(i.capacity for i in infos)
        if self.capacity < 1:
            raise RuntimeError(f"no session fits: one needs {infos[0].session_bytes / 2 ** 30:.2f} GiB per rank, "
                               f"more than is left after the weights and warm-up (memory_budget_gib: "
                               f"{s.memory_budget_gib})")
        self.size = (infos[0].width, infos[0].height)
        self.geometry = get_preset(s.preset).geometry
        self.muxer = ray.remote(Muxer).options(num_cpus=s.muxer_cpus, num_gpus=s.muxer_gpus, max_concurrency=8,
                                               scheduling_strategy=pinned(s.muxer_bundle)
                                               ).remote(*self.size, s.h264_settings)
        # the mailbox only relays small messages: it takes no CPU of its own and lives in the replica's bundle
        self.mailbox = ray.remote(ControlMailbox).options(num_cpus=0,
                                                          scheduling_strategy=pinned(s.replica_bundle)).remote()
        ray.get([self.muxer.ready.remote(), self.mailbox.ready.remote()], timeout=s.group_start_timeout_s)
        self.scheduler = Scheduler(s.pacing_lead_s, s.pacing == "adaptive", s.pacing_margin_s, s.pacing_quantile)
        self.reserved = 0                              # admitted or being admitted
        self.outboxes: dict[str, asyncio.Queue] = {}
        self.deliveries: dict[str, asyncio.Task] = {}  # per session: the delivery of its newest chunk
        self.loop_task: Optional[asyncio.Task] = None
        self.controls_task: Optional[asyncio.Task] = None
        self.wake: Optional[asyncio.Event] = None
        self.broken: Optional[str] = None
        self.stopping_since: Optional[float] = None   # when Serve was seen stopping this group
        self.rollout: Optional[float] = None          # when a stopping group of the deployment was first seen
        self.drain_task: Optional[asyncio.Task] = None
        self.drain_requested = False                  # its sessions are to move to other groups
        self.draining = False                         # no chunk starts any more: they are being handed on
        self.running: Optional[RunningChunk] = None   # the chunk the ranks are on now
        self.last_chunk_s = 0.0                       # how long the last chunk call took
        self.metrics = Metrics()
        self.last_metrics = 0.0
        self.event_loop: Optional[asyncio.AbstractEventLoop] = None
        threading.Thread(target=self._watch, name=f"group-{self.id}-watch", daemon=True).start()
        if s.drain_poll_s > 0 and s.resume_sessions:
            threading.Thread(target=self._watch_stopping, name=f"group-{self.id}-stopping", daemon=True).start()
        log.info("group %s: %d ranks on %s ready in %.1f s, capacity %d sessions", self.id, s.sp, infos[0].device,
                 time.monotonic() - t0, self.capacity)

    # ---- Serve hooks ----------------------------------------------------------------------------
    def check_health(self) -> None:
        if self.broken:
            raise RuntimeError(f"group {self.id} is broken: {self.broken}")

    # ---- healing ------------------------------------------------------------------------------
    def _watch(self) -> None:
        """A thread: every WATCH_S, is every rank, the muxer and the mailbox still there? A dead one fails the
        group at once, with or without sessions (a busy actor is not a dead one)."""
        while not self.broken:
            time.sleep(WATCH_S)
            calls = [r.alive.remote() for r in self.ranks] + [self.muxer.ready.remote(), self.mailbox.ready.remote()]
            done, _ = ray.wait(calls, num_returns=len(calls), timeout=WATCH_S * 5)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:
                    if self.event_loop is not None and not self.event_loop.is_closed():
                        self.event_loop.call_soon_threadsafe(self._fail_group, e)
                        time.sleep(EXIT_DELAY_S * 2)       # _fail_group exits after telling the sessions
                    self._exit(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

    def _watch_stopping(self) -> None:
        """A thread of its own (a slow controller never delays noticing a dead rank): every drain_poll_s, is
        Serve stopping this group? Once it is, the group takes no new session and moves its sessions when
        drain_due says so."""
        while not self.broken and not self.drain_requested:
            time.sleep(self.settings.drain_poll_s)
            try:
                states = serve_replica_states()
            except Exception as e:                    # outside Serve, or the controller busy: ask again later
                log.debug("group %s: replica states unavailable: %s", self.id, e)
                continue
            stopping = [rid for rid, (state, _) in states.items() if state == "STOPPING"]
            if not stopping:
                self.rollout = None
            elif self.rollout is None:                # a redeploy (or scale-down) began: groups since are new
                self.rollout = time.time()
            if self.id not in stopping:
                continue
            now = time.monotonic()
            if self.stopping_since is None:
                self.stopping_since = now
                log.info("group %s: Serve is stopping it; its sessions will move to another group", self.id)
            why = drain_due(self.id, states, self.rollout, self.stopping_since, now,
                            self.settings.graceful_shutdown_timeout_s)
            loop = self.event_loop
            if why is not None and loop is not None and not loop.is_closed():
                self.drain_requested = True
                loop.call_soon_threadsafe(self._start_drain, why)

    def _start_drain(self, why: str) -> None:
        self.drain_task = asyncio.get_running_loop().create_task(self._drain(why), context=contextvars.Context())

    async def _drain(self, why: str) -> None:
        """Move every session to another group. First (unless the deadline is near) each runs ahead of its
        playback by drain_lead_s (for at most DRAIN_FILL_MAX_S: a full group has little throughput to spare),
        so that its viewer plays the move out of the buffer. Then the chunk the ranks are on and the
        deliveries in flight finish (so nothing computed is lost), each session gets Moving with the snapshots
        of its last chunk, and its ingress resumes it elsewhere (restoring that chunk: nothing to replay)."""
        t0 = time.monotonic()
        log.info("group %s: moving its %d sessions (%s)", self.id, len(self.scheduler.sessions), why)
        lead = self.settings.drain_lead_s
        if lead > 0 and self.wake is not None and why != "deadline":     # at the deadline there is no time
            for state in self.scheduler.sessions.values():
                state.pacer.hold_lead(lead)
            self.wake.set()

            def filling() -> bool:
                now = time.monotonic()
                return any(not st.finished and st.deadline() - now < lead for st in self.scheduler.sessions.values())
            while filling() and time.monotonic() - t0 < DRAIN_FILL_MAX_S and not self.broken:
                await asyncio.sleep(0.05)
        filled = time.monotonic() - t0
        self.draining = True
        if self.wake is not None:
            self.wake.set()                           # the chunk loop sees draining and ends after its chunk
        if self.loop_task is not None:
            await asyncio.wait({self.loop_task}, timeout=self.settings.chunk_timeout_s)
        await asyncio.gather(*list(self.deliveries.values()), return_exceptions=True)
        states = [st for st in self.scheduler.sessions.values() if not st.stopped]

        async def hand_on(state: ScheduledSession) -> None:
            try:
                flushed = await asyncio.wait_for(asyncio.gather(
                    *[r.flush_snapshots.remote(state.id) for r in self.ranks]), FLUSH_TIMEOUT_S)
            except Exception as e:                    # the next group replays a chunk or two more
                log.warning("group %s: session %s moves without its last snapshots (%s)", self.id, state.id,
                            type(e).__name__)
                flushed = []
            state.take_snapshots(flushed)
            self._post(state.id, Moving("group_stopping", state.give_snapshots()))
        await asyncio.gather(*[hand_on(st) for st in states])
        log.info("group %s: %d sessions handed on in %.2f s (%.2f s of it running them ahead)", self.id,
                 len(states), time.monotonic() - t0, filled)

    def _exit(self, why: str) -> None:
        """Leave at once so that Serve replaces this replica now, not at its next health check (the ranks,
        muxer and mailbox go with it: this process owns them)."""
        log.error("group %s exits (%s); Serve starts a new one", self.id, why)
        logging.shutdown()
        os._exit(1)

    # ---- the session lease --------------------------------------------------------------------
    async def session(self, request: SessionRequest):
        """Streaming call held for the whole session: yields Admitted, then one ChunkReady per chunk, then
        SessionDone (or SessionError); a resumed session (request.resume) yields Resumed once its ranks are
        where the failed group's were. Cancelling it (client gone, stop) frees the session within one step."""
        self.event_loop = asyncio.get_running_loop()
        if self.broken:
            yield SessionError("group_unavailable", "this group failed and is being replaced; retry")
            return
        if self.stopping_since is not None:
            yield STOPPING
            return
        if self.reserved >= self.capacity:             # checked and taken before any await: no over-admission
            yield SessionError("capacity_exhausted", "group is full")
            return
        self.reserved += 1
        sid, start, resume = request.session_id, request.start, request.resume
        state = ScheduledSession(sid, start, self.geometry, self.settings.max_queued_controls,
                                 max_in_flight=self.settings.in_flight_chunks)
        try:
            first, before = (0, 0) if resume is None else (resume.next_index, resume.frames_delivered)
            mime = await self.muxer.open.remote(sid, start.fps, start.output, first, before)
            snapshots = resume.snapshots if resume is not None and len(resume.snapshots) == len(self.ranks) \
                else [None] * len(self.ranks)
            opened = await asyncio.gather(*[r.open_session.remote(sid, start.image, start.prompt, start.seed,
                                                                  start.flow_shift, start.trajectory, request.keeper,
                                                                  snapshots[i])
                                            for i, r in enumerate(self.ranks)])
            if any(o is None for o in opened):
                return                                 # cancelled while opening: the finally cleans up
            if resume is not None:
                restored = resume.snapshot_index + 1
                if any(o != restored for o in opened):  # a snapshot was lost, or another group size: replay all
                    if any(o != 0 for o in opened):
                        await asyncio.gather(*[r.reset_session.remote(sid) for r in self.ranks])
                    restored = 0
                state.resume_from(resume, restored)
            if self.stopping_since is not None:      # Serve began stopping the group while it opened
                yield STOPPING
                return
            outbox: asyncio.Queue = asyncio.Queue()
            self.outboxes[sid] = outbox
            self.scheduler.add(state)
            self._ensure_tasks()
            self.metrics.active_sessions.set(len(self.scheduler.sessions), tags={"group": self.id})
            yield Admitted(self.id, self.mailbox, mime, self.capacity)
            if resume is not None and not state.replay:
                yield Resumed(0, 0.0, state.next_chunk)   # nothing to replay: it continues at once
            if resume is not None and start.chunks is not None and resume.next_index >= start.chunks:
                yield SessionDone(start.chunks)           # it had delivered its last chunk already
                return
            while True:
                event = await outbox.get()
                yield event
                if isinstance(event, (SessionDone, Moving)) or (isinstance(event, SessionError)
                                                                and event.event_id is None):
                    break                              # an error about one interaction leaves the session on
        finally:
            self.reserved -= 1
            state.stopped = True
            for r in self.ranks:
                r.stop.remote(sid)                   # a running chunk ends at its next step, on every rank
            self.scheduler.remove(sid)
            self.outboxes.pop(sid, None)
            self.deliveries.pop(sid, None)
            for r in self.ranks:
                r.close_session.remote(sid)
            self.muxer.close.remote(sid)
            self.mailbox.close.remote(sid)
            self.metrics.active_sessions.set(len(self.scheduler.sessions), tags={"group": self.id})

    # ---- the chunk loop and the control pump --------------------------------------------------
    def _ensure_tasks(self) -> None:
        # Fresh contexts: the tasks' actor calls must not count as children of the session request that
        # happened to start them, or cancelling that request (client gone) would cancel every session's chunk.
        loop = asyncio.get_running_loop()
        if self.loop_task is None or self.loop_task.done():
            self.wake = asyncio.Event()
            self.loop_task = loop.create_task(self._loop(), context=contextvars.Context())
        if self.controls_task is None or self.controls_task.done():
            self.controls_task = loop.create_task(self._receive_controls(), context=contextvars.Context())
        self.wake.set()

    def _post(self, sid: str, event: GroupEvent) -> None:
        box = self.outboxes.get(sid)
        if box is not None:
            box.put_nowait(event)

    async def _receive_controls(self) -> None:
        """Long-poll the mailbox while sessions run; queue each control on its session and wake the loop."""
        try:
            while self.scheduler.sessions and not self.broken:
                batch = await self.mailbox.take.remote(MAILBOX_POLL_S)
                for sid, interactions in batch.items():
                    state = self.scheduler.sessions.get(sid)
                    for interaction in interactions if state is not None else ():
                        if not state.queue(interaction):
                            self._post(sid, SessionError("too_many_controls",
                                                         f"more than {state.max_queued} interactions queued; slow down",
                                                         interaction.event_id))
                    if state is not None and interactions:
                        self._restart_for(state)
                if batch:
                    self.wake.set()
        except Exception as e:                        # the mailbox died: the group is gone with it
            self._fail_group(e)

    def _restart_for(self, state: ScheduledSession) -> None:
        """A control for `state` arrived: if its chunk is running and may restart, give the chunk up (the
        ranks stop it before its commit, or it finishes if too late). Never when the session is behind real
        time: its chunk would not be due again before one more chunk's work."""
        run = self.running
        if run is None or run.state is not state or not run.may_restart or run.aborted:
            return
        if state.deadline() - time.monotonic() < self.last_chunk_s:
            return
        run.aborted = True
        for r in self.ranks:
            r.abort_chunk.remote(state.id, run.index)

    def _fail_group(self, error: Exception) -> None:
        """A rank, the muxer or the mailbox failed: tell every session (their ingresses resume them elsewhere),
        then exit so that Serve replaces the group at once."""
        if self.broken:
            return
        self.broken = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        log.error("group %s: failing its sessions: %s", self.id, self.broken)
        for sid in list(self.outboxes):
            self._post(sid, SessionError("internal_error", "the model group failed while generating"))
        if self.wake is not None:
            self.wake.set()
        asyncio.get_running_loop().call_later(EXIT_DELAY_S, self._exit, self.broken)

    async def _loop(self) -> None:
        while self.scheduler.sessions and not self.broken and not self.draining:
            try:
                state, wait = self.scheduler.pick()
                if state is None:
                    self.wake.clear()
                    try:
                        # inf: nothing is due (sessions finished or at their in-flight bound) until a wake
                        await asyncio.wait_for(self.wake.wait(), timeout=None if math.isinf(wait) else wait)
                    except asyncio.TimeoutError:
                        pass
                    continue
                await self._run_chunk(state)
                self._maybe_report_devices()
            except Exception as e:                    # a rank or the muxer failed: the group is gone with it
                self._fail_group(e)
                return

    async def _run_chunk(self, state: ScheduledSession) -> None:
        """Run the session's next chunk on every rank; its delivery goes on as a task of its own. With
        restart_stale_chunks, a control for the session that arrives while the chunk is in its probes gives
        the chunk up and runs it again with the control (at most once per chunk; see _restart_for)."""
        if state.replay:
            await self._replay_chunk(state)
            return
        restarted = False
        while True:
            plan = state.plan_next_chunk()
            plan.restarted = restarted
            t0 = time.monotonic()
            self.running = RunningChunk(state, plan.index, may_restart=self.settings.restart_stale_chunks
                                        and not restarted)
            calls = [r.run_chunk.remote(state.id, plan.index, plan.controls, self.muxer if i == 0 else None)
                     for i, r in enumerate(self.ranks)]
            try:                                      # a failure here is a rank's: the group breaks
                replies: list[ChunkReply] = await asyncio.wait_for(asyncio.gather(*calls),
                                                                   self.settings.chunk_timeout_s)
            except asyncio.TimeoutError:
                raise RuntimeError(f"chunk {plan.index} of session {state.id} did not come back from every rank "
                                   f"within {self.settings.chunk_timeout_s:g} s") from None
            finally:
                aborted, self.running = self.running.aborted, None
                self.last_chunk_s = time.monotonic() - t0
            root = replies[0]
            if state.stopped:
                return
            if root.stopped and aborted:              # given up for a fresher control: run it again with it
                restarted = True
                continue
            if root.stopped:
                return
            break
        state.commit_plan(plan)                       # the ranks advanced the session: the chunk is in flight
        state.take_snapshots(reply.snapshots for reply in replies)
        previous = self.deliveries.get(state.id)
        self.deliveries[state.id] = asyncio.get_running_loop().create_task(
            self._deliver(state, plan, root, t0, previous), context=contextvars.Context())

    async def _replay_chunk(self, state: ScheduledSession) -> None:
        """A resumed session: run its next delivered chunk again with the controls it had (nothing goes to the
        muxer), so the ranks' state (K/V window, decoder cache, camera, RNG, prompt) is what it was. The
        last one posts Resumed."""
        if state.replay_started is None:
            state.replay_started = time.monotonic()
        index = state.next_chunk
        calls = [r.run_chunk.remote(state.id, index, state.replay[0], None) for r in self.ranks]
        try:
            replies: list[ChunkReply] = await asyncio.wait_for(asyncio.gather(*calls), self.settings.chunk_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"replay of chunk {index} of session {state.id} did not come back from every rank "
                               f"within {self.settings.chunk_timeout_s:g} s") from None
        if state.stopped or replies[0].stopped:
            return
        state.take_snapshots(reply.snapshots for reply in replies)
        state.replayed()
        if not state.replay:
            seconds = time.monotonic() - state.replay_started
            replayed = index + 1 - state.restored
            log.info("group %s: session %s resumed from chunk %d after replaying %d chunks in %.2f s", self.id,
                     state.id, state.restored, replayed, seconds)
            self._post(state.id, Resumed(replayed, seconds, state.restored))

    async def _deliver(self, state: ScheduledSession, plan: ChunkPlan, root: ChunkReply, t0: float,
                       previous: Optional[asyncio.Task]) -> None:
        """Await the chunk's fragment, then (after the session's previous chunk) put it on the stream."""
        delivered = False
        try:
            try:
                fragment: Optional[Fragment] = await root.fragment
            except Exception as e:
                raise SessionFailure(state.id, f"encoding failed: {type(e).__name__}") from e
            fragment_at = time.monotonic()
            if previous is not None:
                await previous                        # chunk order on the stream; it never raises
            if fragment is None or state.stopped:     # the session ended while its chunk was being encoded
                return
            done_at = time.monotonic()
            stalls_before = state.stalls
            state.delivered(fragment.frames, done_at)
            delivered = True
            timings = dict(root.timings)
            timings.update(encode=fragment.encode_s, root_to_muxer=fragment.transfer_s,
                           outside_engine=(fragment_at - t0) - root.engine_s)
            for stage, seconds in timings.items():
                self.metrics.stage.observe(seconds, tags={"stage": stage})
            self.metrics.rtf.set((done_at - t0) / (fragment.frames / state.start.fps), tags={"group": self.id})
            if state.stalls > stalls_before:
                self.metrics.stalls.inc(tags={"group": self.id})
            self._post(state.id, ChunkReady(plan.index, fragment.data, fragment.frames, plan.started, plan.active,
                                            plan.completed, timings, done_at - t0,
                                            {"dispatched": t0, "fragment": fragment_at, "lead_s": state.pacer.lead_s,
                                             "slack_s": state.last_slack or 0.0,
                                             "restarted": float(plan.restarted)},
                                            fragment.batches, plan.controls, plan.planner,
                                            state.give_snapshots()))
            if state.start.chunks is not None and plan.index == state.start.chunks - 1:
                self._post(state.id, SessionDone(plan.index + 1))
        except SessionFailure as e:                   # this session's chunk could not be delivered
            log.warning("group %s: session %s failed: %s", self.id, e.session_id, e)
            state.stopped = True
            self._post(e.session_id, SessionError("internal_error", "this session failed; please start a new one"))
            self.scheduler.remove(e.session_id)
        except Exception as e:                        # the muxer failed: the group is gone with it
            self._fail_group(e)
        finally:
            if not delivered:
                state.undelivered()
            self.wake.set()                           # the session may start another chunk now

    def _maybe_report_devices(self) -> None:
        """Every metrics_interval_s, a task of its own (never in the way of the next chunk's dispatch)."""
        now = time.monotonic()
        if now - self.last_metrics < self.settings.metrics_interval_s:
            return
        self.last_metrics = now
        asyncio.get_running_loop().create_task(self._report_devices(), context=contextvars.Context())

    async def _report_devices(self) -> None:
        """Each rank's own device utilisation and memory, tagged by rank."""
        try:                                          # metrics never stall or fail the chunk loop
            stats = await asyncio.wait_for(asyncio.gather(*[r.device_stats.remote() for r in self.ranks]), 5.0)
        except Exception as e:
            log.warning("group %s: device stats unavailable: %s", self.id, type(e).__name__)
            return
        for st, tags in device_metric_tags(self.id, stats):
            if st.utilization == st.utilization:          # NaN: no sample yet (or NVML absent)
                self.metrics.device_util.set(st.utilization, tags=tags)
            self.metrics.device_memory.set(st.memory_used, tags=tags)
