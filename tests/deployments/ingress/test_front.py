"""The door in Serve's proxy (deployments/ingress/front.py), on a real uvicorn server (what Serve's proxy runs) with
a real WebSocket client: beyond its bound, a WebSocket to a session route is accepted and refused server_busy in
its route's dialect, byte for byte what the ingress sends, and closed 1013; what is under the bound, other paths
and HTTP pass on untouched; a WebSocket that ends frees its place; a client gone before its refusal raises
nothing. Then its bound: from the environment, checked against the app's settings."""
import asyncio
import json
import random
from typing import ClassVar

import msgpack
import pytest
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute

from deployments.addresses import parse_networks
from deployments.ingress import front
from deployments.ingress.access import busy, too_many_connections
from deployments.ingress.closing import error_message
from deployments.ingress.front import (
    CALLBACK,
    MAX_ENV,
    RETRY_ENV,
    STALL_ENV,
    ProxyDoor,
    check_bound,
    configured_bound,
    dialect_of,
    middlewares,
    proxy_env,
    refusal_frame,
)
from deployments.ingress.pacing_door import SendQueue
from deployments.ingress.routes import SGLANG_ROUTE, VLLM_ROUTE
from deployments.local import cluster_env
from tests.waits import async_wait_until


async def _held(ws):
    """The app behind the door: accept, say "in", echo until the client closes."""
    await ws.accept(subprotocol="lingbot" if "lingbot" in ws.scope.get("subprotocols", []) else None)
    await ws.send_text("in")
    try:
        while True:
            await ws.send_text(await ws.receive_text())
    except Exception:
        pass


async def _refusing(ws):
    """An app that refuses every session (as the ingress refuses a connection without its key: close 1008) and
    returns seconds later (as Serve's proxy may, relaying the end of the replica's call after the close)."""
    await ws.accept()
    await ws.close(1008, "unauthorized")
    await asyncio.sleep(3.0)


def _app():
    sockets = [WebSocketRoute(path, _held) for path in (VLLM_ROUTE, SGLANG_ROUTE, "/app2" + VLLM_ROUTE, "/other")]
    return Starlette(routes=[*sockets, WebSocketRoute("/refusing" + VLLM_ROUTE, _refusing),
                             Route("/healthz", lambda r: PlainTextResponse("ok"))])


