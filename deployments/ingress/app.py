"""Ingress: the HTTP app (health, readiness, config, the web page) and the two WebSocket endpoints (CPU only).

`WS /v1/realtime/video` speaks the vLLM-Omni realtime video protocol (vllm.py) plus keyboard keys in
interactions; `WS /v1/realtime_video/generate` speaks SGLang's (sglang.py), on the same groups, admission
and limits. Per connection: the access checks (access.py), then the session's life (deployments/session/
life.py) over the dialect's wire and a `ServeGroups` link: Serve's handle to the WorldGroup deployment (the
lease), the group's control mailbox (client controls, off Serve's routing) and the snapshot keeper.
Every refusal is an error with a stable code; the shared process never crashes on client input.
"""
# no `from __future__ import annotations` here: FastAPI reads the routes' annotations (a string `WebSocket` is
# taken for a query parameter under Serve's ingress, and the handshake is refused)

import asyncio
import logging
import random
import re
import time
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from ray import serve

from lingbot.config import ConfigError

from ..addresses import limit_key, scope_address
from ..detach import outside_the_request
from ..memory import held_refs
from ..metrics import Metrics
from ..session.audience import Stage
from ..session.codes import CLOSE_POLICY, CLOSE_SERVER_ERROR, CLOSE_TRY_AGAIN, ErrorCode, ProtocolError
from ..session.events import ModelFacts, SessionRequest
from ..session.life import SessionLife
from ..session.ports import ClientGone
from ..session.recording import Recordings
from ..session.requests import Interaction
from ..session.waiting import Growth, WaitingRoom
from ..session.worlds import Worlds
from ..settings import ServeSettings
from . import peers, sglang
from .access import (
    FailedKeys,
    TenantLimits,
    accepted_subprotocol,
    beyond_loopback,
    busy,
    exposure_refusal,
    host_allowed,
    origin_allowed,
    presented_key,
    too_many_connections,
)
from .census import GroupCensus
from .fetch import ImageFetcher
from .front import PROTECTIONS, check_bound, missing_protections, proxy_host
from .headers import SecurityHeaders
from .keeper import KeeperSupervisor
from .parsing import decode_as
from .recordings import serve_recording
from .relay import Relay
from .routes import RECORDING_ROUTE, SGLANG_ROUTE, VLLM_ROUTE, WATCH_ROUTES, WORLD_ROUTE
from .vllm import VllmWire
from .watch import serve_viewer
from .worlds import answer_worlds

log = logging.getLogger("ray.serve")
SNAPSHOT_FETCH_S = 60.0      # a saved world's snapshots: fetched from the keeper, or given to it, within this
STATIC = Path(__file__).parent / "static"
STATIC_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")

app = FastAPI(title="lingbot-serve", docs_url=None, redoc_url=None, openapi_url=None)   # no schema of the routes served
app.add_middleware(SecurityHeaders)          # CSP, nosniff, frame-ancestors, Referrer-Policy on every HTTP answer


