"""Ingress: the WebSocket endpoints, health checks and the web page (CPU only).
`WS /v1/realtime/video` speaks the vLLM-Omni realtime video protocol (docs/architecture.md) plus keyboard
keys in interactions; `WS /v1/realtime_video/generate` speaks SGLang's (MessagePack, raw or image frames),
on the same groups, admission and limits. Per connection: wait for the start (start_timeout_s), validate
it, then hold one streaming call to a WorldGroup (the session's lease) and relay its chunks (a JSON
video.chunk_metadata + one binary fMP4 message each, or frame batches + chunk_stats). Client controls go
straight to the group's control mailbox (not through Serve's routing). A session whose group fails is
resumed on another: its journal and snapshot references are kept here (docs/architecture.md, "Sessions
that survive faults").
Every refusal is an error with a stable code; the shared process never crashes on client input.
"""


import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Optional

import ray
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse
from ray import serve

from lingbot.config import get_preset
from lingbot.runtime.snapshot import chunks_to_restore

from . import sglang
from .fetch import ImageFetcher
from .limits import SnapshotKeeper, TenantLimits
from .messages import Admitted, ChunkReady, Moving, Resume, Resumed, SessionDone, SessionError, SessionRequest
from .metrics import Metrics
from .protocol import (
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SERVER_ERROR,
    CLOSE_TRY_AGAIN,
    Interaction,
    ProtocolError,
    origin_allowed,
    parse_interaction,
    parse_json,
    parse_start,
    presented_key,
)
from .settings import ServeSettings

log = logging.getLogger("ray.serve")
STATIC = Path(__file__).parent / "static"

app = FastAPI(title="lingbot-serve", docs_url=None, redoc_url=None)


CLOSE_TIMEOUT_S = 5.0                     # a clogged socket (a client that stopped reading) may never take the close


async def _close_quietly(ws: WebSocket, message, code: int, reason: str = "", send=None) -> None:
    """Send `message` (a JSON map, or bytes) or call `send`, then close; bounded in time, never raising."""
    async def close():
        if send is not None:
            await send()
        elif isinstance(message, (bytes, bytearray)):
            await ws.send_bytes(message)
        elif message is not None:
            await ws.send_json(message)
        await ws.close(code=code, reason=reason[:120])
    try:
        await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
    except Exception:
        pass