async def _serving(door_kwargs: dict):
    refused = []
    door = ProxyDoor(_app(), refused=refused.append, **door_kwargs)
    server = uvicorn.Server(uvicorn.Config(door, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, door, refused, f"ws://127.0.0.1:{port}"


def test_beyond_its_bound_a_session_websocket_is_refused_server_busy_in_its_dialect_and_a_place_frees():
    async def scenario():
        server, task, door, refused, base = await _serving(
            {"max_websockets": 2, "retry_after_s": 10.0, "rng": random.Random(7)})
        try:
            held = [await websockets.connect(base + VLLM_ROUTE), await websockets.connect(base + SGLANG_ROUTE)]
            assert [await ws.recv() for ws in held] == ["in", "in"]
            assert door.open == {"": 2}
            draws = random.Random(7)                                 # the door's draws, in the same order
            expected = [busy(3, 2, 10.0, draws, who="this node's door") for _ in range(2)]

            async with websockets.connect(base + VLLM_ROUTE, subprotocols=["lingbot"]) as ws:
                assert ws.subprotocol == "lingbot"                   # a page's handshake completes: it reads why
                text = await ws.recv()
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
                assert (ws.close_code, ws.close_reason) == (1013, "server_busy")
            # what VllmWire sends (Starlette's send_json of error.to_message())
            assert text == json.dumps(expected[0].to_message(), separators=(",", ":"), ensure_ascii=False)
            message = json.loads(text)
            assert message["code"] == "server_busy" and 10.0 <= message["retry_after_s"] <= 15.0
            assert message["message"].startswith("this node's door holds 2 sessions already")

            async with websockets.connect(base + SGLANG_ROUTE) as ws:
                payload = await ws.recv()
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
                assert (ws.close_code, ws.close_reason) == (1013, expected[1].message)
            assert payload == error_message(expected[1])             # what SglangWire sends
            assert msgpack.unpackb(payload, raw=False)["code"] == "server_busy"
            assert refused == ["server_busy", "server_busy"]

            async with websockets.connect(base + "/other") as ws:     # not a session route: never counted
                assert await ws.recv() == "in"
            async with websockets.connect(base + "/app2" + VLLM_ROUTE) as ws:   # another app's: counted apart
                assert await ws.recv() == "in"
                assert door.open == {"": 2, "/app2": 1}
            for _ in range(100):
                if door.open == {"": 2}:
                    break
                await asyncio.sleep(0.01)
            assert door.open == {"": 2}

            await held[0].close()                                    # a session ends: its place is free
            for _ in range(100):
                if door.open.get("") == 1:
                    break
                await asyncio.sleep(0.01)
            async with websockets.connect(base + VLLM_ROUTE) as ws:
                assert await ws.recv() == "in"
            await held[1].close()
        finally:
            server.should_exit = True
            await task
    asyncio.run(scenario())


def test_one_address_holds_its_share_of_the_door_and_a_trusted_proxy_names_the_client():
    """max_per_address 2 behind a trusted proxy (127.0.0.1): a third WebSocket of one client address is refused
    too_many_connections (1013, what the ingress sends for it) before any key is checked; another address gets
    in; a closed one frees its address's place."""
    async def scenario():
        server, task, door, refused, base = await _serving(
            {"max_websockets": 10, "retry_after_s": 10.0, "max_per_address": 2, "trusted": parse_networks("127.0.0.1")})
        try:
            def client(address):
                return websockets.connect(base + VLLM_ROUTE, additional_headers={"X-Forwarded-For": address})
            held = [await client("198.51.100.1"), await client("198.51.100.1"), await client("198.51.100.2")]
            assert [await ws.recv() for ws in held] == ["in"] * 3
            async with client("198.51.100.1") as ws:
                message = json.loads(await ws.recv())
                with pytest.raises(websockets.ConnectionClosed):
                    await ws.recv()
                assert (ws.close_code, ws.close_reason) == (1013, "too_many_connections")
            assert message == too_many_connections(2).to_message() and refused == ["too_many_connections"]
            assert door.by_address == {("", "198.51.100.1"): 2, ("", "198.51.100.2"): 1} and door.open == {"": 3}
            await held[0].close()
            await async_wait_until(lambda: door.by_address.get(("", "198.51.100.1")) == 1, 5, "the closed place freed")
            async with client("198.51.100.1") as ws:
                assert await ws.recv() == "in"
            for ws in held[1:]:
                await ws.close()
        finally:
            server.should_exit = True
            await task
    asyncio.run(scenario())


def test_a_place_is_free_at_the_apps_close_though_the_client_never_answers_it():
    """The app behind refuses a session (closes it) and returns only seconds later; the client completed the upgrade
    but never reads or answers the close. Its place is free at the app's close, not held until the app returns
    (a slow trickle of such clients could fill the door otherwise)."""
    async def scenario():
        server, task, door, _, base = await _serving({"max_websockets": 1, "retry_after_s": 10.0})
        host, port = base.removeprefix("ws://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write((f"GET /refusing{VLLM_ROUTE} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                      "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                      "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        await writer.drain()
        try:
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")    # then it reads nothing
            await async_wait_until(lambda: door.open == {}, 1.0, "the refused socket's place freed at the app's close")
            assert not writer.is_closing()                          # the client still holds its socket
            async with websockets.connect(base + VLLM_ROUTE) as ws:  # and the door's one place is free for another
                assert await ws.recv() == "in"
        finally:
            writer.close()
            server.should_exit = True
            await task
    asyncio.run(scenario())


def test_a_client_gone_before_its_refusal_raises_nothing_and_http_passes():
    """A crowd's client that gave up: the door's accept meets a disconnect, or its sends fail; nothing raises (a
    raise would be logged by the proxy as an unexpected error)."""
    async def scenario():
        calls = []

        async def app(scope, receive, send):
            calls.append(scope["type"])

        door = ProxyDoor(app, max_websockets=1, retry_after_s=1.0)
        door.open[""] = 1

        async def gone():
            return {"type": "websocket.disconnect", "code": 1006}

        async def broken(message):
            raise OSError("connection reset")

        scope = {"type": "websocket", "path": VLLM_ROUTE, "headers": [], "query_string": b""}
        await door(scope, gone, broken)

        async def connect():
            return {"type": "websocket.connect"}
        await door({**scope, "path": SGLANG_ROUTE}, connect, broken)
        await door({"type": "http", "path": VLLM_ROUTE, "headers": []}, gone, broken)   # HTTP: passed on
        assert calls == ["http"] and door.open == {"": 1}
    asyncio.run(scenario())


def test_its_refusal_is_what_the_ingress_wire_of_each_dialect_sends():
    from deployments.ingress.sglang import SglangWire
    from deployments.ingress.vllm import VllmWire
    error = busy(65, 64, 10.0, random.Random(1), who="this node's door")
    assert refusal_frame("vllm", error) == VllmWire(None, None).error_close(error)
    assert refusal_frame("sglang", error) == SglangWire(None, None).error_close(error)


def test_the_routes_it_guards():
    assert dialect_of({"type": "websocket", "path": VLLM_ROUTE}) == ("vllm", "")
    assert dialect_of({"type": "websocket", "path": "/lingbot" + SGLANG_ROUTE}) == ("sglang", "/lingbot")
    assert dialect_of({"type": "websocket", "path": "/v1/realtime"}) == (None, "")
    assert dialect_of({"type": "http", "path": VLLM_ROUTE}) == (None, "")


def test_its_bound_comes_from_the_app_settings_through_the_environment():
    env = cluster_env()
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == CALLBACK
    assert (env[MAX_ENV], env[RETRY_ENV], env[STALL_ENV]) == ("64", "10", "60")  # 64 x 1 replica; the settings
    assert env[front.STALL_BYTES_ENV] == str(64 * 2 ** 20)
    assert cluster_env({"max_ingress_sessions": 100, "max_ingress_replicas": 3, "retry_after_s": 4.5})[MAX_ENV] \
        == "300"
    assert configured_bound(env) == 64 and configured_bound({}) is None
    assert configured_bound({MAX_ENV: "64"}) is None                 # the door is not installed without the callback
    check_bound(64, 1, env)
    check_bound(1000, 4, {})                                         # no door: nothing to check
    with pytest.raises(ValueError, match=r"refuse beyond 64 WebSockets each .* = 128"):
        check_bound(64, 2, env)


def test_serves_callback_installs_the_door_from_the_environment(monkeypatch):
    monkeypatch.delenv(MAX_ENV, raising=False)
    assert middlewares() == []
    for key, value in proxy_env(80, 2.5, 12).items():
        monkeypatch.setenv(key, value)
    [door] = middlewares()
    assert door.cls is ProxyDoor and door.kwargs["max_websockets"] == 80 and door.kwargs["retry_after_s"] == 2.5
    assert door.kwargs["stall_timeout_s"] == 12.0 and door.kwargs["stall_max_bytes"] == 0    # (no bound given)
    with pytest.raises(ValueError, match="at least 1"):
        ProxyDoor(None, max_websockets=0, retry_after_s=1.0)


async def _stops_reading(door_kwargs: dict, queues: list, seconds: float = 30.0):
    """Behind a door of `door_kwargs` an app streams 64 KiB messages to a client that never reads (a small receive
    buffer, a client queue of one message, no keepalive on either side: nothing else could end it), until the app
    hears the client gone. (what the app heard, messages it sent), the door's refusals, its open places, and the
    most bytes its SendQueues (listed in `queues` as they are made) held for the client."""
    import socket
    heard, refused = [], []

    async def stream(ws):
        await ws.accept()
        gone = asyncio.Event()

        async def listen():
            heard.append(await ws.receive())
            gone.set()
        listener = asyncio.ensure_future(listen())
        sent = 0
        while not gone.is_set():
            await ws.send_bytes(bytes(65536))
            sent += 1
        await listener
        heard.append(sent)

    app = Starlette(routes=[WebSocketRoute(VLLM_ROUTE, stream)])
    door = ProxyDoor(app, max_websockets=4, retry_after_s=1.0, refused=refused.append, **door_kwargs)
    config = uvicorn.Config(door, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            ws_ping_interval=None, ws_ping_timeout=None)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        ws = await websockets.connect(f"ws://127.0.0.1:{port}{VLLM_ROUTE}", sock=sock, max_queue=1,
                                      ping_interval=None, compression=None)
        t0 = asyncio.get_running_loop().time()
        while len(heard) < 2 and asyncio.get_running_loop().time() - t0 < seconds:   # never reading
            await asyncio.sleep(0.01)
        ws.transport.abort()                                 # (a close would wait for its handshake)
        return heard, refused, door.open, max((q.peak for q in queues), default=0)
    finally:
        server.should_exit = True
        await task


class _Listed(SendQueue):
    """The door's own queue, each one made listed (the test reads how many bytes it holds)."""
    made: ClassVar[list] = []

    def __init__(self, *args):
        super().__init__(*args)
        self.peak = 0
        self.made.append(self)

    async def send(self, message) -> None:
        await super().send(message)
        self.peak = max(self.peak, self.bytes)


def test_a_client_that_stops_reading_is_cut_after_the_stall_timeout_and_the_app_hears_it_gone():
    """Once one send has been blocked for the stall timeout, the connection is cut, the app's receive says the
    client is gone (so the app stops producing), the stall is counted once, and the door's place is free."""
    heard, refused, open_, _ = asyncio.run(_stops_reading({"stall_timeout_s": 1.0}, []))
    assert heard[0]["type"] == "websocket.disconnect" and heard[1] > 0, heard
    assert refused == ["stall_timeout"] and open_ == {}


def test_a_client_that_stops_reading_is_cut_once_its_unread_bytes_reach_the_bound_long_before_the_timeout(
        monkeypatch):
    """With a stall timeout of 60 s and stall_max_bytes of 2 MiB, a client that never reads is cut once 2 MiB
    wait for it in the door (never more held), well within the 30 s the test waits: the app hears it gone, the
    stall is counted once, the place is free. (Without the bound the app's send blocked and nothing was cut for
    60 s, while a proxy's stream from the replica piled everything up behind it.)"""
    monkeypatch.setattr(front, "SendQueue", _Listed)
    heard, refused, open_, most = asyncio.run(_stops_reading({"stall_timeout_s": 60.0, "stall_max_bytes": 2 * 2 ** 20},
                                                             _Listed.made))
    assert heard and heard[0]["type"] == "websocket.disconnect", heard
    assert 2 * 2 ** 20 - 65536 < most <= 2 * 2 ** 20 and heard[1] * 65536 > 2 * 2 ** 20, (most, heard)
    assert refused == ["stall_timeout"] and open_ == {}


def test_a_reader_cancelled_while_it_waits_leaves_no_task_behind():
    """Serve's proxy cancels its reader of a connection at the end: the guard's waits go with it."""
    from deployments.ingress.front import StallGuard

    async def scenario():
        never = asyncio.Event()

        async def receive():
            await never.wait()

        async def send(message):
            pass

        guard = StallGuard(receive, send, 1.0, lambda: None)
        before = len(asyncio.all_tasks())
        reader = asyncio.ensure_future(guard.receive())
        await asyncio.sleep(0.01)
        reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.01)
        return before, len(asyncio.all_tasks())

    before, after = asyncio.run(scenario())
    assert after == before


def test_a_close_reason_is_cut_to_what_a_close_frame_carries_never_inside_a_character():
    from deployments.ingress.closing import MAX_REASON_BYTES, close_reason
    assert close_reason("too_deep") == "too_deep"
    cut = close_reason("prompt: " + "界" * 100)                   # 3 bytes a character
    assert len(cut.encode()) <= MAX_REASON_BYTES == 123 and cut == "prompt: " + "界" * 38
    assert len(close_reason("é" * 100).encode()) == 122


def test_a_doubled_slash_counts_as_the_route_it_is():
    from deployments.ingress.front import dialect_of
    assert dialect_of({"type": "websocket", "path": "//v1/realtime/video"}) == ("vllm", "")
    assert dialect_of({"type": "websocket", "path": "/app2//v1/realtime_video/generate"}) == ("sglang", "/app2")


def test_the_protections_a_cluster_started_by_hand_lacks_are_named():
    """What the ingress says is missing from the environment Ray started with (front.py, missing_protections): all
    four without it, none with deployments/local.py's, each on its own."""
    from deployments.ingress.front import PROTECTIONS, missing_protections
    from deployments.local import cluster_env
    full = cluster_env()
    assert missing_protections(full) == [] and missing_protections({}) == list(PROTECTIONS)
    assert missing_protections({**full, "FORWARDED_ALLOW_IPS": "*"}) == ["forwarded_for"]
    door = {k: v for k, v in full.items() if k != "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"}
    assert missing_protections(door) == ["door"]
