"""The door in Serve's proxy: a crowd of WebSockets refused where it arrives, before Serve routes it.

Every connection Serve's proxy routes costs the proxy and the ingress replica Ray calls (the routing, the ASGI
messages both ways): about 8 ms of CPU each on a 2-core machine, so a crowd of 1,000 kept both event loops, and
every health check behind them, busy for seconds while almost all of it was refused anyway (server_busy). Serve
lets a list of ASGI middlewares wrap its proxy's app (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read when the
proxy starts); `middlewares()` is that callback. Its `ProxyDoor` counts the WebSockets of the two session routes
it has passed on and not seen end, per route prefix (each app its own), and refuses one more beyond
`max_websockets` itself, in the dialect of its route: accepted, then `server_busy` (close 1013, a
`retry_after_s` of 1 to 1.5 times the setting), then closed, with no Ray call. One client address holds at most
`max_per_address` of them (the ingress's max_connections_per_address, the address read as the ingress reads it:
behind trusted_proxies, from X-Forwarded-For): one more is refused too_many_connections the same way, so one
address cannot fill the door before any key is checked. A place is freed as soon as the app behind closes the
WebSocket (its refusal, or the session's end), not once the client has answered the close: a client that
never does cannot hold it. Everything else (HTTP, the health routes) passes untouched.

Its bound is the most WebSockets the app's ingress replicas hold together (max_ingress_sessions x
max_ingress_replicas), so it refuses only what the ingress would certainly refuse: the WebSockets one proxy has
passed on are some of those the replicas hold. With several proxies (one per node) each counts its own, and the
ingress's own bound (access.busy) refuses the rest. The bound reaches the proxy through the environment Ray's
processes start with (deployments/local.py `cluster_env`, cluster/render.py), as the setting's product; the
ingress refuses to start when its settings need more than the proxies pass on (`check_bound`).

It also keeps `stall_timeout_s` for the WebSockets it passes on. Behind Serve's proxy the ingress's sends never
block (the proxy takes every message, and Ray's stream from the replica buffers what the proxy has not sent), so
the ingress cannot see a client that stopped reading; the proxy's own send does block (uvicorn waits while the
socket's buffer is full). `StallGuard` bounds that wait: a send still blocked after stall_timeout_s cuts the
connection (the transport aborted; the app hears the client gone), so the session ends and the video stops
piling up in the proxy (without it, a client that never read an endless raw-frames session was not let go
within 90 s, its video held in the proxy). Time alone let a session pile up stall_timeout_s of video in the
proxy (about 1 GB of raw frames at 60 s), so a session's sends are also queued here and bounded in bytes
(`stall_max_bytes`, pacing_door.SendQueue): past it the connection is cut the same way, whatever the time.

Light on purpose: the proxy imports it (no torch, no dialect, no Ray at import)."""
from __future__ import annotations

import asyncio
import os
import random
import re
from collections.abc import Callable
from typing import Optional

from starlette.middleware import Middleware
from starlette.websockets import WebSocket

from ..addresses import limit_key, parse_networks, scope_address
from .access import accepted_subprotocol, busy, too_many_connections
from .closing import CLOSE_TIMEOUT_S, close_quietly, error_message
from .pacing_door import PacerLimits, SendQueue, ViewerPacer
from .routes import SGLANG_ROUTE, VLLM_ROUTE, WATCH_ROUTES

CALLBACK = "deployments.ingress.front.middlewares"       # RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
MAX_ENV = "LINGBOT_PROXY_MAX_WEBSOCKETS"
RETRY_ENV = "LINGBOT_PROXY_RETRY_AFTER_S"
STALL_ENV = "LINGBOT_PROXY_STALL_TIMEOUT_S"
STALL_BYTES_ENV = "LINGBOT_PROXY_STALL_MAX_BYTES"
PER_ADDRESS_ENV = "LINGBOT_PROXY_MAX_PER_ADDRESS"
TRUSTED_ENV = "LINGBOT_PROXY_TRUSTED_PROXIES"
VIEWER_ENV = "LINGBOT_PROXY_VIEWER_QUEUE"                  # chunks,bytes,skips (pacing_door.PacerLimits)
GONE = {"type": "websocket.disconnect", "code": 1006}      # what the app hears of a connection the guard cut
DIALECTS = ((VLLM_ROUTE, "vllm"), (SGLANG_ROUTE, "sglang"))
WATCHES = re.compile("(.*)(" + "|".join(f"(?:{re.escape(r)})" for r in WATCH_ROUTES.values()) + ")/[^/]+")


