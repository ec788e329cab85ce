"""Session limits and failures end to end, on a second Serve app beside the package's one (same Ray
cluster, route prefix /strict): API keys with per-key limits, an allowed origin, short idle and lifetime
limits, a small control queue, SP-1, restarts of stale chunks on. The app is deleted after (faults have
their own app: test_faults.py)."""
import asyncio

import pytest

from deployments.client import FramesClient, RealtimeClient
from tests.deployments.clients import H, W, png, png_url, run
from tests.deployments.conftest import PORT, TEST_SETTINGS

KEY = "test-key-1-0123456789"
KEY2 = "test-key-2-0123456789"                       # the door-limit test's tenant
KEY3 = "test-key-3-0123456789"                       # the second protocol's tenant
OWNER = "test-key-4-0123456789"                      # the keyed world's tenants: keys of their own, so the
STRANGER = "test-key-5-0123456789"                   # other tests' starts never rate-limit theirs
FAILER = "test-key-6-0123456789"                     # the tenant whose starts all fail
IMAGES_PORT = PORT + 30                   # a local image server for the allow-list
STRICT = dict(TEST_SETTINGS, sp=1, max_sessions_per_group=3, idle_timeout_s=10, max_lifetime_s=14,
              max_queued_controls=2, api_keys=f"{KEY},{KEY2},{KEY3},{OWNER},{STRANGER},{FAILER}", stall_timeout_s=60,
              restart_stale_chunks=True,
              max_sessions_per_key=2, max_starts_per_minute_per_key=8, allowed_origins="https://app.example",
              image_url_allowlist=f"http://127.0.0.1:{IMAGES_PORT}/ok/")
URL = f"ws://127.0.0.1:{PORT}/strict/v1/realtime/video"


@pytest.fixture(scope="module")
def strict_app(serve_app):
    """The strict app, and the process ids of the rank actors it added to the cluster."""
    from ray import serve

    from deployments.app import build_app

    def ranks():
        # the GCS's actor table (ray.util.state needs the dashboard, which the test cluster leaves out)
        from ray._private import state
        return {a["Pid"] for a in state.actors().values()
                if a["ActorClassName"] == "RankWorker" and a["State"] == "ALIVE"}
    before = ranks()
    serve.run(build_app(STRICT), name="strict", route_prefix="/strict")
    yield URL, ranks() - before
    serve.delete("strict")


async def endless(url=URL, api_key=KEY, **kw):
    client = RealtimeClient(url, api_key=api_key)
    await client.__aenter__()
    await client.start("a quiet street", png_url(), W, H, None, **kw)
    return client


