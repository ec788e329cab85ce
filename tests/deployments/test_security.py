"""What the serving app shows to the outside, on the package's real Serve app: security headers on every HTTP
answer, and a decompression bomb on either protocol refused without the ingress's memory moving (the parsers'
own test, tests/deployments/ingress/test_parsing.py, has the refusal's details)."""
import asyncio
import base64
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import psutil

from deployments.client import FramesClient, RealtimeClient
from deployments.ingress.headers import CONTENT_SECURITY_POLICY
from tests.deployments.clients import H, W, frames_url, png_url, run
from tests.deployments.conftest import HTTP
from tests.deployments.ingress.inputs import webp_bomb
from tests.deployments.observe import live_sessions, metric, scrape, settled
from tests.waits import wait_until

HEADERS = {"content-security-policy": CONTENT_SECURITY_POLICY, "x-content-type-options": "nosniff",
           "x-frame-options": "DENY", "referrer-policy": "no-referrer"}


def answer(path: str, method="GET"):
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{HTTP}{path}", method=method), timeout=30) as r:
            return r.status, r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.headers


def test_every_http_answer_carries_the_security_headers(serve_app):
    assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY and "script-src 'self'" in CONTENT_SECURITY_POLICY
    for path, method, status in [("/", "GET", 200), ("/static/app.js", "GET", 200), ("/static/msgpack.js", "GET", 200),
                                 ("/healthz", "GET", 200), ("/readyz", "GET", 200), ("/v1/config", "GET", 200),
                                 ("/health", "GET", 200), ("/version", "GET", 200), ("/models", "GET", 200),
                                 ("/static/nope.js", "GET", 404), ("/no/such/page", "GET", 404),
                                 ("/openapi.json", "GET", 404), ("/docs", "GET", 404),     # no schema served
                                 ("/healthz", "POST", 405)]:
        got, headers = answer(path, method)
        assert got == status, (path, method)
        for name, value in HEADERS.items():
            assert headers.get_all(name) == [value], (path, name, headers.get_all(name))


def ingress_peak_kib() -> int:
    """The app's ingress replica's peak resident memory (VmHWM: the kernel's high-water mark, which a decode
    that allocated and freed still leaves raised)."""
    (proc,) = [p for p in psutil.process_iter(["cmdline"])
               if "ServeReplica:lingbot:Ingress" in " ".join(p.info["cmdline"] or [])]
    (line,) = [x for x in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if x.startswith("VmHWM:")]
    return int(line.split()[1])


def test_a_decompression_bomb_leaves_the_ingress_memory_where_it_was(serve_app):
    bomb = webp_bomb()                                       # 6300x6300: 160 MB decoded, 480 MB as float

    async def scenario():
        async with RealtimeClient(serve_app) as client:
            await client.start("p", "data:image/webp;base64," + base64.b64encode(bomb).decode(), W, H, 1)
            first = await client.receive_session(timeout=30)
        async with FramesClient(frames_url(serve_app)) as client:
            await client.init("p", bomb, 1)
            second = msgpack.unpackb(await client.ws.recv())
        return first, second

    before = ingress_peak_kib()
    first, second = run(scenario())
    assert first.error["code"] == "invalid_image" and first.close_code == 1008 and first.chunks == []
    assert "image 6300x6300 has more than 2073600 pixels" in first.error["message"]
    assert second["type"] == "error" and second["code"] == "invalid_image"
    assert "image 6300x6300 has more than 2073600 pixels" in second["content"]
    assert ingress_peak_kib() - before < 32 * 1024                 # the issue saw +1,673 MB