def proxy_env(max_websockets: int, retry_after_s: float, stall_timeout_s: float, max_per_address: int = 0,
              trusted_proxies: str = "", viewers: Optional[PacerLimits] = None, stall_max_bytes: int = 0) -> dict:
    """The environment that installs the door in every proxy Ray starts (workers inherit it)."""
    return {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": CALLBACK, MAX_ENV: str(int(max_websockets)),
            RETRY_ENV: f"{float(retry_after_s):g}", STALL_ENV: f"{float(stall_timeout_s):g}",
            STALL_BYTES_ENV: str(int(stall_max_bytes)),
            PER_ADDRESS_ENV: str(int(max_per_address)), TRUSTED_ENV: trusted_proxies,
            VIEWER_ENV: (viewers or PacerLimits()).to_env()}


def configured_bound(environ=os.environ) -> Optional[int]:
    """The proxies' bound as this process's environment sets it; None when the door is not installed."""
    if environ.get("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH") != CALLBACK or MAX_ENV not in environ:
        return None
    return int(environ[MAX_ENV])


# what a Ray started without deployments/local.py's environment (cluster/render.py's, the by-hand commands') lacks
PROTECTIONS = {
    "door": "the door in Serve's proxy (a crowd refused where it arrives, per-address bounds, viewers' queues)",
    "stall_guard": "the proxy's stall guard (a client that stops reading is cut after stall_timeout_s, or once "
                   "stall_max_bytes wait for it)",
    "forwarded_for": "FORWARDED_ALLOW_IPS empty (the proxy would take X-Forwarded-For from any local connection)",
    "header_limit": "WEBSOCKETS_MAX_LINE_LENGTH (a handshake's long header line would go unanswered)",
}


def missing_protections(environ=os.environ) -> list[str]:
    """The proxy-side protections the environment Ray started with lacks (PROTECTIONS' names): the proxies and this
    process inherit one environment, so what is missing here is missing there."""
    present = {"door": configured_bound(environ) is not None,
               "stall_guard": {STALL_ENV, STALL_BYTES_ENV} <= set(environ),
               "forwarded_for": environ.get("FORWARDED_ALLOW_IPS") == "",
               "header_limit": "WEBSOCKETS_MAX_LINE_LENGTH" in environ}
    return [name for name in PROTECTIONS if not present[name]]


def check_bound(max_ingress_sessions: int, max_ingress_replicas: int, environ=os.environ) -> None:
    """ValueError when the proxies would refuse WebSockets the ingress replicas have room for (the app's settings
    changed, the cluster's environment did not)."""
    bound, need = configured_bound(environ), max_ingress_sessions * max_ingress_replicas
    if bound is not None and bound < need:
        raise ValueError(f"Serve's proxies refuse beyond {bound} WebSockets each ({MAX_ENV}), fewer than the "
                          f"ingress replicas hold (max_ingress_sessions x max_ingress_replicas = {need}); start Ray "
                          "with the environment of this config (deployments/local.py, cluster/render.py)")


def proxy_host() -> Optional[str]:
    """The address Serve's proxies listen on (its http_options.host), from Serve's controller; None when the
    controller cannot say (not under Serve, or it does not answer within 30 s)."""
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=30).host
    except Exception:
        return None


def is_watch(scope) -> bool:
    """Whether `scope` is a WebSocket to a viewer's route."""
    return scope.get("type") == "websocket" and WATCHES.fullmatch(re.sub("/+", "/", scope.get("path", ""))) is not None


