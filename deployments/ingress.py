"""Ingress: the WebSocket endpoint, health checks and the web page (CPU only).
`WS /v1/realtime/video` speaks the vLLM-Omni realtime video protocol (docs/architecture.md) plus keyboard
keys in interactions. Per connection: wait for session.start (start_timeout_s), validate it, then hold
one streaming call to a WorldGroup (the session's lease) and relay its chunks as a JSON
video.chunk_metadata + one binary fMP4 message each. Client controls go straight to the group's control
mailbox (not through Serve's routing).
Every refusal is an `error` with a stable code; the shared process never crashes on client input.
"""


import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse
from ray import serve

from lingbot.config import get_preset

from .limits import TenantLimits
from .messages import Admitted, ChunkReady, SessionDone, SessionError, SessionRequest
from .metrics import Metrics
from .protocol import (
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SERVER_ERROR,
    CLOSE_TRY_AGAIN,
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


async def _close_quietly(ws: WebSocket, message: Optional[dict], code: int, reason: str = "") -> None:
    async def close():
        if message is not None:
            await ws.send_json(message)
        await ws.close(code=code, reason=reason[:120])
    try:
        await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
    except Exception:
        pass


class Connection:
    """One client WebSocket: start, admission, the chunk pump and the control reader."""

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

    async def refuse(self, error: ProtocolError) -> None:
        self.ingress.metrics.refusals.inc(tags={"code": error.code})
        if error.close is None:
            await self.ws.send_json(error.to_message())
            return
        self.closed = True
        await _close_quietly(self.ws, error.to_message(), error.close, error.code)

    async def receive_text(self, timeout: float, limit: int) -> Optional[dict]:
        """Next client JSON message, or None on timeout. Raises ProtocolError on bad input."""
        message = await asyncio.wait_for(self.ws.receive(), timeout=timeout)
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        if message.get("bytes") is not None:
            raise ProtocolError("unsupported_message", "binary messages are not accepted from clients")
        return parse_json(message.get("text") or "", limit)

    async def next_message(self, deadline: float, limit: int) -> Optional[dict]:
        """The next client message that needs handling, read until `deadline` (monotonic; raises
        asyncio.TimeoutError after it). Pings are answered and bad messages refused here; None means a
        refusal closed the connection."""
        while True:
            try:
                msg = await self.receive_text(max(deadline - time.monotonic(), 0.001), limit)
            except ProtocolError as e:
                await self.refuse(e)
                if self.closed:
                    return None
                continue
            if msg["type"] != "session.ping":
                return msg
            await self.ws.send_json({"type": "session.pong", "t": msg.get("t")})

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
                await self.refuse(ProtocolError("start_timeout", f"no session.start within {s.start_timeout_s:g} s "
                                                "of connecting", close=CLOSE_POLICY))
                return None
            if msg is None:
                return None
            kind = msg["type"]
            if kind == "session.start":
                try:
                    return await asyncio.to_thread(parse_start, msg, self.ingress.size, self.ingress.geometry,
                                                   s.default_chunks, s.max_chunks, s.fps)
                except ProtocolError as e:
                    if e.close is None:
                        e.close = CLOSE_POLICY
                    await self.refuse(e)
                    return None
            elif kind in ("session.interaction", "session.stop"):
                await self.refuse(ProtocolError("not_started", f"{kind} before session.start"))
            else:
                await self.refuse(ProtocolError("unknown_type", f"unknown message type {kind!r}"))

    async def admit_and_stream(self, start) -> None:
        self.lease = self.ingress.group.options(stream=True).session.remote(SessionRequest(self.session_id, start))
        try:
            await self._admitted_session(start)
        finally:
            self.lease.cancel()                  # every path (done, stop, refusal, disconnect) ends the lease

    async def _admitted_session(self, start) -> None:
        s = self.settings
        try:
            first = await asyncio.wait_for(self.lease.__anext__(), timeout=s.admission_wait_s)
        except (asyncio.TimeoutError, StopAsyncIteration):
            await self.refuse(ProtocolError("capacity_exhausted", "every model group is busy; try again later",
                                            close=CLOSE_TRY_AGAIN, retry_after_s=s.retry_after_s))
            return
        if not isinstance(first, Admitted):
            close = CLOSE_TRY_AGAIN if first.code == "capacity_exhausted" else CLOSE_SERVER_ERROR
            await self.refuse(ProtocolError(first.code, first.message, close=close, retry_after_s=s.retry_after_s))
            return
        self.mailbox = first.mailbox
        self.ingress.metrics.sessions_total.inc(tags={"component": "ingress"})
        self.started_at = time.monotonic()
        geometry = self.ingress.geometry
        config = {"width": start.width, "height": start.height, "fps": start.fps, "num_frames": start.num_frames,
                  "chunks": start.chunks, "endless": start.chunks is None, "mime": first.mime,
                  "frames_per_chunk": [geometry.pixel_frames(0), geometry.pixel_frames(1)], "seed": start.seed,
                  "group": first.group}
        await self.ws.send_json({"type": "video.start", "request_id": self.session_id, "format": "m4s",
                                 "config": config})
        reader = asyncio.create_task(self.read_controls(scripted=start.trajectory is not None))
        try:
            stopped = await self.pump(reader)
        finally:
            reader.cancel()
        if stopped is not None and not self.closed:
            self.lease.cancel()
            await self.ws.send_json({"type": "session.done", "chunks": self.chunks_sent, "stopped": stopped})
            await _close_quietly(self.ws, None, CLOSE_NORMAL)

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
                if isinstance(event, ChunkReady):
                    now = time.monotonic()
                    if last is not None:
                        self.ingress.metrics.chunk_interval.observe(now - last, tags={"group": "all"})
                    last = now
                    if not await self.send_or_stall(self.ws.send_json({
                        "type": "video.chunk_metadata", "kind": "media", "generation_chunk_index": event.index,
                        "transport_chunk_index": self.chunks_sent, "num_frames": event.num_frames,
                        "byte_length": len(event.data), "started_event_ids": event.started,
                        "active_event_ids": event.active, "completed_event_ids": event.completed,
                        "timings": {k: round(v, 5) for k, v in event.timings.items()},
                        "group_clock": {k: round(v, 4) for k, v in event.clock.items()}})):
                        return None
                    if not await self.send_or_stall(self.ws.send_bytes(event.data)):
                        return None
                    self.chunks_sent += 1
                elif isinstance(event, SessionDone):
                    return False
                elif isinstance(event, SessionError):
                    if event.event_id is None:
                        await self.refuse(ProtocolError(event.code, event.message, close=CLOSE_SERVER_ERROR))
                    else:
                        await self.refuse(ProtocolError(event.code, event.message, event_id=event.event_id))
                    if self.closed:
                        return None
                next_item = asyncio.ensure_future(self.lease.__anext__())
        finally:
            next_item.cancel()

    async def send_or_stall(self, send) -> bool:
        """Await one send to the client; False (and the session ended with stall_timeout) when it stays
        blocked for stall_timeout_s: the client stopped reading, or is gone without closing. A client that
        reads but has nothing to say is never cut for its silence."""
        s = self.settings
        try:
            await asyncio.wait_for(send, s.stall_timeout_s)
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

    async def read_controls(self, scripted: bool = False) -> Optional[bool]:
        """Client messages during the session. Returns True on session.stop, None when the connection
        ends (disconnect or a timeout refusal). `scripted`: the camera follows an offline trajectory, so
        camera and key events are refused."""
        s = self.settings
        while True:
            until, _, _ = self._next_limit()
            try:
                msg = await self.next_message(until, s.max_control_bytes)
            except asyncio.TimeoutError:
                until, code, text = self._next_limit()       # an interaction may have moved the limit meanwhile
                if time.monotonic() >= until:
                    await self.refuse(ProtocolError(code, text, close=CLOSE_POLICY))
                    return None
                continue
            except WebSocketDisconnect:
                self.closed = True
                return None
            if msg is None:
                return None
            kind = msg["type"]
            if kind == "session.stop":
                return True
            elif kind == "session.interaction":
                try:
                    interaction = parse_interaction(msg)
                except ProtocolError as e:
                    await self.refuse(e)
                    continue
                if scripted and (interaction.camera is not None or interaction.keys is not None):
                    await self.refuse(ProtocolError("camera_scripted", "this session's camera follows its "
                                                    "camera_trajectory; only prompt events apply",
                                                    event_id=interaction.event_id))
                    continue
                self.last_interaction = time.monotonic()
                self.sequence += 1
                interaction.seq = self.sequence
                self.mailbox.post.remote(self.session_id, interaction)
                await self.ws.send_json({"type": "session.interaction.queued", "event_id": interaction.event_id})
            elif kind == "session.start":
                await self.refuse(ProtocolError("already_started", "this connection already has a session"))
            else:
                await self.refuse(ProtocolError("unknown_type", f"unknown message type {kind!r}"))


@serve.ingress(app)
class Ingress:
    def __init__(self, group, settings: dict):
        self.group = group
        self.settings = ServeSettings(**settings)
        preset = get_preset(self.settings.preset)
        self.size = (preset.width, preset.height)
        self.geometry = preset.geometry
        self.limits = TenantLimits(self.settings.max_sessions_per_key, self.settings.max_starts_per_minute_per_key)
        self.metrics = Metrics()
        self.live = 0

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
        await ws.accept()
        self.live += 1
        try:
            await Connection(self, ws).run()
        except WebSocketDisconnect:
            pass
        except Exception:                       # never a trace to the client, never a dead ingress
            log.exception("session failed")
            await _close_quietly(ws, {"type": "error", "code": "internal_error",
                                      "message": "internal server error"}, CLOSE_SERVER_ERROR)
        finally:
            self.live -= 1