def test_messages_of_a_million_empty_arrays_are_refused_and_the_ingress_answers_meanwhile(serve_app):
    """The issue's four MessagePack inits of 1 MiB of empty arrays took 7-9 s to be refused and held up
    /healthz; now the decoder stops at the init's bound, a control's 2,048 containers (the first protocol's start
    at 65,536; JSON is counted before decoding)."""
    nested = b"\x82\xa4type\xa4init\xa1x\xdc" + (1000).to_bytes(2, "big") + \
        (b"\xdc" + (1000).to_bytes(2, "big") + b"\x90" * 1000) * 1000        # {type: init, x: 1000 x 1000 []}
    assert len(nested) > 10 ** 6

    async def frames(data):
        async with FramesClient(frames_url(serve_app)) as client:
            await client.ws.send(data)
            return msgpack.unpackb(await client.ws.recv())

    async def video():
        async with RealtimeClient(serve_app) as client:
            await client.ws.send("[" + ",".join(["[]"] * 2 ** 19) + "]")
            return await client.receive_session(timeout=30)

    async def scenario():
        refusals = asyncio.gather(*(frames(nested) for _ in range(4)), video())
        health = await asyncio.to_thread(answer, "/healthz")
        return await refusals, health

    (*errors, json_result), health = run(scenario())
    assert health[0] == 200
    for error in errors:
        assert (error["type"], error["code"]) == ("error", "too_complex")
        assert error["content"] == "the message holds more than 2048 arrays and maps"
    assert json_result.error["code"] == "too_complex" and json_result.close_code == 1007


async def first_answer(ws) -> dict:
    """A session.ping, then the first message back (a refusal at the handshake may have closed the connection
    before the ping went out: its error is still there to read), or {"closed": code}."""
    import json

    import websockets
    try:
        await ws.send(json.dumps({"type": "session.ping"}))
    except websockets.ConnectionClosed:
        pass
    try:
        return json.loads(await asyncio.wait_for(ws.recv(), 30))
    except websockets.ConnectionClosed as e:
        return {"closed": e.rcvd.code}


def test_a_session_through_a_host_name_not_allowed_is_refused(serve_app):
    """DNS rebinding: a page on a name that now resolves to this server sends its own name as Host (and as
    Origin, so the origin check agrees). Refused with host_not_allowed; localhost (the default allowed_hosts)
    and an IP address open sessions."""
    import socket

    import websockets

    from tests.deployments.conftest import PORT

    async def handshake(host: str, origin: bool):
        sock = socket.create_connection(("127.0.0.1", PORT))
        url = f"ws://{host}:{PORT}/v1/realtime/video"
        headers = {"Origin": f"http://{host}:{PORT}"} if origin else {}
        async with websockets.connect(url, sock=sock, additional_headers=headers, open_timeout=30) as ws:
            return await first_answer(ws)

    async def scenario():
        return [await handshake(host, origin) for host, origin in
                (("rebound.example", True), ("Rebound.Example.", False), ("localhost", True), ("127.0.0.1", False))]

    evil, evil_dotted, local, ip = run(scenario())
    assert evil["type"] == "error" and evil["code"] == "host_not_allowed", evil
    assert "rebound" not in evil["message"]                          # fixed texts: nothing of the request echoed
    assert evil_dotted["code"] == "host_not_allowed"
    assert local["type"] != "error" and ip["type"] != "error", (local, ip)


def test_one_address_holds_at_most_max_connections_per_address(serve_app):
    """16 connections from one address (started or not) by default; one more is refused with
    too_many_connections (1013, retry_after_s) at once, and once they close a new one is served. Behind a
    trusted proxy (the test app trusts 127.0.0.1) the client is the address X-Forwarded-For names, and an IPv6
    client is its /64: 17 addresses of one /64 are one client, one of another /64 is served meanwhile
    (client_address's choice of hop is tested by hand in ingress/test_access.py)."""
    import websockets

    from tests.deployments.conftest import URL

    def named(address: str) -> dict:
        return {"additional_headers": {"X-Forwarded-For": address}}

    async def scenario():
        before = await asyncio.to_thread(live_sessions)
        held = [await websockets.connect(URL, open_timeout=30, **named(f"2001:db8:1:2::{i + 1:x}")) for i in range(17)]
        try:
            answers = [await first_answer(ws) for ws in held]
            async with websockets.connect(URL, open_timeout=30, **named("2001:db8:1:3::1")) as ws:
                proxied = await first_answer(ws)
        finally:
            for ws in held:
                await ws.close()
        await asyncio.to_thread(wait_until, lambda: live_sessions() <= before, 30,
                                "the ingress to see the 17 connections closed")
        async with websockets.connect(URL, open_timeout=30, **named("2001:db8:1:2::ffff")) as ws:
            after = await first_answer(ws)
        return answers, after, proxied

    answers, after, proxied = run(scenario())
    assert proxied["type"] == "session.pong"
    refused = [a for a in answers if a.get("code") == "too_many_connections"]
    assert all(a["type"] == "session.pong" for a in answers[:15]), answers[:15]
    assert answers[-1] in refused and 1 <= len(refused) <= 2               # 2: one of an earlier test still closing
    assert refused[0]["retry_after_s"] == 5
    assert after["type"] == "session.pong"