def dialect_of(scope) -> tuple[Optional[str], str]:
    """("vllm" or "sglang", the app's route prefix) for a WebSocket to a session or watch route (under any route
    prefix), else (None, "")."""
    if scope.get("type") != "websocket":
        return None, ""
    path = re.sub("/+", "/", scope.get("path", ""))      # //v1/realtime/video is the app's own route, counted so
    watch = WATCHES.fullmatch(path)
    if watch is not None:
        return next(name for name, route in WATCH_ROUTES.items() if route == watch.group(2)), watch.group(1)
    return next(((name, path[:-len(route)]) for route, name in DIALECTS if path.endswith(route)), (None, ""))


class ProxyDoor:
    """Pure ASGI middleware (see the module's docstring). `refused(code)` is told each refusal (the metric)."""

    def __init__(self, app, max_websockets: int, retry_after_s: float, stall_timeout_s: Optional[float] = None,
                 refused: Optional[Callable[[str], None]] = None, rng: Optional[random.Random] = None,
                 max_per_address: int = 0, trusted: tuple = (), viewers: Optional[PacerLimits] = None,
                 skipped: Optional[Callable[[], None]] = None, stall_max_bytes: int = 0):
        if max_websockets < 1:
            raise ValueError(f"{MAX_ENV} must be at least 1, got {max_websockets}")
        self.app, self.max_websockets, self.retry_after_s = app, max_websockets, retry_after_s
        self.stall_timeout_s = stall_timeout_s         # None: sends are not bounded here
        self.stall_max_bytes = stall_max_bytes         # a session's bytes queued here, at most (0: its sends wait)
        self.max_per_address, self.trusted = max_per_address, trusted      # 0: no bound per address
        self.viewers = viewers                          # a viewer's queue here (pacing_door.py); None: none
        self.skipped = skipped or (lambda: None)        # told each viewer's skip (the metric)
        self.refused = refused or (lambda code: None)
        self.rng = rng or random.Random()
        self.open: dict[str, int] = {}          # route prefix (an app) -> its WebSockets passed on, not closed
        self.by_address: dict[tuple[str, str], int] = {}    # (route prefix, client address) -> the same

    async def __call__(self, scope, receive, send):
        dialect, prefix = dialect_of(scope)
        if dialect is None:
            return await self.app(scope, receive, send)
        place = (prefix, limit_key(scope_address(scope, self.trusted)))          # (IPv6: its /64)
        error = busy(self.open.get(prefix, 0) + 1, self.max_websockets, self.retry_after_s, self.rng,
                     who="this node's door")
        if error is None and self.max_per_address and self.by_address.get(place, 0) >= self.max_per_address:
            error = too_many_connections(self.max_per_address)
        if error is not None:
            self.refused(error.code.value)
            return await refuse(WebSocket(scope, receive, send), dialect, error)
        free = self._take(place)

        def freeing(send_on):                          # the app's close frees the place: the handshake may hang
            async def send_freeing(message):
                if message.get("type") == "websocket.close":
                    free()
                await send_on(message)
            return send_freeing
        queue = None
        try:
            if self.stall_timeout_s is None:
                await self.app(scope, receive, freeing(send))
                return
            guard = StallGuard(receive, send, self.stall_timeout_s, lambda: self.refused("stall_timeout"))

            def cut(code: str) -> Callable[[], None]:  # a queue's cut: counted, then the connection cut
                def cutting() -> None:
                    self.refused(code)
                    guard.abort()
                return cutting
            if self.viewers is not None and is_watch(scope):
                queue = ViewerPacer(guard.send, self.viewers, cut("viewer_too_slow"), self.skipped)
            elif self.stall_max_bytes:                 # not reading: as a stall, before its time is up
                queue = SendQueue(guard.send, self.stall_max_bytes, cut("stall_timeout"))
            await self.app(scope, guard.receive, freeing(guard.send if queue is None else queue.send))
            if queue is not None:
                await queue.finish(self.stall_timeout_s)    # what is still queued: the last chunks, the end, the close
        finally:
            if queue is not None:
                queue.close()
            free()

    def _take(self, place: tuple[str, str]) -> Callable[[], None]:
        """Count a passed-on WebSocket at `place`; returns what frees it (once, however often it is called)."""
        held = ((self.open, place[0]), (self.by_address, place))
        for counts, key in held:
            counts[key] = counts.get(key, 0) + 1
        taken = True

        def free() -> None:
            nonlocal taken
            if taken:
                taken = False
                for counts, key in held:
                    counts[key] -= 1
                    if not counts[key]:
                        del counts[key]
        return free


