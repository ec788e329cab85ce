"""A session's life at the ingress, in one place: from the connection's first message to its end, fault and drain
included (docs/architecture.md, "A session's life").

    WAITING_FOR_START --start--> ADMITTING --Admitted--> STREAMING --SessionDone / stop--> ENDED
                                     |                   |     ^
                                     |     fault, Moving |     | a group took it (Resumed follows)
                                     |                   v     |
                                     +---- refused ---> ENDED <- RESUMING (no group within resume_wait_s)

1. WAITING_FOR_START: the first message must be a valid start within start_timeout_s (keepalives answered,
   bad messages refused: the first protocol closes, the second lets the client try again).
2. ADMITTING: the tenant's limits, then a lease on a group (admission.py): one long streaming call that yields
   Admitted, then the session's events, queued while every group is full (the client told its place and an
   estimate) up to max_queue_wait_s while a group may still come; then capacity_exhausted (1013). A start
   that names a saved world (worlds.py) takes its start, and the group replays its chunks first.
3. STREAMING: the pump relays each ChunkReady to the client (the ledger records it) while the control reader
   posts the client's interactions to the group's mailbox and minds the idle and lifetime limits.
4. RESUMING: the group failed (SessionFailed) or is being stopped (Moving): the ledger's journal, interaction
   state and snapshot references go to a new lease; meanwhile controls wait in the ledger. A fault counts
   against max_resumes, a drain does not (it is the operator's, not the session's). Back to STREAMING when a
   group took it; ENDED when none did within resume_wait_s.
5. ENDED: done, stopped by the client, refused (every closing refusal ends the session), or the client left.
   Leaving any phase cancels the lease, which frees the session's state on its group within one step.

Plain Python: no Ray, no Starlette. The ingress gives it a `Wire` (one per protocol dialect) and a `GroupLink`
(Serve's handle, the mailbox, the snapshot keeper); tests give it their own. Its viewers, recording and saved
worlds: outputs.py."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from typing import Optional

from .admission import Admission
from .audience import Stage
from .codes import CLOSE_POLICY, CLOSE_SERVER_ERROR, CLOSE_TRY_AGAIN, ErrorCode, ProtocolError
from .events import (
    Admitted,
    ChunkReady,
    InteractionRefused,
    Moving,
    Resumed,
    SessionDone,
    SessionFailed,
    SessionRequest,
    SnapshotOwner,
)
from .ledger import ContinuityLedger
from .outputs import Outputs
from .phases import NEXT_PHASES, Phase, PhaseMachine
from .ports import ACTIVITY, SAVE, SHARE, STOP, UNSHARE, ClientGone, GroupLink, SessionMetrics, Wire
from .reading import ClientReader, EarlyControls, unknown_fields_said, watch_client
from .requests import Interaction, StartRequest
from .waiting import WaitingRoom
from .worlds import Worlds

log = logging.getLogger("ray.serve")


class SessionLife:
    """One session at the ingress, whichever protocol: its phase, its ledger and the flows between them."""

    def __init__(self, wire: Wire, groups: GroupLink, settings, metrics: SessionMetrics,
                 room: Optional[WaitingRoom] = None, stage: Optional[Stage] = None, recordings=None,
                 worlds: Optional[Worlds] = None):
        self.wire, self.groups, self.settings, self.metrics = wire, groups, settings, metrics
        self.session_id = uuid.uuid4().hex
        self.phases = PhaseMachine(Phase.WAITING_FOR_START, NEXT_PHASES)
        self.ledger = ContinuityLedger(settings.sp, release=functools.partial(groups.let_go, self.session_id))
        self.start: Optional[StartRequest] = None
        self.mailbox = None                     # the group's, while STREAMING
        self.chunks_sent = 0
        self.sequence = 0                       # interactions posted (their arrival order)
        self.last_interaction = self.started_at = time.monotonic()
        self.scripted = False                   # the camera follows an offline trajectory: no camera or key events
        # the interactions its client sent while it waited for a group (parsed, bounded)
        self.early = EarlyControls(settings.max_queued_controls, settings.max_control_bytes)
        self.kept = False                       # a keeper was told to keep its snapshots (its end lets them go)
        self.resumes = 0                        # every resume (each has its own id at its group)
        self.faults = 0                         # resumes after a fault (at most max_resumes); a drain is not one
        self.resume_reason = "saved"            # why it last moved: fault, drain; "saved" (a saved world) at first
        self.failed_at: Optional[float] = None
        self.send_lock = asyncio.Lock()         # a chunk's messages go out together (nothing between them)
        self.reader = ClientReader(wire, settings, self.send_lock, self.started_at)
        self.room = room or WaitingRoom()       # the ingress's: where a session waits for its first group
        self.admission = Admission(self.session_id, wire, self.send_lock, groups, self.room, settings.admission_wait_s)
        # its viewers, its recording, its saved worlds
        self.outputs = Outputs(self.session_id, wire, groups, stage, recordings, settings, worlds)

    @property
    def phase(self) -> Phase:
        return self.phases.phase

    def enter(self, phase: Phase) -> None:
        self.phases.enter(phase, f"session {self.session_id}")

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    @property
    def group_sid(self) -> str:
        """The session's id at its group: another one per resume, so that a group that hosted it before (and
        remembers that session as ended) can take it again."""
        return self.session_id if not self.resumes else f"{self.session_id}.{self.resumes}"

    # ---- talking to the client -----------------------------------------------------------------
    async def refuse(self, error: ProtocolError) -> None:
        """Refuse with `error`; a refusal that closes ends the session."""
        self.metrics.refused(error.code)
        if error.close is None:
            async with self.send_lock:
                await self.wire.send_error(error)
            return
        self.enter(Phase.ENDED)
        await self.wire.close_with(error)

    async def _refuse_open(self, error: ProtocolError) -> bool:
        await self.refuse(error)                 # whether the session goes on (a refusal that closes ends it)
        return not self.ended

    async def send_or_stall(self, data) -> bool:
        """Send one message; False (and the session ended with stall_timeout) when it stays blocked for
        stall_timeout_s: the client stopped reading, or is gone without closing. A client that reads but has
        nothing to say is never cut for its silence."""
        s = self.settings
        try:
            await asyncio.wait_for(self.wire.send(data), s.stall_timeout_s)
            return True
        except asyncio.TimeoutError:
            log.warning("session %s: a send blocked for %g s; ending it", self.session_id, s.stall_timeout_s)
            await self.refuse(ProtocolError(ErrorCode.STALL_TIMEOUT, f"the client read nothing for "
                                            f"{s.stall_timeout_s:g} s", close=CLOSE_POLICY))
            return False

    # ---- 1. waiting for the start --------------------------------------------------------------
    async def run(self, tenant: str, limits) -> None:
        """The whole life; `limits` (access.py's TenantLimits) counts `tenant`'s starts and holds its slot."""
        try:
            start = await self.wait_for_start(tenant, limits)
            if start is None:
                return
            try:
                await self.admit_and_stream(start)
            finally:
                limits.release(tenant)
        finally:
            self.outputs.ended(self.chunks_sent)   # (where the stream did not end normally: its viewers too)
            if self.admission.lease is not None:
                self.admission.lease.cancel()    # every path (done, stop, refusal, disconnect) ends the lease
            if self.kept:                         # and frees its snapshots at the keeper
                self.groups.let_go(self.session_id)
            self.phases.move(Phase.ENDED)         # from any phase
            self.room.leave(self.session_id, admitted=False)   # (a place taken and never used)

    async def wait_for_start(self, tenant: str, limits) -> Optional[StartRequest]:
        """The start, with `tenant`'s slot taken, or None (ended). The slot is taken before the start is parsed,
        so a start refused for what it holds (an image, a field) counts in the tenant's start rate too."""
        s = self.settings
        deadline = time.monotonic() + s.start_timeout_s
        while True:
            try:
                msg = await self.reader.next_message(deadline, self._refuse_open, start=True)
            except asyncio.TimeoutError:
                await self.refuse(ProtocolError(ErrorCode.START_TIMEOUT, f"no session start within "
                                                f"{s.start_timeout_s:g} s of connecting", close=CLOSE_POLICY))
                return None
            if msg is None:
                return None
            refusal = limits.admit(tenant, time.monotonic())
            if refusal is not None:
                await self.refuse(refusal)
                return None
            try:
                start = await self.wire.parse_start(msg, await self.groups.facts())
            except ProtocolError as e:
                limits.release(tenant)
                await self.refuse(e)
                if self.ended:
                    return None
                continue
            except BaseException:
                limits.release(tenant)
                raise
            unknown_fields_said(start, self.metrics, self.session_id)
            self.outputs.tenant = tenant
            return start

    # ---- 2. admission (admission.py: the lease loop and the queue) -----------------------------
    async def admit_and_stream(self, start: StartRequest) -> None:
        s = self.settings
        try:                                         # a saved world resumed: its chunks replayed, then on
            start = await self.outputs.open_world(start, self.ledger)
        except ProtocolError as e:
            return await self.refuse(e)
        self.start = start
        self.scripted = start.trajectory is not None
        self.enter(Phase.ADMITTING)
        if not self.room.try_join(self.session_id, s.max_waiting_sessions):   # the bound, taken before any await
            await self.refuse(ProtocolError(ErrorCode.CAPACITY_EXHAUSTED, f"{s.max_waiting_sessions} sessions wait "
                                            "for a model group already; try again later", close=CLOSE_TRY_AGAIN,
                                            retry_after_s=s.retry_after_s))
            return
        owner = await self.snapshot_owner()
        request = SessionRequest(self.group_sid, start, await self.outputs.world_resume(owner), owner)
        watching = functools.partial(watch_client, self.reader, self.wire.control, self.early, self._refuse_open,
                                     self.sequence + 1)         # (the client read while the session waits)
        left, first = await self.admission.admit_while_watching(request, s.max_queue_wait_s, watching)
        if left:                                         # nothing more is sent to a client that left
            if first and not self.ended:                 # stopped while it waited: nothing was generated
                self.enter(Phase.ENDED)
                await self.wire.finish(True, 0)
            return
        if first is None or (isinstance(first, SessionFailed) and first.code == ErrorCode.CAPACITY_EXHAUSTED):
            await self.refuse(ProtocolError(ErrorCode.CAPACITY_EXHAUSTED, "every model group is busy; try again later",
                                            close=CLOSE_TRY_AGAIN, retry_after_s=s.retry_after_s))
            return
        if not isinstance(first, Admitted):
            close = CLOSE_TRY_AGAIN if first.code == ErrorCode.GROUP_UNAVAILABLE else CLOSE_SERVER_ERROR
            await self.refuse(ProtocolError(first.code, first.message, close=close, retry_after_s=s.retry_after_s))
            return
        self._streaming_on(first)
        self.metrics.admitted()
        self.started_at = time.monotonic()
        await self.wire.send_admitted(first, start, self.session_id)
        share = start.spectators if self.early.share is None else self.early.share
        for refusal in await self.outputs.open(first, start, share, self.send_lock):
            await self.refuse(refusal)
        reader = asyncio.create_task(self.read_controls())
        try:
            stopped = await self.pump(reader)
        finally:
            reader.cancel()
        if stopped is not None and not self.ended:
            self.admission.lease.cancel()
            self.enter(Phase.ENDED)
            await self.outputs.end(self.chunks_sent, stopped)
            await self.wire.finish(stopped, self.chunks_sent)

    async def snapshot_owner(self) -> Optional[SnapshotOwner]:
        """Where the session's snapshots are kept: the ingress's keeper, under this session's id (None: no
        snapshots)."""
        keeper = await self.groups.keeper()
        self.kept = self.kept or keeper is not None
        return None if keeper is None else SnapshotOwner(keeper, self.session_id)

    def _streaming_on(self, admitted: Admitted) -> None:
        self.enter(Phase.STREAMING)
        self.mailbox = admitted.mailbox
        self.outputs.streaming_on(admitted, self.start, self.group_sid)
        if admitted.facts is not None:               # (as the session's own window sees them, if it has one)
            self.ledger.facts = admitted.facts.windowed(self.start.window)

    # ---- 3. streaming --------------------------------------------------------------------------
    async def pump(self, reader: asyncio.Task) -> Optional[bool]:
        """Relay the group's events; returns stopped (True/False), or None when the session ended otherwise."""
        last = None
        next_event = asyncio.ensure_future(self.admission.lease.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({next_event, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done:
                    return reader.result()              # stop, timeout or disconnect
                try:
                    event = next_event.result()
                except StopAsyncIteration:
                    return False
                except Exception as e:                    # the group's replica is gone
                    event = SessionFailed(ErrorCode.INTERNAL_ERROR, f"the model group is gone ({type(e).__name__})")
                if isinstance(event, ChunkReady):
                    now = time.monotonic()
                    if last is not None:
                        self.metrics.chunk_interval(now - last)
                    last = now
                    async with self.send_lock:
                        sent = await self.wire.send_chunk(event, self.chunks_sent, self.send_or_stall) and \
                            await self.outputs.delivered(event, self.chunks_sent, self.send_or_stall)
                    if not sent:
                        return None
                    self.metrics.video_bytes("owner", len(event.data) + sum(len(b.payload) for b in event.batches))
                    self.chunks_sent += 1
                    self.ledger.delivered(event, self.start.fps)
                elif isinstance(event, Resumed):
                    gap = time.monotonic() - (self.failed_at or time.monotonic())
                    async with self.send_lock:
                        sent = await self.wire.send_resumed(event, self.ledger.chunks, self.chunks_sent, gap,
                                                            self.resume_reason, self.send_or_stall)
                    if not sent:
                        return None
                elif isinstance(event, SessionDone):
                    return False
                elif isinstance(event, (Moving, SessionFailed)):
                    drain = isinstance(event, Moving)
                    if drain:
                        self.ledger.keep(event.snapshots)
                    else:
                        log.warning("session %s: %s: %s", self.session_id, event.code, event.message)
                    resumed = await self.resume(reader, drain)
                    if resumed is None:
                        return reader.result()
                    if not resumed:
                        code, text = (ErrorCode.GROUP_UNAVAILABLE, "no model group could take the session while "
                                      "its group was stopped") if drain else \
                            (event.code, "the model group failed while generating")
                        await self.refuse(ProtocolError(code, f"{text}; please retry", close=CLOSE_SERVER_ERROR))
                        return None
                    last = None
                elif isinstance(event, InteractionRefused):
                    self.ledger.refused(event.event_id)
                    await self.refuse(ProtocolError(event.code, event.message, event_id=event.event_id))
                    if self.ended:
                        return None
                next_event = asyncio.ensure_future(self.admission.lease.__anext__())
        finally:
            next_event.cancel()

    def _next_limit(self) -> tuple[float, ErrorCode, str]:
        """The earliest of the session's time limits: (monotonic deadline, code, message)."""
        s = self.settings
        return min([(self.last_interaction + s.idle_timeout_s, ErrorCode.IDLE_TIMEOUT,
                     f"no interaction for {s.idle_timeout_s:g} s"),
                    (self.started_at + s.max_lifetime_s, ErrorCode.MAX_LIFETIME,
                     f"session reached its maximum lifetime of {s.max_lifetime_s:g} s")])

    async def read_controls(self) -> Optional[bool]:
        """Client messages during the session. Returns True when the client stopped the session, None when the
        session ended otherwise (disconnect or a timeout refusal)."""
        while True:
            if self.early:                               # what came while it waited: parsed and checked already
                control = self.early.take()
            else:
                until, _, _ = self._next_limit()
                try:
                    msg = await self.reader.next_message(until, self._refuse_open)
                except asyncio.TimeoutError:
                    until, code, text = self._next_limit()   # an interaction may have moved the limit meanwhile
                    if time.monotonic() >= until:
                        await self.refuse(self.wire.limit_error(code, text))
                        return None
                    continue
                except ClientGone:
                    self.enter(Phase.ENDED)
                    return None
                if msg is None:
                    return None
                try:
                    control = self.wire.control(msg, self.sequence + 1)
                except ProtocolError as e:
                    await self.refuse(e)
                    control = None
            if control == STOP:
                return True
            if control in (SHARE, UNSHARE, SAVE):
                await self.owner_asked(control)
            elif control == ACTIVITY:
                self.last_interaction = time.monotonic()
            elif isinstance(control, Interaction) and await self.post(control):
                ack = self.wire.queued(control)
                if ack is not None:
                    async with self.send_lock:
                        await self.wire.send(ack)
            if self.ended:
                return None

    async def owner_asked(self, control: str) -> None:
        """session.share, session.unshare, session.save (outputs.py); a refusal leaves the session on."""
        refusal = await self.outputs.asked(control, self.send_lock, self.start, self.ledger, self.refuse)
        if refusal is not None:
            await self.refuse(refusal)

    async def post(self, interaction: Interaction) -> bool:
        """Send a client's interaction to its group (refused while the camera follows a path, and past
        max_queued_controls owed while no group holds the session)."""
        if self.scripted and (interaction.camera is not None or interaction.keys is not None
                              or interaction.hold is not None):
            await self.refuse(ProtocolError(ErrorCode.CAMERA_SCRIPTED, "this session's camera follows its "
                                            "camera_trajectory; only prompt events apply",
                                            event_id=interaction.event_id))
            return False
        limit = self.settings.max_queued_controls
        if self.phase is not Phase.STREAMING and len(self.ledger.unstarted) >= limit:
            # no group holds the session to refuse the excess (it does while streaming): the ledger does, so
            # what waits for the next group stays bounded however long the resume takes
            await self.refuse(ProtocolError(ErrorCode.TOO_MANY_CONTROLS, f"more than {limit} interactions wait "
                                            "for the session's next group", event_id=interaction.event_id))
            return False
        self.last_interaction = time.monotonic()
        self.sequence += 1
        interaction.seq = self.sequence
        self.ledger.posted(interaction)
        if self.phase is Phase.STREAMING:           # while RESUMING it waits in the ledger for the next group
            self.groups.post(self.mailbox, self.group_sid, interaction)
        return True

    # ---- 4. resuming ---------------------------------------------------------------------------
    async def resume(self, reader: asyncio.Task, drain: bool = False) -> Optional[bool]:
        """The session's group failed (or, with `drain`, is being stopped): continue the session on a healthy
        group (another, or this one rebuilt), restored from its snapshots and the journal after them (or the
        whole journal). True when a group took it (the chunks it restores or replays are not sent again);
        False when none did; None when the client stopped or left meanwhile (`reader` ended)."""
        s = self.settings
        if not s.resume_sessions or self.ended or (not drain and self.faults >= s.max_resumes):
            return False
        self.enter(Phase.RESUMING)
        self.resumes += 1
        self.faults += not drain
        self.resume_reason = "drain" if drain else "fault"
        self.failed_at = self.last_interaction = time.monotonic()   # the client is not idle while it waits
        self.admission.lease.cancel()
        self.mailbox = None
        owner = await self.snapshot_owner()
        request = SessionRequest(self.group_sid, self.start, self.ledger.resume(owner), keeper=owner)
        if drain:
            log.info("session %s: its group is being stopped after %d chunks; moving it", self.session_id,
                     self.ledger.chunks)
        else:
            log.warning("session %s: its group failed after %d chunks; resuming (%d of at most %d)",
                        self.session_id, self.ledger.chunks, self.faults, s.max_resumes)
        admitting = asyncio.ensure_future(self.admission.admit(request, s.resume_wait_s))
        await asyncio.wait({admitting, reader}, return_when=asyncio.FIRST_COMPLETED)
        if reader.done():                            # the client left or stopped: no group needed any more
            admitting.cancel()
            return None
        answer = admitting.result()
        if not isinstance(answer, Admitted):
            self.metrics.resumed("failed", self.resume_reason)
            log.error("session %s: no group took it within %g s (%s)", self.session_id, s.resume_wait_s,
                      getattr(answer, "code", "no answer"))
            return False
        self.metrics.resumed("resumed", self.resume_reason)
        self.last_interaction = time.monotonic()     # the client was not idle: its session was away
        self._streaming_on(answer)
        for interaction in self.ledger.unstarted:   # what the failed group had not started yet, in order
            self.groups.post(self.mailbox, self.group_sid, interaction)
        return True