def test_a_crowd_beyond_the_ingress_sessions_is_answered_server_busy_while_health_answers(serve_app):
    """80 WebSockets at once from 16 client addresses (behind the trusted proxy: 5 each, under the per-address
    cap), more than the ingress serves (max_ingress_sessions, 64) and more than Serve's proxy passes on (its door,
    deployments/ingress/front.py, bounded at 64 x 1 replica): the ones beyond are answered server_busy (a
    retry_after_s of 1 to 1.5 times the setting's 7 s: jitter), by the proxy's door (no Ray call) or, for a
    connection the door passed on while the ingress still held an earlier test's, by the ingress; the others
    pong, and /healthz and /v1/config answer in the middle of it. Once the crowd leaves, a new client is served."""
    import json

    import websockets

    from tests.deployments.conftest import TEST_SETTINGS, URL

    async def one(i):
        ws = await websockets.connect(URL, open_timeout=60,
                                      additional_headers={"X-Forwarded-For": f"198.51.100.{i % 16 + 1}"})
        return ws, await first_answer(ws)

    async def scenario():
        crowd = asyncio.gather(*(one(i) for i in range(80)))
        await asyncio.sleep(0.5)
        health = [await asyncio.to_thread(answer, path) for path in ("/healthz", "/v1/config")]
        held = await crowd
        try:
            return [a for _, a in held], health
        finally:
            await asyncio.gather(*(ws.close() for ws, _ in held))

    from tests.deployments.conftest import METRICS_INTERVAL_MS, METRICS_PORT

    def counted_busy() -> float:
        return metric(scrape(METRICS_PORT), "lingbot_refusals_total", code="server_busy")
    counted = settled(counted_busy, METRICS_INTERVAL_MS / 1000 + 0.5, 120,       # nothing in flight
                      "the server_busy count to settle: two exports in a row alike")
    answers, health = run(scenario())
    assert [status for status, _ in health] == [200, 200]
    busy = [a for a in answers if a.get("code") == "server_busy"]
    pongs = [a for a in answers if a.get("type") == "session.pong"]
    # (how many are busy depends on how fast the crowd arrives: a held connection that sends no start is closed
    # after start_timeout_s, 3 s here, which frees its place for a later one; perf.crowd measures it)
    print(f"crowd of 80: {len(pongs)} served, {len(busy)} server_busy")
    assert len(busy) + len(pongs) == 80 and len(busy) >= 2, json.dumps(answers[:3])
    retry = TEST_SETTINGS["retry_after_s"]
    assert all(retry <= b["retry_after_s"] <= 1.5 * retry for b in busy) and len({b["retry_after_s"] for b in busy}) > 1
    assert any(b["message"].startswith("this node's door holds 64 sessions already") for b in busy), busy[:3]

    async def after():
        """The next client once the crowd has closed: server_busy until the proxy's door and the ingress have seen
        the crowd's closes (each WebSocket ends there when its handler returns), then served."""
        interim = []
        for _ in range(40):
            async with websockets.connect(URL, open_timeout=30) as ws:
                reply = await first_answer(ws)
            if reply.get("code") != "server_busy":
                return reply, interim
            interim.append(reply)
            await asyncio.sleep(0.5)
        return None, interim
    later, interim = run(after())
    print(f"after the crowd: served after {len(interim)} server_busy answers")
    assert later is not None and later["type"] == "session.pong", (later, interim[-1:])
    # every refusal counted, the door's in the proxy's process too (Ray exports both processes' series)
    expected, deadline = counted + len(busy) + len(interim), time.monotonic() + 30
    while counted_busy() < expected and time.monotonic() < deadline:
        time.sleep(1)
    assert counted_busy() == expected