class StallGuard:
    """One passed-on WebSocket's send bounded in time (see the module's docstring). A send still blocked after
    `timeout_s` (the client stopped reading: its socket's buffers are full) cuts the connection: uvicorn's
    transport aborted (the `receive` it hands the app is its protocol's own method), which also tells the app
    the client is gone; where the server is another, the app's next receive says so itself. `stalled()` is told
    once; later sends are dropped (nobody reads them)."""

    def __init__(self, receive, send, timeout_s: float, stalled: Callable[[], None]):
        self._receive, self._send, self.timeout_s, self.stalled = receive, send, timeout_s, stalled
        self.cut = asyncio.Event()

    async def send(self, message) -> None:
        if self.cut.is_set():
            await asyncio.sleep(0)                   # dropped, but a turn for the others (a sender in a loop)
            return
        try:
            await asyncio.wait_for(self._send(message), self.timeout_s)
        except asyncio.TimeoutError:
            self.stalled()
            self.abort()

    def abort(self) -> None:
        """Cut the connection (the app hears the client gone; later sends are dropped)."""
        self.cut.set()
        transport = getattr(getattr(self._receive, "__self__", None), "transport", None)
        if transport is not None:
            transport.abort()

    async def receive(self):
        if self.cut.is_set():
            return GONE
        message = asyncio.ensure_future(self._receive())
        cut = asyncio.ensure_future(self.cut.wait())
        try:
            await asyncio.wait((message, cut), return_when=asyncio.FIRST_COMPLETED)
        finally:                                     # (cancelled too: Serve's proxy cancels its reader at the end)
            cut.cancel()
            if not message.done():
                message.cancel()
        return message.result() if message.done() and not message.cancelled() else GONE


async def refuse(ws: WebSocket, dialect: str, error) -> None:
    """Accept (a browser reads no HTTP refusal of an upgrade), send `error` as `dialect` sends it, close; never
    raising, never logging: a client that left meanwhile is normal."""
    try:
        await asyncio.wait_for(ws.accept(subprotocol=accepted_subprotocol(dict(ws.headers))), CLOSE_TIMEOUT_S)
    except Exception:
        return
    message, reason = refusal_frame(dialect, error)
    await close_quietly(ws, message, error.close, reason)


def refusal_frame(dialect: str, error) -> tuple:
    """(the message sent before the close, the close's reason) of a refusal that closes, as the ingress's wire of
    `dialect` says it (VllmWire.error_close, SglangWire.error_close: a test keeps them equal)."""
    if dialect == "vllm":
        return error.to_message(), error.code.value
    return error_message(error), error.message


def _ray_skips() -> Callable[[], None]:
    from ..metrics import viewer_skips_counter
    counter = viewer_skips_counter()
    return lambda: counter.inc(tags={"where": "door"})


def _ray_refusals() -> Callable[[str], None]:
    from ..metrics import refusals_counter
    counter = refusals_counter()
    return lambda code: counter.inc(tags={"code": code})


def middlewares() -> list:
    """Serve's proxy callback: the door, with its bound from the environment (none without MAX_ENV)."""
    if MAX_ENV not in os.environ:
        return []
    stall = os.environ.get(STALL_ENV)
    return [Middleware(ProxyDoor, max_websockets=int(os.environ[MAX_ENV]),
                       retry_after_s=float(os.environ.get(RETRY_ENV, "10")),
                       stall_timeout_s=None if stall is None else float(stall), refused=_ray_refusals(),
                       stall_max_bytes=int(os.environ.get(STALL_BYTES_ENV, "0")),
                       max_per_address=int(os.environ.get(PER_ADDRESS_ENV, "0")),
                       trusted=parse_networks(os.environ.get(TRUSTED_ENV, "")),
                       viewers=PacerLimits.from_env(os.environ[VIEWER_ENV]) if os.environ.get(VIEWER_ENV) else None,
                       skipped=_ray_skips())]