class ServeGroups:
    """The session layer's GroupLink over Ray Serve: leases through the WorldGroup handle, controls to the
    group's mailbox actor, the model facts as the groups' ranks reported them (asked once, then kept)."""

    def __init__(self, group, settings: ServeSettings):
        self.group = group
        self.settings = settings
        self.keepers = KeeperSupervisor() if settings.snapshots else None
        self.census = GroupCensus(settings.max_groups)
        self._facts: Optional[ModelFacts] = None
        self._asking: Optional[asyncio.Future] = None     # the one question to a group, shared by every caller

    async def facts(self, wait_s: Optional[float] = None) -> ModelFacts:
        """What the groups run; until a group has answered once, each caller waits at most its own `wait_s`
        (default max_queue_wait_s: a group may still be starting) for the one question in flight, which goes on
        for the next caller when this one gives up (a failed one is asked again by the next)."""
        if self._facts is not None:
            return self._facts
        wait_s = self.settings.max_queue_wait_s if wait_s is None else wait_s
        if self._asking is None or (self._asking.done() and (self._asking.cancelled() or self._asking.exception())):
            self._asking = asyncio.ensure_future(self._ask_facts())
        try:
            self._facts = await asyncio.wait_for(asyncio.shield(self._asking), wait_s)
        except Exception as e:
            raise ProtocolError(ErrorCode.GROUP_UNAVAILABLE, f"no model group answered within {wait_s:g} s "
                                f"({type(e).__name__}); retry", close=CLOSE_TRY_AGAIN,
                                retry_after_s=self.settings.retry_after_s) from None
        return self._facts

    async def _ask_facts(self) -> ModelFacts:
        return await self.group.facts.remote()

    def lease(self, request: SessionRequest):
        return self.group.options(stream=True).session.remote(request)

    def post(self, mailbox, session_id: str, interaction: Interaction) -> None:
        mailbox.post.remote(session_id, interaction)

    async def keeper(self):
        return None if self.keepers is None else await self.keepers.current()

    async def snapshots(self, keys: list[str]) -> list:
        keeper = await self.keeper()
        if keeper is None:
            raise LookupError("this ingress keeps no snapshots")
        refs = await asyncio.wait_for(keeper.lend.remote(keys), SNAPSHOT_FETCH_S)
        return list(await asyncio.wait_for(asyncio.gather(*refs), SNAPSHOT_FETCH_S))

    async def keep_snapshots(self, session_id: str, slots: list, state) -> Optional[list[str]]:
        keeper = await self.keeper()
        if keeper is None:
            return None
        return await asyncio.wait_for(keeper.keep.remote(session_id, slots, state), SNAPSHOT_FETCH_S)

    def let_go(self, session_id: str, keys=None) -> None:
        if self.keepers is not None:               # told, not awaited: a keeper that died took the snapshots along
            outside_the_request(self.keepers.keeper.release.remote, session_id, keys)

    async def growth(self) -> Growth:
        return await self.census.growth()

    def want_keyframe(self, muxer, session_id: str) -> None:
        outside_the_request(muxer.want_keyframe.remote, session_id)


class IngressMetrics:
    """The session layer's SessionMetrics on Ray's metrics."""

    def __init__(self):
        self.m = Metrics()

    def refused(self, code: str) -> None:
        self.m.refusals.inc(tags={"code": str(code)})

    def admitted(self) -> None:
        self.m.sessions_total.inc(tags={"component": "ingress"})

    def chunk_interval(self, seconds: float) -> None:
        self.m.chunk_interval.observe(seconds, tags={"group": "all"})

    def resumed(self, outcome: str, reason: str) -> None:
        self.m.resumes.inc(tags={"outcome": outcome, "reason": reason})

    def unknown_fields(self, count: int) -> None:
        self.m.unknown_fields.inc(count)

    def video_bytes(self, role: str, count: int) -> None:
        self.m.video_bytes.inc(count, tags={"role": role})

    def viewers(self, count: int) -> None:
        self.m.viewers.set(count)

    def skipped(self, count: int) -> None:
        self.m.viewer_skips.inc(count, tags={"where": "ingress"})

    def recorded(self, outcome: str, count: int) -> None:
        self.m.recordings.inc(tags={"outcome": outcome})
        if count:                                # (Ray's counters take no zero increments)
            self.m.recording_bytes.inc(count)


def check_exposure(host: Optional[str], keys: frozenset, allow_anonymous: bool) -> None:
    """ConfigError (the app does not start: Serve shows why) when Serve's proxies listen beyond this machine and the
    app has no api_keys, unless allow_anonymous; a warning in the log when it serves everyone on purpose."""
    if host is None:
        log.warning("ingress: Serve's controller did not say where its proxies listen; the api_keys check is skipped")
        return
    refusal = exposure_refusal(host, keys, allow_anonymous)
    if refusal is not None:
        raise ConfigError(refusal)
    if allow_anonymous and not keys and beyond_loopback(host):
        log.warning("ingress: serving everyone on %s without api_keys (allow_anonymous: true)", host)