def test_api_key_is_required(strict_app):
    import base64
    import json
    import urllib.error
    import urllib.request

    import websockets
    url, _ = strict_app

    async def scenario():
        out = {}
        for name, client in (("none", RealtimeClient(url)), ("wrong", RealtimeClient(url, api_key="nope")),
                             ("non_ascii", RealtimeClient(f"{url}?api_key=%C3%A9"))):     # was internal_error
            async with client:                            # refused at the handshake's first message
                out[name] = await client.receive_session(timeout=30)
        async with RealtimeClient(url, api_key=KEY) as client:               # Authorization: Bearer
            await client.start("p", png_url(), W, H, 1)
            out["bearer"] = await client.receive_session(timeout=120)
        async with RealtimeClient(f"{url}?api_key={KEY}") as client:         # the query string (kept)
            await client.start("p", png_url(), W, H, 1)
            out["query"] = await client.receive_session(timeout=120)
        for name, key in (("subprotocol", KEY), ("wrong_subprotocol", "nope")):   # pages: a subprotocol
            client = RealtimeClient(url)
            encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
            client.ws = await websockets.connect(url, compression=None,
                                                 subprotocols=["lingbot", f"lingbot-key.{encoded}"])
            try:
                out[f"{name}_answer"] = client.ws.subprotocol
                await client.start("p", png_url(), W, H, 1)
                out[name] = await client.receive_session(timeout=120)
            finally:
                await client.__aexit__()
        return out

    out = run(scenario())
    for name in ("none", "wrong", "non_ascii", "wrong_subprotocol"):
        assert out[name].error["code"] == "unauthorized" and out[name].close_code == 1008, name
        assert out[name].chunks == []
    for name in ("bearer", "query", "subprotocol"):
        assert out[name].error is None and out[name].done["chunks"] == 1, name
    assert out["subprotocol_answer"] == out["wrong_subprotocol_answer"] == "lingbot"
    # the HTTP descriptions that name the model path need a key too; health and version do not
    http = url.replace("ws://", "http://").replace("/v1/realtime/video", "")
    for path in ("/models", "/server_info", "/v1/models"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{http}{path}", timeout=30)
        assert refused.value.code == 401 and json.loads(refused.value.read())["error"] == "unauthorized", path
        keyed = urllib.request.Request(f"{http}{path}", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(keyed, timeout=30) as r:
            assert r.status == 200 and json.loads(r.read()), path
    for path in ("/health", "/version"):
        with urllib.request.urlopen(f"{http}{path}", timeout=30) as r:
            assert r.status == 200, path


def test_idle_and_lifetime_limits(strict_app):
    """Pings alone do not keep a session: it ends after idle_timeout_s (10 s) without interactions. A
    session that keeps interacting ends at max_lifetime_s (14 s). The two run side by side."""
    async def idle():
        client = await endless()
        try:
            async def ping_only(result, meta):
                await client.send({"type": "session.ping", "t": 0})
            return await client.receive_session(ping_only, timeout=60)
        finally:
            await client.__aexit__()

    async def busy():
        client = await endless()
        n = 0
        try:
            async def interact(result, meta):
                nonlocal n
                n += 1
                await client.interact(f"p{n}", prompt=f"a quiet street, take {n}")
            return await client.receive_session(interact, timeout=60)
        finally:
            await client.__aexit__()

    async def both():
        return await asyncio.gather(idle(), busy())

    idle_result, busy_result = run(both())
    assert idle_result.error["code"] == "idle_timeout" and idle_result.close_code == 1008
    assert "no interaction for 10 s" in idle_result.error["message"]
    assert busy_result.error["code"] == "max_lifetime" and busy_result.close_code == 1008
    assert "maximum lifetime of 14 s" in busy_result.error["message"]
    assert len(busy_result.chunks) > len(idle_result.chunks)               # it outlived the idle limit


def test_second_protocol_limits_close_normally_with_their_reason(strict_app):
    """Over /v1/realtime_video/generate: no key is refused (1008); a client that sends nothing ends at the idle
    limit and one that sends heartbeats at the lifetime limit, each closed 1000 with its reason (chunk counts are
    not compared: two sessions side by side on a slow machine may be served the same number)."""
    url = strict_app[0].replace("/v1/realtime/video", "/v1/realtime_video/generate")

    async def one(api_key, heartbeat):
        async with FramesClient(url, api_key=api_key) as client:
            await client.init("a quiet street", png(), None, 0)
            return await client.receive_session(heartbeat_interval=heartbeat, timeout=60)

    async def scenario():
        return await asyncio.gather(one(None, None), one(KEY3, None), one(KEY3, 2.0))

    nokey, quiet, beating = run(scenario())
    assert [e["code"] for e in nokey.errors] == ["unauthorized"] and nokey.close_code == 1008
    assert quiet.errors == [] and (quiet.close_code, quiet.close_reason) == (1000, "no interaction for 10 s")
    assert beating.errors == [] and beating.close_code == 1000
    assert beating.close_reason == "session reached its maximum lifetime of 14 s"
    assert len(beating.chunks) > 0 and len(quiet.chunks) > 0   # the lifetime reason: it outlived the idle limit


def test_image_urls_are_fetched_from_the_allowlist_only(strict_app):
    """With image_url_allowlist set, an http image_url (first protocol) or first_frame (second) under a
    listed prefix is fetched; any other URL is refused with invalid_image."""
    import threading
    from http.server import ThreadingHTTPServer

    from tests.deployments.ingress.image_server import Images
    server = ThreadingHTTPServer(("127.0.0.1", IMAGES_PORT), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{IMAGES_PORT}"

    async def scenario():
        async with RealtimeClient(URL, api_key=KEY3) as client:
            await client.start("p", f"{base}/ok/a.png", W, H, 1)
            fetched = await client.receive_session(timeout=120)
        async with RealtimeClient(URL, api_key=KEY3) as client:
            await client.start("p", f"{base}/private/a.png", W, H, 1)
            outside = await client.receive_session(timeout=30)
        async with FramesClient(URL.replace("/v1/realtime/video", "/v1/realtime_video/generate"),
                                api_key=KEY3) as client:
            await client.init("p", f"{base}/ok/a.png", 1, 0)
            frames = await client.receive_session(timeout=120)
        return fetched, outside, frames

    try:
        fetched, outside, frames = run(scenario())
    finally:
        server.shutdown()
    assert fetched.error is None and fetched.done["chunks"] == 1
    assert outside.error["code"] == "invalid_image" and "allow-list" in outside.error["message"]
    assert outside.close_code == 1008
    assert frames.errors == [] and len(frames.chunks) == 1 and frames.close_code == 1000


def test_too_many_controls_refuses_the_excess_and_keeps_the_session(strict_app):
    async def scenario():
        client = await endless()
        try:
            burst = True

            async def flood(result, meta):
                nonlocal burst
                if burst:                                      # at once: more than 2 wait for one boundary
                    burst = False
                    for i in range(12):
                        await client.interact(f"k{i}", keys=["w", "a", "d"])
                if len(result.chunks) == 6:
                    await client.send({"type": "session.stop"})
            return await client.receive_session(flood, timeout=120)
        finally:
            await client.__aexit__()

    result = run(scenario())
    refused = [m["event_id"] for m in result.messages if m["type"] == "error"]
    assert {m["code"] for m in result.messages if m["type"] == "error"} == {"too_many_controls"}
    started = {e for c in result.chunks for e in c["started_event_ids"]}
    assert refused and started and not (set(refused) & started)        # each event either ran or was refused
    assert set(refused) | started == {f"k{i}" for i in range(12)}
    assert result.done["stopped"] is True and len(result.chunks) >= 6


def test_restarted_chunks_show_the_frames_of_their_controls(strict_app):
    """With restart_stale_chunks a key event that lands in a chunk's probes restarts that chunk with it.
    Whether or not a chunk restarted, the stream equals the in-process pipeline with each event's keys at
    the chunk that started it (through the same H.264 encoder)."""
    import numpy as np

    from lingbot.camera import Controls
    from lingbot.io.video import read_frames
    from tests.deployments.expected_frames import in_process_frames, through_h264

    chunks = 6                                         # every landing point of the steer below, within the lifetime

    async def scenario():
        client = RealtimeClient(URL, api_key=KEY)
        await client.__aenter__()
        await client.start("a quiet street", png_url(), W, H, chunks, seed=9)
        try:
            async def steer(result, meta):
                n = len(result.chunks)
                await asyncio.sleep(0.05 * (n % 4))        # land at different points of the next chunk
                await client.interact(f"k{n}", keys=["l", "l", "i"] if n % 2 else ["j", "w", "w"])
            return await client.receive_session(steer, timeout=300)
        finally:
            await client.__aexit__()

    result = run(scenario())
    assert result.done["chunks"] == chunks
    # strict_app queues at most 2 interactions: on a loaded machine a chunk may come late and a third wait, which is
    # refused (too_many_controls) and never started; the frames below follow the events that did start
    refused = {m["event_id"] for m in result.messages if m["type"] == "error"}
    assert {m["code"] for m in result.messages if m["type"] == "error"} <= {"too_many_controls"}
    assert not refused & {e for meta in result.chunks for e in meta["started_event_ids"]}
    keys_at = {}
    for meta in result.chunks:
        for event in meta["started_event_ids"]:
            n = int(event[1:])
            keys_at[meta["generation_chunk_index"]] = ("l", "l", "i") if n % 2 else ("j", "w", "w")
    controls = [Controls(keys=keys_at.get(k)) if k in keys_at else None for k in range(chunks)]
    expected = through_h264(in_process_frames(chunks, 9, "a quiet street", controls=controls))
    assert np.abs(read_frames(result.video).astype(float) - expected).mean() < 0.25     # identical here
    assert {meta["group_clock"]["restarted"] for meta in result.chunks} <= {0.0, 1.0}   # (most restart here)


def test_per_key_limits_and_origins_at_the_door(strict_app):
    """KEY2 may hold 2 sessions and start 8 a minute: a third at once is refused (too_many_sessions, 1013,
    retry_after_s) and KEY's sessions are untouched; the ninth start within the minute is rate_limited. A page
    from an origin not allowed is refused at the handshake; the allowed one and the server's own get in."""
    import json

    import websockets

    async def scenario():
        holders = [RealtimeClient(URL, api_key=KEY2) for _ in range(2)]
        for i, c in enumerate(holders):
            await c.__aenter__()
            await c.start("p", png_url(), W, H, None, seed=i)                     # endless: they hold
            while not isinstance(await c.ws.recv(), bytes):
                pass
        async with RealtimeClient(URL, api_key=KEY2) as third:
            await third.start("p", png_url(), W, H, 1)
            refused = await third.receive_session(timeout=30)
        async with RealtimeClient(URL, api_key=KEY) as other:                  # another tenant gets in
            await other.start("p", png_url(), W, H, 1)
            other_result = await other.receive_session(timeout=120)
        for c in holders:
            await c.send({"type": "session.stop"})
            await c.receive_session(timeout=60)
            await c.__aexit__()
        quick = []                                  # 2 starts so far (the refused third does not count): 6 more, 1 over
        for i in range(7):
            async with RealtimeClient(URL, api_key=KEY2) as c:
                await c.start("p", png_url(), W, H, 1, seed=i)
                quick.append(await c.receive_session(timeout=120))
        origins = {}
        for origin in ("https://evil.example", "https://app.example", f"http://127.0.0.1:{PORT}"):
            async with websockets.connect(f"{URL}?api_key={KEY}", origin=origin) as ws:
                try:                                # a refused origin may be closed before the ping goes out
                    await ws.send(json.dumps({"type": "session.ping", "t": 1}))
                except websockets.ConnectionClosed:
                    pass
                try:
                    origins[origin] = json.loads(await asyncio.wait_for(ws.recv(), 10))
                except websockets.ConnectionClosed as e:      # the close carries the code as its reason
                    origins[origin] = {"code": e.rcvd.reason if e.rcvd else None, "close": e.rcvd and e.rcvd.code}
        return refused, other_result, quick, origins

    refused, other, quick, origins = run(scenario())
    assert refused.error["code"] == "too_many_sessions" and refused.close_code == 1013
    assert refused.error["retry_after_s"] == 5
    assert other.error is None and other.done["chunks"] == 1
    assert [q.error is None for q in quick] == [True] * 6 + [False]
    assert quick[-1].error["code"] == "rate_limited" and quick[-1].close_code == 1013
    assert 0 < quick[-1].error["retry_after_s"] <= 60
    assert origins["https://evil.example"]["code"] == "origin_not_allowed"
    assert origins["https://app.example"] == {"type": "session.pong", "t": 1}
    assert origins[f"http://127.0.0.1:{PORT}"] == {"type": "session.pong", "t": 1}


def test_starts_refused_for_what_they_hold_count_in_the_keys_start_rate(strict_app):
    """A key whose 8 starts are refused for their image (invalid_image: each decoded, or tried, at the ingress)
    has used its minute: its ninth start, a valid one, is rate_limited (1013, retry_after_s)."""
    from deployments.client.connection import image_data_url

    async def start(image_url: str):
        async with RealtimeClient(URL, api_key=FAILER) as client:
            await client.start("p", image_url, W, H, 1)
            return await client.receive_session(timeout=60)

    async def scenario():
        broken = image_data_url(b"\x89PNG\r\n\x1a\n" + bytes(64), "image/png")
        return [await start(broken) for _ in range(8)], await start(png_url())

    failed, ninth = run(scenario())
    assert [(r.error["code"], r.close_code) for r in failed] == [("invalid_image", 1008)] * 8
    assert (ninth.error["code"], ninth.close_code) == ("rate_limited", 1013), ninth.error
    assert 0 < ninth.error["retry_after_s"] <= 60 and not ninth.chunks


def test_a_keys_saved_world_is_its_own(strict_app):
    """A world saved under one key: another key cannot resume, list, fetch or delete it (answered as a world that
    never existed), nor can a client without a key; the key that saved it can. (STRANGER saves no world
    anywhere; the apps share their worlds_dir.)"""
    import json
    import urllib.error
    import urllib.request

    http = f"http://127.0.0.1:{PORT}/strict"

    def ask(method: str, path: str, key=None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{http}{path}", method=method, headers=headers),
                                        timeout=30) as r:
                return r.status if method == "DELETE" else json.loads(r.read()) if path == "/v1/worlds" else r.status
        except urllib.error.HTTPError as e:
            return e.code

    async def resume(key: str, world_id: str):
        async with RealtimeClient(URL, api_key=key) as client:
            await client.resume_world(world_id, 1)
            return await client.receive_session(timeout=120)

    async def scenario():
        async with RealtimeClient(URL, api_key=OWNER) as owner:
            await owner.start("a forest path", png_url(), W, H, None, seed=1)        # endless: stopped once saved

            async def on_chunk(result, meta):
                if len(result.chunks) == 1:
                    await owner.save()
                elif any(m["type"] == "session.saved" for m in result.messages):
                    await owner.send({"type": "session.stop"})
            saved = await owner.receive_session(on_chunk, timeout=120)
        worlds = [m for m in saved.messages if m["type"] == "session.saved"]
        assert len(worlds) == 1, (saved.error, [m for m in saved.messages if m["type"] == "error"], len(saved.chunks))
        world = worlds[0]
        return world, await resume(STRANGER, world["world_id"]), await resume(OWNER, world["world_id"])

    world, other, own = run(scenario())
    world_id = world["world_id"]
    assert (other.error["code"], other.close_code) == ("world_not_found", 1008)
    assert own.error is None and [m["generation_chunk_index"] for m in own.chunks] == [world["chunk_index"] + 1]
    assert ask("GET", "/v1/worlds", STRANGER) == {"worlds": []} and ask("GET", "/v1/worlds") == 401
    assert [w["id"] for w in ask("GET", "/v1/worlds", OWNER)["worlds"]] == [world_id]
    for key, found in ((STRANGER, 404), (OWNER, 200)):
        assert ask("GET", f"/v1/worlds/{world_id}/frame", key) == found
    assert ask("DELETE", f"/v1/worlds/{world_id}", STRANGER) == 404
    assert ask("DELETE", f"/v1/worlds/{world_id}", OWNER) == 204


def test_wrong_keys_from_one_address_are_rate_limited_and_http_routes_take_keys_from_headers_only(strict_app):
    """10 wrong keys from one address (named in X-Forwarded-For) are refused unauthorized; from then on, within the
    minute, its connections are refused rate_limited (1013, retry_after_s) before their key is compared, the right
    one's too; another address is not affected. The HTTP routes that need a key take it from a header only:
    ?api_key= there is no key (401)."""
    import json
    import urllib.error
    import urllib.request

    import websockets

    async def answer(key: str, address: str) -> dict:
        """The refusal a connection gets at once, else the pong to a ping."""
        async with websockets.connect(URL, open_timeout=30, additional_headers={
                "Authorization": f"Bearer {key}", "X-Forwarded-For": address}) as ws:
            try:
                return json.loads(await asyncio.wait_for(ws.recv(), 1))
            except asyncio.TimeoutError:
                await ws.send(json.dumps({"type": "session.ping"}))
                return json.loads(await asyncio.wait_for(ws.recv(), 30))

    async def scenario():
        wrong = [await answer(f"wrong-key-{i:08d}-guess", "198.51.100.77") for i in range(11)]
        right_but_blocked = await answer(KEY, "198.51.100.77")
        elsewhere = await answer(KEY, "198.51.100.78")
        return wrong, right_but_blocked, elsewhere

    wrong, right_but_blocked, elsewhere = run(scenario())
    assert [a["code"] for a in wrong] == ["unauthorized"] * 10 + ["rate_limited"]
    assert right_but_blocked["code"] == "rate_limited" and 0 < right_but_blocked["retry_after_s"] <= 60
    assert elsewhere["type"] == "session.pong", elsewhere
    http = f"http://127.0.0.1:{PORT}/strict/v1/models"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{http}?api_key={KEY}", timeout=30)
    assert refused.value.code == 401
    with urllib.request.urlopen(urllib.request.Request(http, headers={"Authorization": f"Bearer {KEY}"}),
                                timeout=30) as r:
        assert r.status == 200