def _serve_logs() -> dict:
    """Serve's log files of this cluster (the proxy's, the controller's, every replica's) and their sizes."""
    import ray
    folder = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    return {p: p.stat().st_size for p in folder.glob("*.log")}


def _written_since(sizes: dict) -> dict:
    """The lines each of Serve's log files gained since `sizes` (_serve_logs's answer): {path: [line, ...]}."""
    written = {}
    for path in _serve_logs():
        with open(path, "rb") as f:
            f.seek(sizes.get(path, 0))
            written[path] = f.read().decode(errors="replace").splitlines()
    return written


def _websocket_ends(written: dict) -> int:
    """The WebSocket connections the proxy logged the end of in `written` (its access lines: `WS <route> <close
    code> <latency>ms`, written once a connection has closed)."""
    return sum(bool(re.search(r"\bWS \S+ \S+ [\d.]+ms", line))
               for path, lines in written.items() if path.name.startswith("proxy_") for line in lines)


def test_a_client_that_leaves_while_queued_frees_its_place_and_nothing_logs_an_error(serve_app):
    """Both places of the group held: a third client waits (told place 1) and closes its connection while it
    waits; a fourth that comes after is told place 1 (the ingress reads a waiting client, so the third's place
    went at once). Leaving a queue is normal: no ERROR line and no traceback in any of Serve's logs meanwhile,
    the proxy's included (a send to the closed connection was one), and the next client is served as usual."""
    import json

    from tests.deployments.conftest import URL

    async def queued_place(client) -> int:
        while True:
            msg = json.loads(await asyncio.wait_for(client.ws.recv(), 30))
            if msg["type"] == "session.queued":
                return msg["position"]

    async def scenario():
        async with RealtimeClient(URL) as a, RealtimeClient(URL) as b:
            for seed, client in enumerate((a, b)):
                await client.start("p", png_url(), W, H, None, seed=seed)
            for client in (a, b):
                while json.loads(await client.ws.recv())["type"] != "video.chunk_metadata":
                    pass
            logs = _serve_logs()
            third = RealtimeClient(URL)
            await third.__aenter__()
            await third.start("p", png_url(), W, H, 2, seed=3)
            first_place = await queued_place(third)
            held = await asyncio.to_thread(live_sessions)         # a, b and the third
            await third.ws.close()                                # gone while it waits
            await asyncio.to_thread(wait_until, lambda: live_sessions() < held, 30,
                                    "the ingress to let the third client go")
            async with RealtimeClient(URL) as fourth:
                await fourth.start("p", png_url(), W, H, 2, seed=4)
                second_place = await queued_place(fourth)
            for client in (a, b):
                await client.send({"type": "session.stop"})
                await client.receive_session()
        async with RealtimeClient(URL) as after:
            await after.start("p", png_url(), W, H, 1, seed=5)
            result = await after.receive_session()
        return first_place, second_place, result, logs

    first_place, second_place, result, logs = run(scenario())
    assert (first_place, second_place) == (1, 1) and result.error is None and result.done["chunks"] == 1
    # what the ingress and the proxy log of the five connections is written once the proxy logged their ends
    wait_until(lambda: _websocket_ends(_written_since(logs)) >= 5, 30,
               "the proxy's access lines of the five connections (both holders, the third, the fourth, the last)")
    written = [line for lines in _written_since(logs).values() for line in lines]
    bad = [line for line in written if " ERROR " in line or "Traceback" in line or "GeneratorExit" in line]
    assert written and not bad, "\n".join(bad[:20])