def say_unprotected(missing: list[str], metrics) -> None:
    """Log (an error) and export (lingbot_proxy_protection_missing) the proxy-side protections this cluster
    started without."""
    for name in PROTECTIONS:
        metrics.unprotected.set(1 if name in missing else 0, tags={"protection": name})
    if missing:
        log.error("ingress: the Ray cluster started without lingbot-serve's environment: Serve's proxies run without "
                  "%s. Start Ray with it (cluster/README.md: `python -m deployments.local --print-env CONFIG`, or "
                  "the KubeRay manifests of cluster/render.py)", "; ".join(PROTECTIONS[n] for n in missing))


@serve.ingress(app)
class Ingress:
    def __init__(self, group, settings: dict):
        s = self.settings = ServeSettings(**settings)
        check_bound(s.max_ingress_sessions, s.max_ingress_replicas)     # the proxies' doors pass on enough
        check_exposure(proxy_host(), s.api_key_set, s.allow_anonymous)  # no open GPUs by a missing Secret
        self.unprotected = missing_protections()                        # a cluster started by hand, loudly
        self.groups = ServeGroups(group, s)
        self.limits = TenantLimits(s.tenant_session_limit, s.max_starts_per_minute_per_key)
        self.failed_keys = FailedKeys(s.max_failed_keys_per_minute)
        self.said_query_key = False
        self.fetcher = ImageFetcher.from_settings(s.image_url_allowlist, s.image_fetch_timeout_s,
                                                  s.image_fetch_max_bytes)
        self.metrics = IngressMetrics()
        say_unprotected(self.unprotected, self.metrics.m)
        self.room = WaitingRoom()                # sessions waiting for a group, in arrival order
        self.stage = Stage(s.max_viewers, Relay())   # shared sessions here by watch id; others' through the relay
        self.recordings = Recordings.from_settings(s, self.metrics)     # None: recordings_dir cannot be used
        self.worlds = Worlds.from_settings(s)                           # None: worlds_dir empty or unusable
        self.live = 0
        self.rng = random.Random()                # the jitter of server_busy's retry_after_s
        self.connections: dict[str, int] = {}    # open WebSocket connections per client address
        self.started = int(time.time())         # /v1/models's `created`
        try:                                     # the first group's start, measured for the first burst's estimate
            self.census_task = asyncio.get_running_loop().create_task(self.groups.census.follow_first_start())
        except RuntimeError:                     # constructed off an event loop: the first burst has no estimate
            self.census_task = None

    # ---- HTTP ---------------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz(self):
        # on the event loop: a plain `def` route waits for a thread of Starlette's pool, which a crowd's
        # handshakes keep busy (measured: 1.3 s at 1,000 connections against /readyz's 0.3 s)
        return {"status": "ok", "live_sessions": self.live}

    async def census(self) -> dict:
        """Not a route (a deployment handle's call: tests, `perf.soak`): the sessions this ingress serves, the
        object references it holds, and its snapshot keeper's: the references it holds, the keys the sessions
        hold and the sessions they belong to; all of a finished session's are gone."""
        keeper = await self.groups.keeper()
        kept = {} if keeper is None else await keeper.census.remote()
        return {"live_sessions": self.live, "object_refs": held_refs(), "shared_sessions": len(self.stage.audiences),
                "viewers": self.stage.viewers, "relay": self.stage.relay.census(),
                "keeper_object_refs": kept.get("object_refs"), "keeper_keys": kept.get("keys"),
                "keeper_sessions": kept.get("sessions")}

    @app.get("/readyz")
    async def readyz(self):
        # the groups as the admission sees them: Serve's controller asked at most once a second however many
        # probes come (a crowd's health checks must not queue on the controller); its last answer while it is
        # unavailable
        growth = await self.groups.census.growth()
        missing = {"unprotected": self.unprotected} if self.unprotected else {}   # (a cluster started by hand)
        if growth.running < 1:
            return JSONResponse({"ready": False, "reason": "no model group is running yet",
                                 "starting": growth.starting, **missing}, status_code=503)
        return {"ready": True, "groups": growth.running, "starting": growth.starting, **missing}

    @app.get("/")
    def index(self):
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}")
    def static(self, name: str):
        # only the page's own files: a plain name (no separators, NUL bytes or odd characters: those used to
        # reach the file system and answer 500), of a file in static/
        if not STATIC_NAME.fullmatch(name) or not (STATIC / name).is_file():
            return JSONResponse({"error": "not found"}, status_code=404)
        return FileResponse(STATIC / name)

    # the peers' descriptions (peers.py): health and version open; those that name the model path need a key
    @app.get("/health")
    async def health(self):
        """vLLM's: 200 once a group serves (its clients wait on it before their first request), else 503 (the
        groups as /readyz sees them)."""
        growth = await self.groups.census.growth()
        return Response(status_code=200 if growth.running >= 1 else 503)

    @app.get("/version")
    def version(self):
        return {"version": peers.version()}

    @app.get("/models")
    async def sglang_models(self, request: Request):
        return await self._described(request, peers.sglang_models)

    @app.get("/server_info")
    async def sglang_server_info(self, request: Request):
        return await self._described(request, peers.sglang_server_info)

    @app.get("/v1/models")
    async def openai_models(self, request: Request):
        return await self._described(request, lambda facts, s: peers.openai_models(facts, s, self.started))

    async def _described(self, request: Request, describe):
        """`describe(facts, settings)` for a client that presents a key when api_keys is set (401 otherwise); 503
        while no group has answered yet."""
        if presented_key(dict(request.headers), {}, self.settings.api_key_set) is None:     # (headers only)
            return JSONResponse({"error": ErrorCode.UNAUTHORIZED.value, "message": "a valid API key is required"},
                                status_code=401)
        try:
            facts = await self.groups.facts(wait_s=10.0)
        except ProtocolError as e:
            return JSONResponse({"error": e.code.value, "message": e.message}, status_code=503)
        return describe(facts, self.settings)

    @app.get("/v1/config")
    async def config(self):
        s = self.settings
        try:
            facts = await self.groups.facts(wait_s=10.0)
        except ProtocolError as e:
            return JSONResponse({"error": e.code.value, "message": e.message}, status_code=503)
        return {"preset": facts.preset, "width": facts.width, "height": facts.height, "fps": s.fps, "sp": s.sp,
                "default_chunks": s.default_chunks, "dtype": facts.dtype, "random_weights": facts.random_weights,
                "decoders": list(facts.decoders)}

    @app.get(RECORDING_ROUTE + "/{recording_id}")
    async def recording(self, request: Request, recording_id: str):
        return await serve_recording(self.recordings, request, recording_id, self.settings.api_key_set)

    @app.get(RECORDING_ROUTE + "/{recording_id}/journal")
    async def recording_journal(self, request: Request, recording_id: str):
        return await serve_recording(self.recordings, request, recording_id, self.settings.api_key_set, journal=True)

    @app.get(WORLD_ROUTE)
    async def worlds_list(self, request: Request):
        return await answer_worlds(self.worlds, request, self.settings.api_key_set)

    @app.get(WORLD_ROUTE + "/{world_id}/frame")
    async def world_frame(self, request: Request, world_id: str):
        return await answer_worlds(self.worlds, request, self.settings.api_key_set, world_id, "frame")

    @app.delete(WORLD_ROUTE + "/{world_id}")
    async def world_delete(self, request: Request, world_id: str):
        return await answer_worlds(self.worlds, request, self.settings.api_key_set, world_id, "delete")

    # ---- WebSocket ----------------------------------------------------------------------------
    @app.websocket(VLLM_ROUTE)
    async def realtime(self, ws: WebSocket):
        await self._serve(VllmWire(ws, self.settings, self.fetcher))

    @app.websocket(SGLANG_ROUTE)
    async def realtime_sglang(self, ws: WebSocket):
        await self._serve(sglang.SglangWire(ws, self.settings, self.fetcher))

    @app.websocket(WATCH_ROUTES["vllm"] + "/{watch_id}")
    async def watch(self, ws: WebSocket, watch_id: str):
        await self._serve(VllmWire(ws, self.settings), watch_id)

    @app.websocket(WATCH_ROUTES["sglang"] + "/{watch_id}")
    async def watch_sglang(self, ws: WebSocket, watch_id: str):
        await self._serve(sglang.SglangWire(ws, self.settings), watch_id)

    def _check_access(self, ws: WebSocket, address: str, watching: bool = False) -> tuple[Optional[ProtocolError], str]:
        """(the refusal of the access checks, or None; the tenant: the presented key, else the client's
        `address`). A viewer (`watching`) needs a key only where spectators_need_key."""
        full = busy(self.live, self.settings.max_ingress_sessions, self.settings.retry_after_s, self.rng)
        if full is not None:                     # first: shedding a crowd costs nothing else
            return full, ""
        size = sum(len(name) + len(value) + 4 for name, value in ws.headers.raw)
        if size > self.settings.max_header_bytes:
            return ProtocolError(ErrorCode.HEADERS_TOO_LARGE, f"the handshake's headers hold {size} bytes; at most "
                                 f"{self.settings.max_header_bytes} are accepted", close=CLOSE_POLICY), ""
        headers = dict(ws.headers)
        if not host_allowed(headers, self.settings.allowed_host_set):
            return ProtocolError(ErrorCode.HOST_NOT_ALLOWED, "sessions are not opened through this host name "
                                 "(allowed_hosts)", close=CLOSE_POLICY), ""
        if not origin_allowed(headers, self.settings.allowed_origin_set):
            return ProtocolError(ErrorCode.ORIGIN_NOT_ALLOWED, f"pages from {headers.get('origin')} may not open "
                                 "sessions here (allowed_origins)", close=CLOSE_POLICY), ""
        keys = self.settings.api_key_set if not watching or self.settings.spectators_need_key else frozenset()
        blocked = self.failed_keys.blocked(address, time.monotonic()) if keys else None
        if blocked is not None:                                       # guessing keys: not even compared
            return blocked, ""
        key = presented_key(headers, dict(ws.query_params), keys)
        if key is None:
            self.failed_keys.failed(address, time.monotonic())
            return ProtocolError(ErrorCode.UNAUTHORIZED, "a valid API key is required", close=CLOSE_POLICY), ""
        if key and ws.query_params.get("api_key") and not self.said_query_key:
            self.said_query_key = True                                # (once: the fallback is documented)
            log.warning("a client sent its API key in the URL (?api_key=), which proxies log; send it as "
                        "Authorization: Bearer (programs) or the page's subprotocol")
        cap = self.settings.max_connections_per_address
        if cap and self.connections.get(address, 0) > cap:           # this one counted (_serve)
            return too_many_connections(cap), ""
        return None, f"key:{key}" if key else f"addr:{address}"

    async def _serve(self, wire, watch_id: Optional[str] = None) -> None:
        """A session's connection, or a viewer's (`watch_id`: with a key only where spectators_need_key)."""
        ws = wire.ws
        await ws.accept(subprotocol=accepted_subprotocol(dict(ws.headers)))
        self.live += 1
        address = limit_key(scope_address(ws.scope, self.settings.trusted_proxy_networks))   # (IPv6: its /64)
        self.connections[address] = self.connections.get(address, 0) + 1
        decode_as(address)                       # (its first frame's decode slot: one per address)
        try:
            life = SessionLife(wire, self.groups, self.settings, self.metrics, self.room, self.stage, self.recordings,
                               self.worlds)
            refusal, tenant = self._check_access(ws, address, watching=watch_id is not None)
            if refusal is not None:
                await life.refuse(refusal)
            elif watch_id is not None:
                await serve_viewer(wire, self.stage, self.settings, watch_id, self.metrics)
            else:
                await life.run(tenant, self.limits)
        except (ClientGone, WebSocketDisconnect):      # the client left (while reading, or while we sent)
            pass
        except Exception:                       # never a trace to the client, never a dead ingress
            log.exception("session failed")
            await wire.close_with(ProtocolError(ErrorCode.INTERNAL_ERROR, "internal server error",
                                                close=CLOSE_SERVER_ERROR))
        finally:
            self.live -= 1
            self.connections[address] -= 1
            if not self.connections[address]:
                del self.connections[address]