class Connection:
    """One client WebSocket, whichever protocol: start, admission, the chunk pump and the control reader.
    The wire is the subclass's: VllmConnection (JSON + fMP4), SglangConnection (MessagePack + frames)."""

    def __init__(self, ingress: "Ingress", ws: WebSocket):
        self.ingress = ingress
        self.settings = ingress.settings
        self.ws = ws
        self.session_id = uuid.uuid4().hex
        self.lease = None
        self.mailbox = None
        self.chunks_sent = 0
        self.sequence = 0
        self.last_interaction = time.monotonic()
        self.started_at = time.monotonic()
        self.closed = False
        self.scripted = False                  # the camera follows an offline trajectory: no camera or key events
        self.start = None
        # what it takes to continue the session on another group (resume): every delivered chunk's controls,
        # the interaction state after the last one, the interactions sent but not yet started
        self.journal: list = []
        self.planner = None
        self.frames_sent = 0
        self.unstarted: list[Interaction] = []
        self.resumes = 0                        # every resume (each has its own id at its group)
        self.faults = 0                         # resumes after a fault (at most max_resumes); a drain is not one
        self.resume_reason = "fault"            # why the session last moved: fault, or drain (its group stopped)
        self.failed_at: Optional[float] = None
        self.play_end: Optional[float] = None   # when the client's player runs out of the video sent (monotonic)
        self.send_lock = asyncio.Lock()         # a chunk's messages go out together (nothing between them)
        self.slots: dict[int, dict[int, object]] = {}    # chunk -> rank -> ObjectRef of its K/V slot snapshot
        self.states: dict[int, dict[int, object]] = {}   # chunk -> rank -> ObjectRef of the state after it

    # ---- the wire (subclasses) ------------------------------------------------------------------
    async def receive_message(self, timeout: float, limit: int) -> dict:
        """The next client message, decoded (ProtocolError on bad input, WebSocketDisconnect at the end)."""
        raise NotImplementedError

    async def answered(self, msg: dict) -> bool:
        """True when `msg` was a keepalive this method answered (it needs no other handling)."""
        return False

    def error_close(self, error: ProtocolError) -> tuple[Optional[object], str]:
        """(message to send before the close, or None; the close reason) for a refusal that closes."""
        raise NotImplementedError

    async def send_error(self, error: ProtocolError) -> None:
        raise NotImplementedError

    async def parse_start(self, msg: dict):
        """A StartRequest from the message (ProtocolError when it is not a valid start)."""
        raise NotImplementedError

    def limit_error(self, code: str, text: str) -> ProtocolError:
        return ProtocolError(code, text, close=CLOSE_POLICY)

    async def on_admitted(self, admitted: Admitted, start) -> None:
        pass

    async def send_resumed(self, event: Resumed, gap_s: float) -> bool:
        """Tell the client its session continues after a fault (`gap_s` since it broke)."""
        raise NotImplementedError

    async def send_chunk(self, event: ChunkReady) -> bool:
        """Put one chunk on the wire; False when the connection is over (a stalled send ended it)."""
        raise NotImplementedError

    async def on_control(self, msg: dict) -> Optional[bool]:
        """Handle one client message during the session; True means the client stopped it."""
        raise NotImplementedError

    async def finish(self, stopped: bool) -> None:
        """The session ended by itself (stopped False) or at the client's request (True)."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------
    async def refuse(self, error: ProtocolError) -> None:
        self.ingress.metrics.refusals.inc(tags={"code": error.code})
        if error.close is None:
            async with self.send_lock:
                await self.send_error(error)
            return
        self.closed = True
        message, reason = self.error_close(error)
        await _close_quietly(self.ws, message, error.close, reason)

    async def send(self, data) -> None:
        if isinstance(data, (bytes, bytearray)):
            await self.ws.send_bytes(data)
        else:
            await self.ws.send_json(data)

    async def next_message(self, deadline: float, limit: int) -> Optional[dict]:
        """The next client message that needs handling, read until `deadline` (monotonic; raises
        asyncio.TimeoutError after it). Keepalives are answered and bad messages refused here; None means a
        refusal closed the connection."""
        while True:
            try:
                msg = await self.receive_message(max(deadline - time.monotonic(), 0.001), limit)
            except ProtocolError as e:
                await self.refuse(e)
                if self.closed:
                    return None
                continue
            if not await self.answered(msg):
                return msg

    async def run(self) -> None:
        headers = dict(self.ws.headers)
        if not origin_allowed(headers, self.settings.allowed_origin_set):
            await self.refuse(ProtocolError("origin_not_allowed", f"pages from {headers.get('origin')} may not open "
                                            "sessions here (allowed_origins)", close=CLOSE_POLICY))
            return
        key = presented_key(headers, dict(self.ws.query_params), self.settings.api_key_set)
        if key is None:
            await self.refuse(ProtocolError("unauthorized", "a valid API key is required", close=CLOSE_POLICY))
            return
        tenant = f"key:{key}" if key else f"addr:{self.ws.client.host if self.ws.client else '?'}"
        start = await self.wait_for_start()
        if start is None:
            return
        refusal = self.ingress.limits.admit(tenant, time.monotonic())
        if refusal is not None:
            await self.refuse(refusal)
            return
        try:
            await self.admit_and_stream(start)
        finally:
            self.ingress.limits.release(tenant)

    async def wait_for_start(self):
        s = self.settings
        deadline = time.monotonic() + s.start_timeout_s
        while True:
            try:
                msg = await self.next_message(deadline, s.max_start_bytes)
            except asyncio.TimeoutError:
                await self.refuse(ProtocolError("start_timeout", f"no session start within {s.start_timeout_s:g} s "
                                                "of connecting", close=CLOSE_POLICY))
                return None
            if msg is None:
                return None
            try:
                return await self.parse_start(msg)
            except ProtocolError as e:
                await self.refuse(e)
                if self.closed:
                    return None

    async def admit_and_stream(self, start) -> None:
        self.start = start
        try:
            await self._admitted_session(start)
        finally:
            if self.lease is not None:
                self.lease.cancel()              # every path (done, stop, refusal, disconnect) ends the lease

    async def admit(self, request: SessionRequest, wait_s: float):
        """Hold a lease on a group for the session: the Admitted event, or the last refusal (None: no answer)
        within wait_s. A group that is full, failed or gone is tried again (Serve routes each try anew, and
        a failed group leaves at once) until the time is up."""
        deadline = time.monotonic() + wait_s
        answer = None
        while True:
            self.lease = self.ingress.group.options(stream=True).session.remote(request)
            try:
                answer = await asyncio.wait_for(self.lease.__anext__(), timeout=max(deadline - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                return answer
            except Exception as e:                        # the replica died under the call
                answer = SessionError("group_unavailable", f"the group's replica is gone ({type(e).__name__})")
            if isinstance(answer, Admitted):
                return answer
            self.lease.cancel()
            if answer.code not in ("capacity_exhausted", "group_unavailable") or time.monotonic() >= deadline:
                return answer
            await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))

    async def _admitted_session(self, start) -> None:
        s = self.settings
        first = await self.admit(SessionRequest(self.group_sid, start, keeper=await self.ingress.current_keeper()),
                                 s.admission_wait_s)
        if first is None or (isinstance(first, SessionError) and first.code == "capacity_exhausted"):
            await self.refuse(ProtocolError("capacity_exhausted", "every model group is busy; try again later",
                                            close=CLOSE_TRY_AGAIN, retry_after_s=s.retry_after_s))
            return
        if not isinstance(first, Admitted):
            close = CLOSE_TRY_AGAIN if first.code == "group_unavailable" else CLOSE_SERVER_ERROR
            await self.refuse(ProtocolError(first.code, first.message, close=close, retry_after_s=s.retry_after_s))
            return
        self.mailbox = first.mailbox
        self.ingress.metrics.sessions_total.inc(tags={"component": "ingress"})
        self.started_at = time.monotonic()
        self.scripted = start.trajectory is not None
        await self.on_admitted(first, start)
        reader = asyncio.create_task(self.read_controls())
        try:
            stopped = await self.pump(reader)
        finally:
            reader.cancel()
        if stopped is not None and not self.closed:
            self.lease.cancel()
            await self.finish(stopped)

    async def pump(self, reader: asyncio.Task) -> Optional[bool]:
        """Relay the group's chunks; returns stopped (True/False), or None when the connection is over."""
        last = None
        next_item = asyncio.ensure_future(self.lease.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({next_item, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done:
                    return reader.result()              # stop, timeout or disconnect
                try:
                    event = next_item.result()
                except StopAsyncIteration:
                    return False
                except Exception as e:                    # the group's replica is gone
                    event = SessionError("internal_error", f"the model group is gone ({type(e).__name__})")
                if isinstance(event, ChunkReady):
                    now = time.monotonic()
                    if last is not None:
                        self.ingress.metrics.chunk_interval.observe(now - last, tags={"group": "all"})
                    last = now
                    async with self.send_lock:
                        sent = await self.send_chunk(event)
                    if not sent:
                        return None
                    self.delivered(event)
                elif isinstance(event, Resumed):
                    gap = time.monotonic() - (self.failed_at or time.monotonic())
                    async with self.send_lock:
                        sent = await self.send_resumed(event, gap)
                    if not sent:
                        return None
                elif isinstance(event, SessionDone):
                    return False
                elif isinstance(event, Moving) or (isinstance(event, SessionError) and event.event_id is None):
                    drain = isinstance(event, Moving)
                    if drain:
                        self.keep_snapshots(event.snapshots)
                    else:
                        log.warning("session %s: %s: %s", self.session_id, event.code, event.message)
                    resumed = await self.resume(reader, drain)
                    if resumed is None:
                        return reader.result()
                    if not resumed:
                        code, text = ("group_unavailable", "no model group could take the session while its "
                                      "group was stopped") if drain else \
                            (event.code, "the model group failed while generating")
                        await self.refuse(ProtocolError(code, f"{text}; please retry", close=CLOSE_SERVER_ERROR))
                        return None
                    last = None
                elif isinstance(event, SessionError):
                    self.unstarted = [i for i in self.unstarted if i.event_id != event.event_id]
                    await self.refuse(ProtocolError(event.code, event.message, event_id=event.event_id))
                    if self.closed:
                        return None
                next_item = asyncio.ensure_future(self.lease.__anext__())
        finally:
            next_item.cancel()

    @property
    def group_sid(self) -> str:
        """The session's id at its group: another one per resume, so that a group that hosted it before (and
        remembers that session as ended) can take it again."""
        return self.session_id if not self.resumes else f"{self.session_id}.{self.resumes}"

    def delivered(self, event: ChunkReady) -> None:
        """A chunk reached the client: it joins the journal; the interactions it started are no longer owed."""
        self.chunks_sent += 1
        now = time.monotonic()                  # the player starts at the first chunk and waits when it runs dry
        self.play_end = max(self.play_end or now, now) + event.num_frames / self.start.fps
        self.journal.append(event.controls)
        self.planner = event.planner
        self.frames_sent += event.num_frames
        self.keep_snapshots(event.snapshots)
        if event.started:
            started = set(event.started)
            self.unstarted = [i for i in self.unstarted if i.event_id not in started]

    def keep_snapshots(self, snapshots) -> None:
        """Hold the references to the snapshots a resume would restore (the chunks the next chunk attends,
        every rank's); older ones are let go, which frees them."""
        for index, rank, slot, state in snapshots:
            self.slots.setdefault(index, {})[rank] = slot
            self.states.setdefault(index, {})[rank] = state
        newest = self.restorable()
        last = len(self.journal) - 1
        sink, window = self.ingress.window
        keep = set(chunks_to_restore(newest, sink, window)) if newest is not None else set()
        # while no set is complete (a rank's snapshot failed), still only the recent ones: memory stays bounded
        self.slots = {i: refs for i, refs in self.slots.items() if i in keep or i < sink or i > last - window}
        self.states = {i: refs for i, refs in self.states.items()
                       if i >= (newest if newest is not None else last - 2)}

    def restorable(self) -> Optional[int]:
        """The newest delivered chunk whose continuation every rank can restore from snapshots."""
        sp = self.settings.sp
        slots = {i for i, refs in self.slots.items() if len(refs) == sp}
        for index in sorted((i for i, refs in self.states.items() if len(refs) == sp and i < len(self.journal)),
                            reverse=True):
            if all(c in slots for c in chunks_to_restore(index, *self.ingress.window)):
                return index
        return None

    async def resume(self, reader: asyncio.Task, drain: bool = False) -> Optional[bool]:
        """The session's group failed (or, with `drain`, is being stopped): continue the session on a healthy
        group (another, or this one rebuilt), restored from its snapshots and the journal after them (or the
        whole journal). True when a group took it (the chunks it restores or replays are not sent again);
        False when none did; None when the client stopped or left meanwhile (`reader` ended). Faults count
        against max_resumes; drains do not (they are the operator's, not the session's)."""
        s = self.settings
        if not s.resume_sessions or self.closed or (not drain and self.faults >= s.max_resumes):
            return False
        self.resumes += 1
        self.faults += not drain
        self.resume_reason = "drain" if drain else "fault"
        self.failed_at = self.last_interaction = time.monotonic()   # the client is not idle while it waits
        self.lease.cancel()
        self.mailbox = None                          # controls sent meanwhile wait in self.unstarted
        index = self.restorable()
        refs = () if index is None else tuple(
            (tuple(self.slots[c][rank] for c in chunks_to_restore(index, *self.ingress.window)),
             self.states[index][rank]) for rank in range(s.sp))
        playback_end = None if self.play_end is None else time.time() + (self.play_end - time.monotonic())
        request = SessionRequest(self.group_sid, self.start, Resume(
            tuple(self.journal), self.planner, self.frames_sent, -1 if index is None else index, refs,
            playback_end), keeper=await self.ingress.current_keeper())
        if drain:
            log.info("session %s: its group is being stopped after %d chunks; moving it", self.session_id,
                     len(self.journal))
        else:
            log.warning("session %s: its group failed after %d chunks; resuming (%d of at most %d)",
                        self.session_id, len(self.journal), self.faults, s.max_resumes)
        admitting = asyncio.ensure_future(self.admit(request, s.resume_wait_s))
        await asyncio.wait({admitting, reader}, return_when=asyncio.FIRST_COMPLETED)
        if not admitting.done():                     # the client left or stopped: no group needed any more
            admitting.cancel()
            return None
        answer = admitting.result()
        if not isinstance(answer, Admitted):
            self.ingress.metrics.resumes.inc(tags={"outcome": "failed", "reason": self.resume_reason})
            log.error("session %s: no group took it within %g s (%s)", self.session_id, s.resume_wait_s,
                      getattr(answer, "code", "no answer"))
            return False
        self.ingress.metrics.resumes.inc(tags={"outcome": "resumed", "reason": self.resume_reason})
        self.last_interaction = time.monotonic()     # the client was not idle: its session was away
        self.mailbox = answer.mailbox
        for interaction in self.unstarted:          # what the failed group had not started yet, in order
            self.mailbox.post.remote(self.group_sid, interaction)
        return True

    async def send_or_stall(self, data) -> bool:
        """Send one message to the client; False (and the session ended with stall_timeout) when it stays
        blocked for stall_timeout_s: the client stopped reading, or is gone without closing. A client that
        reads but has nothing to say is never cut for its silence."""
        s = self.settings
        try:
            await asyncio.wait_for(self.send(data), s.stall_timeout_s)
            return True
        except asyncio.TimeoutError:
            log.warning("session %s: a send blocked for %g s; ending it", self.session_id, s.stall_timeout_s)
            await self.refuse(ProtocolError("stall_timeout", f"the client read nothing for {s.stall_timeout_s:g} s",
                                            close=CLOSE_POLICY))
            return False

    def _next_limit(self) -> tuple[float, str, str]:
        """The earliest of the session's time limits: (monotonic deadline, code, message)."""
        s = self.settings
        return min([(self.last_interaction + s.idle_timeout_s, "idle_timeout",
                     f"no interaction for {s.idle_timeout_s:g} s"),
                    (self.started_at + s.max_lifetime_s, "max_lifetime",
                     f"session reached its maximum lifetime of {s.max_lifetime_s:g} s")])

    async def read_controls(self) -> Optional[bool]:
        """Client messages during the session. Returns True when the client stopped the session, None when the
        connection ends (disconnect or a timeout refusal)."""
        s = self.settings
        while True:
            until, _, _ = self._next_limit()
            try:
                msg = await self.next_message(until, s.max_control_bytes)
            except asyncio.TimeoutError:
                until, code, text = self._next_limit()       # an interaction may have moved the limit meanwhile
                if time.monotonic() >= until:
                    await self.refuse(self.limit_error(code, text))
                    return None
                continue
            except WebSocketDisconnect:
                self.closed = True
                return None
            if msg is None:
                return None
            if await self.on_control(msg):
                return True
            if self.closed:
                return None

    async def post(self, interaction: Interaction) -> bool:
        """Send a client's interaction to its group (refused while the camera follows a path)."""
        if self.scripted and (interaction.camera is not None or interaction.keys is not None
                              or interaction.hold is not None):
            await self.refuse(ProtocolError("camera_scripted", "this session's camera follows its camera_trajectory; "
                                            "only prompt events apply", event_id=interaction.event_id))
            return False
        self.last_interaction = time.monotonic()
        self.sequence += 1
        interaction.seq = self.sequence
        self.unstarted.append(interaction)
        if self.mailbox is not None:                # None while the session resumes on another group
            self.mailbox.post.remote(self.group_sid, interaction)
        return True


class VllmConnection(Connection):
    """`/v1/realtime/video`: JSON text messages, one binary fMP4 message per chunk."""

    async def receive_message(self, timeout: float, limit: int) -> dict:
        message = await asyncio.wait_for(self.ws.receive(), timeout=timeout)
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        if message.get("bytes") is not None:
            raise ProtocolError("unsupported_message", "binary messages are not accepted from clients")
        return parse_json(message.get("text") or "", limit)

    async def answered(self, msg: dict) -> bool:
        if msg["type"] != "session.ping":
            return False
        async with self.send_lock:
            await self.ws.send_json({"type": "session.pong", "t": msg.get("t")})
        return True

    def error_close(self, error: ProtocolError):
        return error.to_message(), error.code

    async def send_error(self, error: ProtocolError) -> None:
        await self.ws.send_json(error.to_message())

    async def parse_start(self, msg: dict):
        s, kind = self.settings, msg["type"]
        if kind == "session.start":
            try:
                return await asyncio.to_thread(parse_start, msg, self.ingress.size, self.ingress.geometry,
                                               s.default_chunks, s.max_chunks, s.fps, self.ingress.fetcher)
            except ProtocolError as e:
                if e.close is None:
                    e.close = CLOSE_POLICY
                raise
        if kind in ("session.interaction", "session.stop"):
            raise ProtocolError("not_started", f"{kind} before session.start")
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}")

    async def on_admitted(self, admitted: Admitted, start) -> None:
        geometry = self.ingress.geometry
        config = {"width": start.width, "height": start.height, "fps": start.fps, "num_frames": start.num_frames,
                  "chunks": start.chunks, "endless": start.chunks is None, "mime": admitted.mime,
                  "frames_per_chunk": [geometry.pixel_frames(0), geometry.pixel_frames(1)], "seed": start.seed,
                  "group": admitted.group}
        await self.ws.send_json({"type": "video.start", "request_id": self.session_id, "format": "m4s",
                                 "config": config})

    async def send_chunk(self, event: ChunkReady) -> bool:
        meta = {"type": "video.chunk_metadata", "kind": "media", "generation_chunk_index": event.index,
                "transport_chunk_index": self.chunks_sent, "num_frames": event.num_frames,
                "byte_length": len(event.data), "started_event_ids": event.started,
                "active_event_ids": event.active, "completed_event_ids": event.completed,
                "timings": {k: round(v, 5) for k, v in event.timings.items()},
                "group_clock": {k: round(v, 4) for k, v in event.clock.items()}}
        return await self.send_or_stall(meta) and await self.send_or_stall(event.data)

    async def send_resumed(self, event: Resumed, gap_s: float) -> bool:
        return await self.send_or_stall({"type": "session.resumed", "generation_chunk_index": len(self.journal),
                                         "transport_chunk_index": self.chunks_sent, "restored_chunks": event.restored,
                                         "replayed_chunks": event.replayed, "replay_s": round(event.replay_s, 3),
                                         "gap_s": round(gap_s, 3), "reason": self.resume_reason})

    async def on_control(self, msg: dict) -> Optional[bool]:
        kind = msg["type"]
        if kind == "session.stop":
            return True
        if kind == "session.interaction":
            try:
                interaction = parse_interaction(msg)
            except ProtocolError as e:
                await self.refuse(e)
                return None
            if await self.post(interaction):
                async with self.send_lock:
                    await self.ws.send_json({"type": "session.interaction.queued", "event_id": interaction.event_id})
        elif kind == "session.start":
            await self.refuse(ProtocolError("already_started", "this connection already has a session"))
        else:
            await self.refuse(ProtocolError("unknown_type", f"unknown message type {kind!r}"))
        return None

    async def finish(self, stopped: bool) -> None:
        await self.ws.send_json({"type": "session.done", "chunks": self.chunks_sent, "stopped": stopped})
        await _close_quietly(self.ws, None, CLOSE_NORMAL)


class SglangConnection(Connection):
    """`/v1/realtime_video/generate` (SGLang's protocol): MessagePack maps in binary messages; frames raw,
    delta-gzip, WebP or JPEG in batches, then a chunk_stats map per chunk. A bad init or event gets an error
    and the connection goes on; the end of the session is the close (1000 "generation complete")."""

    def __init__(self, ingress: "Ingress", ws: WebSocket):
        super().__init__(ingress, ws)
        self.output = None
        self.event_id: Optional[int] = None      # the last client event applied, echoed with every chunk

    async def receive_message(self, timeout: float, limit: int) -> dict:
        message = await asyncio.wait_for(self.ws.receive(), timeout=timeout)
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        if message.get("bytes") is None:
            raise ProtocolError("unsupported_message", "send MessagePack maps as binary messages, not text")
        return sglang.unpack(message["bytes"], limit)

    def error_close(self, error: ProtocolError):
        if error.close == CLOSE_NORMAL:          # the session's own limits end it normally, with their reason
            return None, error.message
        return sglang.error_message(error), error.message

    async def send_error(self, error: ProtocolError) -> None:
        await self.ws.send_bytes(sglang.error_message(error))

    def limit_error(self, code: str, text: str) -> ProtocolError:
        return ProtocolError(code, text, close=CLOSE_NORMAL)

    async def parse_start(self, msg: dict):
        s = self.settings
        start = await asyncio.to_thread(sglang.parse_init, msg, self.ingress.size, self.ingress.geometry,
                                        s.max_chunks, s.fps, self.ingress.steps, self.ingress.fetcher)
        self.output = start.output
        return start

    async def send_chunk(self, event: ChunkReady) -> bool:
        t0 = time.monotonic()
        started = [int(e) for e in event.started if not e.startswith("~")]
        if started:
            self.event_id = started[-1]
        width, height = self.ingress.size
        messages = sglang.batch_messages(self.session_id, event.index, self.event_id, self.output, width, height,
                                         event.batches)
        for message in messages:
            if not await self.send_or_stall(message):
                return False
        sent = time.monotonic()
        stats = {"type": "chunk_stats", "session_id": self.session_id, "request_id": self.session_id,
                 "chunk_index": event.index, "event_id": self.event_id,
                 "request_prepare_ms": sglang.ms(event.timings.get("prepare_next_chunk", 0.0)),
                 "scheduler_forward_ms": sglang.ms(event.wall_s),
                 "raw_payload_build_ms": sglang.ms(event.timings.get("encode", 0.0)),
                 "ws_write_ms": sglang.ms(sent - t0), "chunk_total_ms": sglang.ms(event.wall_s + sent - t0),
                 "num_batches": len(messages), "num_frames": event.num_frames,
                 "raw_bytes": sum(b.raw_size for b in event.batches),
                 "ws_payload_bytes": sum(len(m) for m in messages), "content_type": self.output.content_type,
                 "actions": None if event.keys is None else [list(k) for k in event.keys]}
        return await self.send_or_stall(sglang.pack(stats))

    async def send_resumed(self, event: Resumed, gap_s: float) -> bool:
        return await self.send_or_stall(sglang.pack({
            "type": "session_resumed", "session_id": self.session_id, "chunk_index": len(self.journal),
            "restored_chunks": event.restored, "replayed_chunks": event.replayed,
            "replay_ms": sglang.ms(event.replay_s), "gap_ms": sglang.ms(gap_s), "reason": self.resume_reason}))

    async def on_control(self, msg: dict) -> Optional[bool]:
        try:
            interaction = sglang.parse_event(msg, self.sequence + 1)
        except ProtocolError as e:
            await self.refuse(e)
            return None
        if interaction is None:                  # a heartbeat: the client is here
            self.last_interaction = time.monotonic()
        else:
            await self.post(interaction)
        return None

    async def finish(self, stopped: bool) -> None:
        await _close_quietly(self.ws, None, CLOSE_NORMAL, "generation complete")


@serve.ingress(app)
class Ingress:
    def __init__(self, group, settings: dict):
        self.group = group
        self.settings = ServeSettings(**settings)
        preset = get_preset(self.settings.preset)
        self.size = (preset.width, preset.height)
        self.geometry = preset.geometry
        self.steps = len(preset.sampler.timesteps)
        self.limits = TenantLimits(self.settings.max_sessions_per_key, self.settings.max_starts_per_minute_per_key)
        self.window = (preset.transformer.sink_chunks, preset.transformer.window_chunks)
        s = self.settings
        self.fetcher = ImageFetcher.from_settings(s.image_url_allowlist, s.image_fetch_timeout_s,
                                                  s.image_fetch_max_bytes)
        # the owner of the sessions' snapshots: an actor of this replica's, so they outlive any group
        self.keeper = self._new_keeper() if self.settings.snapshots else None
        self.keeper_lock = asyncio.Lock()
        self.metrics = Metrics()
        self.live = 0

    @staticmethod
    def _new_keeper():
        """On this replica's node, not on a group's: its snapshots must outlive any group's node (this node's
        loss ends the sessions anyway: their WebSockets are here). A soft affinity was measured to land on
        another node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ray.remote(SnapshotKeeper).options(num_cpus=0, max_concurrency=16, scheduling_strategy=here).remote()

    async def current_keeper(self):
        """The snapshot keeper, started anew if it died (its snapshots are gone: those sessions replay)."""
        if self.keeper is None:
            return None
        async with self.keeper_lock:                 # one restart, however many sessions notice at once
            keeper = self.keeper
            try:
                await asyncio.wait_for(keeper.ready.remote(), 1.0)
            except asyncio.TimeoutError:
                pass                                 # busy, not dead
            except Exception as e:
                log.warning("the snapshot keeper is gone (%s); starting another", type(e).__name__)
                self.keeper = self._new_keeper()
        return self.keeper

    # ---- HTTP ---------------------------------------------------------------------------------
    @app.get("/healthz")
    def healthz(self):
        return {"status": "ok", "live_sessions": self.live}

    @app.get("/readyz")
    def readyz(self):
        try:
            status = serve.status()
            groups = [d for a in status.applications.values() for name, d in a.deployments.items()
                      if name == "WorldGroup"]
            running = sum(d.replica_states.get("RUNNING", 0) for d in groups)
        except Exception as e:
            return JSONResponse({"ready": False, "reason": f"{type(e).__name__}"}, status_code=503)
        if running < 1:
            return JSONResponse({"ready": False, "reason": "no model group is running yet"}, status_code=503)
        return {"ready": True, "groups": running}

    @app.get("/")
    def index(self):
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}")
    def static(self, name: str):
        path = (STATIC / name).resolve()
        if path.parent != STATIC.resolve() or not path.is_file():
            return JSONResponse({"error": "not found"}, status_code=404)
        return FileResponse(path)

    @app.get("/v1/config")
    def config(self):
        s = self.settings
        return {"preset": s.preset, "width": self.size[0], "height": self.size[1], "fps": s.fps, "sp": s.sp,
                "default_chunks": s.default_chunks}

    # ---- WebSocket ----------------------------------------------------------------------------
    @app.websocket("/v1/realtime/video")
    async def realtime(self, ws: WebSocket):
        await self._serve(VllmConnection, ws, lambda: ws.send_json({"type": "error", "code": "internal_error",
                                                                     "message": "internal server error"}))

    @app.websocket(sglang.ROUTE)
    async def realtime_sglang(self, ws: WebSocket):
        error = ProtocolError("internal_error", "internal server error")
        await self._serve(SglangConnection, ws, lambda: ws.send_bytes(sglang.error_message(error)))

    async def _serve(self, kind, ws: WebSocket, send_internal_error) -> None:
        await ws.accept()
        self.live += 1
        try:
            await kind(self, ws).run()
        except WebSocketDisconnect:
            pass
        except Exception:                       # never a trace to the client, never a dead ingress
            log.exception("session failed")
            await _close_quietly(ws, None, CLOSE_SERVER_ERROR, "internal_error", send_internal_error)
        finally:
            self.live -= 1
