"""The Ray Serve application end to end: a real Serve app, real WebSocket clients (websockets)."""
import asyncio
import base64
import io
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import websockets
from PIL import Image

from deployments.client import RealtimeClient, image_data_url
from lingbot.config import LINGBOT_GEOMETRY
from lingbot.io.video import read_frames
from tests.deployments.conftest import HTTP

W, H = 112, 64


def png_url(seed=0) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (80, 140, 3), dtype=np.uint8)).save(buf, "PNG")
    return image_data_url(buf.getvalue(), "image/png")


def run(coro):
    return asyncio.run(coro)


async def session(url, chunks, seed=0, script=None, on_chunk=None, prompt="a forest path", **extra):
    async with RealtimeClient(url) as client:
        await client.start(prompt, png_url(), W, H, chunks, seed=seed, script=script, **extra)

        async def hook(result, meta):
            if on_chunk is not None:
                await on_chunk(client, result, meta)
        return await client.receive_session(hook)


def chunk_frames(result):
    """Decoded frames split by chunk."""
    frames = read_frames(result.video)
    out, start = [], 0
    for meta in result.chunks:
        out.append(frames[start:start + meta["num_frames"]])
        start += meta["num_frames"]
    assert start == len(frames)
    return out


def test_session_of_n_chunks(serve_app):
    result = run(session(serve_app, 3))
    assert result.error is None, result.error
    assert result.start["type"] == "video.start" and result.start["format"] == "m4s"
    assert result.start["config"]["mime"].startswith('video/mp4; codecs="avc1.')
    assert [c["generation_chunk_index"] for c in result.chunks] == [0, 1, 2]
    assert [c["transport_chunk_index"] for c in result.chunks] == [0, 1, 2]
    assert [c["num_frames"] for c in result.chunks] == [9, 12, 12]
    assert [c["byte_length"] for c in result.chunks] == [len(d) for d in result.data]
    assert [c["denoising_steps"] for c in result.chunks] == [None] * 3      # the ladder is off: all steps
    assert [c["quality"] for c in result.chunks] == ["full"] * 3
    assert result.done == {"type": "session.done", "chunks": 3, "stopped": False}
    frames = read_frames(result.video)
    assert frames.shape == (12 * 3 - 3, H, W, 3)
    assert result.close_code == 1000


def test_interaction_changes_frames_from_its_chunk_and_runs_repeat(serve_app):
    plain = run(session(serve_app, 4, seed=5))

    async def steer(client, result, meta):
        if meta["generation_chunk_index"] == 0:
            await client.interact("turn-1", keys=["l", "l", "l"])

    steered = run(session(serve_app, 4, seed=5, on_chunk=steer))
    assert steered.error is None
    assert any(m["type"] == "session.interaction.queued" and m["event_id"] == "turn-1" for m in steered.messages)
    starts = [c["generation_chunk_index"] for c in steered.chunks if "turn-1" in c["started_event_ids"]]
    assert len(starts) == 1 and starts[0] >= 1
    k = starts[0]
    assert "turn-1" in steered.chunks[k]["active_event_ids"] and "turn-1" in steered.chunks[k]["completed_event_ids"]
    a, b = chunk_frames(plain), chunk_frames(steered)
    for i in range(k):
        assert np.array_equal(a[i], b[i]), f"chunk {i} changed before the interaction started"
    for i in range(k, 4):
        assert np.abs(a[i].astype(int) - b[i].astype(int)).mean() > 1.0, f"chunk {i} did not change"
    # the same seed and the same controls give the same frames
    script = [["w", "w", "wa"], ["", "l", "l"], ["i", "", ""]]
    first = run(session(serve_app, 3, seed=9, script=script))
    second = run(session(serve_app, 3, seed=9, script=script))
    assert np.array_equal(read_frames(first.video), read_frames(second.video))
    assert not np.array_equal(read_frames(first.video), read_frames(run(session(serve_app, 3, seed=9)).video))


def test_two_sessions_capacity_and_release(serve_app):
    async def scenario():
        # two endless sessions hold both slots until the third client has been refused (no race with their end)
        async with RealtimeClient(serve_app) as a, RealtimeClient(serve_app) as b:
            for seed, client in enumerate((a, b)):
                await client.start("p", png_url(), W, H, None, seed=seed)
            for client in (a, b):                                 # both admitted and streaming
                while json.loads(await client.ws.recv())["type"] != "video.chunk_metadata":
                    pass
            # a third client finds both slots taken: refused after admission_wait_s with 1013
            refused = await session(serve_app, 2, seed=3)
            results = []
            for client in (a, b):
                await client.send({"type": "session.stop"})
                results.append(await client.receive_session())
        return refused, results

    refused, results = run(scenario())
    assert refused.error["code"] == "capacity_exhausted" and refused.error["retry_after_s"] == 7
    assert refused.close_code == 1013
    # while it waited it was told its place (the only one waiting), once: nothing changed meanwhile
    assert [m for m in refused.messages if m["type"] == "session.queued"] == \
        [{"type": "session.queued", "position": 1, "eta_s": None}]
    for r in results:                                         # the holders were untouched by the refusal
        assert r.error is None and r.done["stopped"] is True and r.done["chunks"] >= 1

    async def disconnect_then_admit():
        async with RealtimeClient(serve_app) as a, RealtimeClient(serve_app) as b:
            await a.start("a", png_url(), W, H, None)            # endless
            await b.start("b", png_url(), W, H, None)
            for c in (a, b):
                while json.loads(await c.ws.recv())["type"] != "video.chunk_metadata":
                    pass
            await a.ws.close()                                    # client gone mid-session
            await asyncio.sleep(1.0)
            admitted = await session(serve_app, 2, seed=4)
            await b.send({"type": "session.stop"})
            rest = await b.receive_session()
            return admitted, rest

    admitted, rest = run(disconnect_then_admit())
    assert admitted.error is None and admitted.done["chunks"] == 2
    assert rest.done is not None and rest.done["stopped"] is True


async def expect_error(url, messages, code, close=None, raw=None):
    async with RealtimeClient(url) as client:
        for m in messages:
            await client.ws.send(m if isinstance(m, (str, bytes)) else json.dumps(m))
        while True:
            msg = json.loads(await asyncio.wait_for(client.ws.recv(), 20))
            if msg["type"] == "error":
                break
        assert msg["code"] == code, msg
        assert msg["message"] and "Traceback" not in msg["message"]
        if close is not None:
            try:
                await asyncio.wait_for(client.ws.recv(), 10)
                raise AssertionError("connection stayed open")
            except Exception as e:
                assert getattr(getattr(e, "rcvd", None), "code", None) == close, e
        return msg


def start_msg(**overrides):
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": png_url()}, "width": W,
           "height": H, "num_frames": LINGBOT_GEOMETRY.video_frames(2), "seed": 0}
    msg.update(overrides)
    return msg


def test_bad_input_is_refused_and_others_are_untouched(serve_app):
    not_image = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()

    async def scenario():
        live = asyncio.create_task(session(serve_app, 5, seed=11))
        await asyncio.sleep(2)
        cases = [
            (["{not json"], "invalid_json", None),
            ([{"type": "session.dance"}], "unknown_type", None),
            ([{"type": "session.interaction", "interaction": {"event_id": "x", "event": {"keys": ["w"]}}}],
             "not_started", None),
            ([{k: v for k, v in start_msg().items() if k != "prompt"}], "missing_field", 1008),
            ([start_msg(image_reference={"image_url": not_image})], "invalid_image", 1008),
            ([start_msg(image_reference={"image_url": "https://example.com/a.png"})], "invalid_image", 1008),
            ([start_msg(width=100)], "invalid_size", 1008),
            ([start_msg(num_frames=20)], "invalid_num_frames", 1008),
            ([json.dumps(start_msg(prompt="x" * (5 * 2 ** 20)))], "message_too_large", 1009),
            ([b"\x00\x01"], "unsupported_message", None),
        ]
        codes = []
        for messages, code, close in cases:
            codes.append((await expect_error(serve_app, messages, code, close))["code"])
        # a bad control inside a running session is refused without ending it
        async with RealtimeClient(serve_app) as client:
            await client.start("p", png_url(), W, H, 2)

            async def bad_control(result, meta):
                c = client
                if meta["generation_chunk_index"] == 0:
                    await c.send({"type": "session.interaction",
                                  "interaction": {"event_id": "e1", "event": {"keys": ["wq"]}}})
                    await c.send({"type": "session.interaction", "interaction": {"event_id": "e2", "event": {
                        "multi_modal_data": {"camera": {"mode": "orbit", "data": {}}}}}})
            in_session = await client.receive_session(bad_control)
        return codes, in_session, await live

    codes, in_session, live = run(scenario())
    assert len(codes) == 10
    errors = [m for m in in_session.messages if m["type"] == "error"]
    assert [e["code"] for e in errors] == ["invalid_field", "invalid_field"]
    assert [e["event_id"] for e in errors] == ["e1", "e2"]
    assert in_session.done["chunks"] == 2
    assert live.error is None and live.done["chunks"] == 5
    assert read_frames(live.video).shape == (57, H, W, 3)
    with urllib.request.urlopen(f"{HTTP}/healthz", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_hostile_input_gets_its_code_not_an_internal_error(serve_app):
    """Deep nesting and huge integers anywhere in a start, or as the whole message, are refused with their own
    codes and close 1007 (they used to escape the parser and be answered as internal errors)."""
    deep_prompt = '{"type": "session.start", "prompt": ' + "[" * 2000 + "]" * 2000 + "}"
    cases = [
        ([deep_prompt], "too_deep"),
        (["[" * 1_000_000], "too_deep"),
        (['{"type": "session.start", "prompt": "p", "extra_params": {"camera_action_script": ' + "[" * 40 + '"w"'
          + "]" * 40 + "}}"], "too_deep"),
        (['{"type": "session.start", "seed": ' + "9" * 5000 + "}"], "number_too_large"),
        ([json.dumps(start_msg(num_frames=1)).replace('"num_frames": 1', '"num_frames": ' + "1" * 3000)],
         "number_too_large"),
        ([json.dumps(start_msg(extra_params={"endless": 7})).replace("7}", "7" * 4000 + "}")], "number_too_large"),
        (["8" * 4500], "number_too_large"),
    ]

    async def scenario():
        return [(await expect_error(serve_app, messages, code, 1007))["code"] for messages, code in cases]
    assert run(scenario()) == [code for _, code in cases]
    with urllib.request.urlopen(f"{HTTP}/healthz", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


def test_large_handshake_headers_get_a_prompt_answer(serve_app):
    """A handshake with a 10 KB bearer token or a 20 KB cookie used to get no answer at all (the proxy's
    WebSocket parser never answers a header line over 8 KiB): now, with lines up to 32 KiB, the first is served
    (no keys are configured here, so the token means nothing) and the second refused at the door, both at once,
    as are two cookies of 9 KB (the door counts all the headers, max_header_bytes = 16 KiB)."""
    async def served(headers):
        t0 = time.monotonic()
        async with websockets.connect(serve_app, additional_headers=headers, compression=None, open_timeout=5) as ws:
            await ws.send(json.dumps({"type": "session.ping", "t": 1}))
            return json.loads(await asyncio.wait_for(ws.recv(), 5)), time.monotonic() - t0

    async def refused(headers):
        t0 = time.monotonic()
        async with websockets.connect(serve_app, additional_headers=headers, compression=None, open_timeout=5) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), 5))
            try:
                await asyncio.wait_for(ws.recv(), 5)
            except websockets.ConnectionClosed:
                pass
            return error, ws.close_code, time.monotonic() - t0

    reply, seconds = run(served({"Authorization": "Bearer " + "k" * 10_000}))
    assert reply == {"type": "session.pong", "t": 1} and seconds < 5
    for headers in ({"Cookie": "c=" + "v" * 20_000}, [("Cookie", "a=" + "v" * 9_000), ("Cookie", "b=" + "v" * 9_000)]):
        error, code, seconds = run(refused(headers))
        assert error["code"] == "headers_too_large" and code == 1008 and seconds < 5


def test_start_timeout(serve_app):
    async def idle():
        async with RealtimeClient(serve_app) as client:
            await client.send({"type": "session.ping", "t": 1})
            pong = json.loads(await client.ws.recv())
            return pong, await client.receive_session(timeout=30)

    pong, result = run(idle())
    assert pong == {"type": "session.pong", "t": 1}
    assert result.error["code"] == "start_timeout" and result.close_code == 1008


def test_http_endpoints(serve_app):
    with urllib.request.urlopen(f"{HTTP}/readyz", timeout=10) as r:
        assert json.loads(r.read()) == {"ready": True, "groups": 1, "starting": 0}
    with urllib.request.urlopen(f"{HTTP}/v1/config", timeout=10) as r:
        assert json.loads(r.read())["width"] == W
    with urllib.request.urlopen(f"{HTTP}/", timeout=10) as r:
        assert b"LingBot-World" in r.read()
    with urllib.request.urlopen(f"{HTTP}/static/app.js", timeout=10) as r:
        assert r.status == 200
    # malformed or unknown paths are 404, a wrong method 405; never a 500
    for path, method, status in [("/static/%00.js", "GET", 404), ("/static/..%2Fapp.py", "GET", 404),
                                 ("/static/.hidden", "GET", 404), ("/static/%FF%FE", "GET", 404),
                                 ("/no/such/page", "GET", 404), ("/healthz", "POST", 405),
                                 ("/v1/config", "DELETE", 405)]:
        request = urllib.request.Request(f"{HTTP}{path}", method=method)
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError(f"{method} {path} was answered 200")
        except urllib.error.HTTPError as e:
            assert e.code == status, (method, path, e.code)


def test_the_peers_descriptions_of_the_server(serve_app):
    """SGLang diffusion's GET /models and /server_info and vLLM's GET /v1/models, /health and /version, from what
    the group runs (its facts) and the settings: a benchmark client of either reads them before its session."""
    from importlib import metadata

    from deployments.ingress import peers
    from deployments.session.events import ModelFacts
    from deployments.settings import ServeSettings
    from lingbot.config import get_preset
    from tests.deployments.conftest import TEST_SETTINGS

    def get(path):
        with urllib.request.urlopen(f"{HTTP}{path}", timeout=30) as r:
            return r.status, r.read()
    facts, settings = ModelFacts.of(get_preset("tiny"), True, ("wan", "tae")), ServeSettings(**TEST_SETTINGS)
    assert get("/health") == (200, b"")
    assert json.loads(get("/version")[1]) == {"version": metadata.version("lingbot-serve")}
    models = json.loads(get("/models")[1])
    assert models == peers.sglang_models(facts, settings) == {
        "model_path": "random:tiny", "task_type": "I2V", "pipeline_name": "lingbot_world",
        "pipeline_class": "WorldPipeline", "num_gpus": 2, "dit_precision": peers.precision(facts.dtype),
        "vae_precision": "fp32"}
    info = json.loads(get("/server_info")[1])
    assert info == peers.sglang_server_info(facts, settings)
    assert {k: info["realtime"][k] for k in ("width", "height", "fps", "max_fps", "frames_per_chunk",
                                             "first_chunk_frames", "num_inference_steps", "decoders")} == {
        "width": W, "height": H, "fps": 16.0, "max_fps": 120.0, "frames_per_chunk": 12, "first_chunk_frames": 9,
        "num_inference_steps": facts.steps, "decoders": ["wan", "tae"]}
    listed = json.loads(get("/v1/models")[1])
    (card,) = listed["data"]
    assert listed["object"] == "list" and card["id"] == "lingbot-world" and card["object"] == "model"
    assert card["root"] == "random:tiny" and isinstance(card["created"], int) and card["created"] > 1.7e9


def scrape(port):
    """The node's Prometheus text -> {(name, frozenset(labels)): value}, names without Ray's prefix."""
    import re
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(?:ray_)?(lingbot_\w+)(?:\{(.*)\})? (\S+)$", line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(values, name, **labels):
    """Sum of `name` over the series whose labels include `labels` (0 when none is exported yet)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= ls)


def test_the_group_reports_its_ladder_mode_and_capacities(serve_app):
    """The group census: the quality ladder's mode as Serve's user_config set it (WorldGroup.reconfigure; a
    `serve deploy` that changes it is a lightweight update of the running groups) and its capacities (the
    ladder off: the configured 2 at every rung)."""
    from perf.soak import census
    group = census("lingbot")["group"]
    assert group["settings"] == {"quality_ladder": "off"}
    assert group["capacity"] == {"configured": 2, "top": 2, "floor": 2}


def test_the_ladder_switched_on_takes_a_session_behind_down_to_the_floor_and_admission_counts_the_floor(serve_app):
    """The ladder switched on in the running group (WorldGroup.reconfigure, what Serve calls for a user_config
    change; tests/cluster/test_multinode.py does it by `serve deploy`). A session asking for 120 fps (10 chunks a
    second: always behind its deadline here) runs its sink at every step, then steps down a rung a chunk to the
    floor, the decoder rung tiny_steps2 (the tiny decoder instead of its own Wan decoder). Meanwhile a second
    paced session is either taken or refused with capacity_exhausted, as the floor's learned cost says (which one
    depends on this machine's speed: decided by the pure functions in tests/deployments/group/
    test_lease_admission.py and test_ladder.py), an unpaced one (no real-time demand) is taken, and the census
    reports the measured capacities within the configured cap. Switched off again, the group says so."""
    from ray import serve

    from perf.soak import census
    group = serve.get_deployment_handle("WorldGroup", "lingbot")

    async def scenario():
        async with RealtimeClient(serve_app) as fast:
            await fast.start("p", png_url(), W, H, None, seed=1, fps=120.0)
            first = []
            while len(first) < 2:                            # two chunks run: the group measured its cost
                msg = await fast.ws.recv()
                if isinstance(msg, str) and json.loads(msg)["type"] == "video.chunk_metadata":
                    first.append(json.loads(msg))
            other = await session(serve_app, 2, seed=3)
            unpaced = await session(serve_app, 1, seed=4, realtime_output_pacing=False)
            measured = await group.census.remote()
            await fast.send({"type": "session.stop"})
            rest = await fast.receive_session()
            return other, unpaced, measured, rest, first + [c for c in rest.chunks if c is not None]

    group.reconfigure.remote({"quality_ladder": "auto"}).result(timeout_s=30)
    try:
        assert census("lingbot")["group"]["settings"] == {"quality_ladder": "auto"}
        other, unpaced, measured, fast, chunks = run(scenario())
    finally:
        group.reconfigure.remote({"quality_ladder": "off"}).result(timeout_s=30)
    assert fast.error is None and fast.done["stopped"] is True
    rungs = [(c["quality"], c["denoising_steps"]) for c in chunks]
    assert all(steps is None for _, steps in rungs[:3]) and ("tiny_steps2", 2) in rungs, rungs
    assert other.error is None or (other.error["code"] == "capacity_exhausted" and other.close_code == 1013)
    assert unpaced.error is None and unpaced.done["chunks"] == 1
    capacity = measured["capacity"]
    assert capacity["configured"] == 2 and 1 <= capacity["top"] <= capacity["floor"] <= 2, capacity
    assert census("lingbot")["group"]["settings"] == {"quality_ladder": "off"}


def test_metrics_count_what_happened(serve_app):
    """Ray exports recorded metrics on the node's endpoint every METRICS_INTERVAL_MS: wait until the counters
    are settled, run one 3-chunk session and one bad message, then the counters move by exactly that."""
    import time

    from tests.deployments.conftest import METRICS_INTERVAL_MS, METRICS_PORT
    watched = [("lingbot_sessions_total", {"component": "ingress"}),
               ("lingbot_refusals_total", {"code": "invalid_json"}),
               ("lingbot_chunk_interval_seconds_count", {"group": "all"}),
               ("lingbot_stage_seconds_count", {"stage": "decode"}),
               ("lingbot_stage_seconds_count", {"stage": "probe_0"}),
               ("lingbot_chunks_total", {"quality": "full"})]

    def read():
        values = scrape(METRICS_PORT)
        return [metric(values, name, **labels) for name, labels in watched], values

    before, previous = None, None
    while before is None:                                   # two exports in a row agree: nothing in flight
        time.sleep(METRICS_INTERVAL_MS / 1000 + 1)
        now, _ = read()
        before, previous = (now if now == previous else None), now
    result = run(session(serve_app, 3))
    assert result.error is None
    run(expect_error(serve_app, ["{not json"], "invalid_json"))
    expected = [b + d for b, d in zip(before, [1, 1, 2, 3, 3, 3])]    # 3 chunks: 2 intervals, 3 decodes
    deadline = time.monotonic() + 60
    after, values = read()
    while after != expected and time.monotonic() < deadline:
        time.sleep(1)
        after, values = read()
    assert after == expected, dict(zip([n for n, _ in watched], zip(before, after)))
    assert metric(values, "lingbot_active_sessions") == 0        # every session has ended
    for rank in ("0", "1"):                                       # each CPU rank reports its own process
        assert metric(values, "lingbot_rank_device_memory_bytes", rank=rank) > 50 * 2 ** 20, rank
    assert any(n == "lingbot_video_rtf" and v > 0 for (n, _), v in values.items())


def test_grafana_dashboard_queries_only_exported_metrics(serve_app):
    """Every series the dashboard (cluster/grafana) queries is on a running app's metrics endpoint. A
    120 fps session outruns the tiny model, so the stall counter is exported too."""
    import re
    import time
    from pathlib import Path

    from tests.deployments.conftest import METRICS_PORT
    dashboard = json.loads((Path(__file__).parents[2] / "cluster/grafana/lingbot-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b(ray_lingbot_\w+)", target["expr"])}
    assert len(queried) >= 9
    assert run(session(serve_app, 3, fps=120)).done["chunks"] == 3
    run(expect_error(serve_app, ["{not json"], "invalid_json"))
    deadline, exported = time.monotonic() + 60, set()
    while time.monotonic() < deadline and not queried <= exported:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
            exported = {line.split("{")[0].split(" ")[0] for line in r.read().decode().splitlines()
                        if line and not line.startswith("#")}
        time.sleep(2)
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"


def test_a_quiet_client_that_reads_is_never_cut(serve_app):
    """6 chunks to a client that never sends a message (no pings either): longer than stall_timeout_s
    (8 s here), and the session runs to its end. At 4 fps the 6 chunks are 17.25 s of video and pacing
    lets a session run at most 8 s ahead (pacing_lead_s), so it lasts 9.25 s or more on any machine (most
    of it waiting for real time, not generating)."""
    from tests.deployments.conftest import TEST_SETTINGS

    async def quiet():
        async with RealtimeClient(serve_app) as client:
            await client.start("a long road", png_url(), W, H, 6, fps=4)
            return await client.receive_session(timeout=600, ping_interval=None)

    result = run(quiet())
    assert result.error is None and result.done == {"type": "session.done", "chunks": 6, "stopped": False}
    assert result.arrivals[-1] - result.started_at > TEST_SETTINGS["stall_timeout_s"]     # outlived the bound
    assert sum(c["num_frames"] for c in result.chunks) == 12 * 6 - 3


def live_sessions() -> int:
    with urllib.request.urlopen(f"{HTTP}/healthz", timeout=10) as r:
        return json.loads(r.read())["live_sessions"]


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_client_that_stops_reading_is_freed(serve_app, protocol):
    """A client that stops reading (small receive buffer, small message queue, no pong) an endless session at
    120 fps, over each protocol (the second's raw frames, about 250 KB a chunk): the session ends and its
    connection closes, so reading again meets the end of the stream, not an endless one. Behind Serve's proxy
    the ingress's sends never block (the proxy takes the messages, Ray's stream buffers the rest); the proxy's
    door cuts the connection once one of its sends has been blocked for stall_timeout_s (8 s here), and the
    ingress hears the client gone: the second protocol's session goes in about 10 s. Before the door it was not
    let go at all (its video piled up in the proxy). The first protocol's chunks are small (about 8 KB), so the
    kernel's socket buffers take them for about 30 s before a send blocks: it goes after about 40 s, by the
    door or the proxy's keepalive (a ping every 20 s, 20 s to answer), whichever comes first. (The test waits
    while the ingress counts the session live, not a fixed time.)"""
    import socket

    import msgpack
    import websockets

    from tests.deployments.test_sglang_app import frames_url, png

    async def scenario():
        before = await asyncio.to_thread(live_sessions)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", int(serve_app.split(":")[2].split("/")[0])))
        url = serve_app if protocol == "vllm" else frames_url(serve_app)
        ws = await websockets.connect(url, sock=sock, compression=None, max_queue=2, ping_interval=None)
        if protocol == "vllm":
            await ws.send(json.dumps(start_msg(num_frames=None, fps=120, extra_params={"endless": True})))
        else:
            await ws.send(msgpack.packb({"type": "init", "prompt": "a forest path", "first_frame": png(), "fps": 120,
                                         "realtime_output_format": "raw", "decoder": "tae"}, use_bin_type=True))
        seen_live, freed, t0 = False, False, time.monotonic()
        while time.monotonic() - t0 < 120:
            live = await asyncio.to_thread(live_sessions)
            seen_live = seen_live or live > before
            freed = seen_live and live <= before    # the ingress let the session go
            if freed:
                break
            await asyncio.sleep(1.0)
        assert seen_live and freed
        chunks = 0
        try:
            while True:
                chunks += isinstance(await asyncio.wait_for(ws.recv(), 30), bytes)
        except websockets.ConnectionClosed:
            return chunks, True
        except asyncio.TimeoutError:
            return chunks, False

    chunks, closed = run(scenario())
    assert closed, "the session of a client that stopped reading was still streaming"
    assert chunks < 1000


def test_the_ranks_start_a_chunk_before_the_last_one_is_encoded(serve_app):
    """Delivery overlaps the device: chunk k+1 is dispatched to the ranks before chunk k's fragment is back
    from the muxer (both on the group's clock), and the stream stays in order, whole and playable. The session
    pins the steps2 rung (extra_params.quality; the ladder is off): its chunks past the sink run 2 steps."""
    result = run(session(serve_app, 5, seed=2, quality="steps2"))
    assert result.error is None and result.done["chunks"] == 5
    assert [(c["quality"], c["denoising_steps"]) for c in result.chunks] == [("full", None)] * 3 + [("steps2", 2)] * 2
    clocks = [c["group_clock"] for c in result.chunks]
    assert [c["generation_chunk_index"] for c in result.chunks] == list(range(5))
    for k in range(4):
        assert clocks[k + 1]["dispatched"] < clocks[k]["fragment"], (k, clocks[k], clocks[k + 1])
    assert read_frames(result.video).shape == (12 * 5 - 3, H, W, 3)


def orbit_trajectory(frames):
    """Per video frame poses yawing 3 deg and stepping 0.02 along z, intrinsics at 832x480 (JSON lists)."""
    from lingbot.camera import make_pose, rot_y
    return {"poses": [make_pose(rot_y(3 * i), (0.0, 0.0, 0.02 * i)).tolist() for i in range(frames)],
            "intrinsics": [[480.0, 480.0, 416.0, 240.0]] * frames}


def in_process_frames(chunks, seed, prompt, flow_shift=None, trajectory_json=None, prompt_change=None,
                      controls=None, decoder="wan", rungs=None):
    """The same session through the in-process pipeline (SP-1): the frames the served one should show.
    `prompt_change`: (chunk, text, transition_chunks) applied at that chunk; `controls`: per chunk; `rungs`: per
    chunk, (denoising steps, decoder) (the tiny decoder beside the session's own)."""
    from lingbot.builder import build_pipeline
    from lingbot.camera import CameraRig, Trajectory
    from lingbot.io.images import open_image, resize_image
    pipeline = build_pipeline("tiny", decoder=decoder if rungs is None else (decoder, "tae"))
    image = resize_image(open_image(base64.b64decode(png_url().partition(",")[2])), W, H)
    traj = None
    if trajectory_json is not None:
        traj = Trajectory.from_video_frames(trajectory_json["poses"], trajectory_json["intrinsics"], W, H,
                                            max_video_frames=LINGBOT_GEOMETRY.video_frames(chunks))
    world = pipeline.new_session(image, prompt, seed=seed, rig=CameraRig.default(W, H, traj), flow_shift=flow_shift,
                                 switch_to=() if rungs is None else ("tae",))
    frames = []
    for k in range(chunks):
        change = prompt_change[1:] if prompt_change is not None and prompt_change[0] == k else None
        steps, rung_decoder = (None, None) if rungs is None else rungs[k]
        frames.append(world.step(controls[k] if controls else None, prompt=change, steps=steps,
                                 decoder=rung_decoder).frames.numpy())
    return np.concatenate(frames)


def through_h264(frames, fps=16.0):
    """Frames as a client sees them after the muxer's encoder (same codec, CRF, preset and frame rate)."""
    from lingbot.io.video import H264Writer
    buf = io.BytesIO()
    writer = H264Writer(buf, W, H, fps)
    writer.write(frames)
    writer.close()
    return read_frames(buf.getvalue()).astype(float)


def test_served_frames_are_the_in_process_pipelines(serve_app):
    """A served session (SP-2, sharded decode, muxer) shows the frames of the in-process pipeline (SP-1) for
    the same image, prompt, seed, flow shift and camera path, both through the same H.264 encoder; changing
    any of the inputs changes them. (The tiny model's random-weight frames are noise-like, so H.264 itself
    moves them by ~13 levels: the comparison is after the codec on both sides.)"""
    traj = orbit_trajectory(33)
    base = dict(seed=4, prompt="a forest path", flow_shift=4.0)
    served = run(session(serve_app, 3, camera_trajectory=traj, **base))
    assert served.error is None, served.error
    served_frames = read_frames(served.video).astype(float)
    expected = through_h264(in_process_frames(3, trajectory_json=traj, **base))
    assert served_frames.shape == expected.shape == (33, H, W, 3)
    assert np.abs(served_frames - expected).mean() < 0.25      # identical here; room for +-1 rounding of SP-2
    for change in (dict(seed=5), dict(prompt="a desert road"), dict(flow_shift=8.0)):
        other = through_h264(in_process_frames(3, trajectory_json=traj, **{**base, **change}))
        assert np.abs(served_frames - other).mean() > 2.0, change
    still = through_h264(in_process_frames(3, trajectory_json=orbit_trajectory(1), **base))
    assert np.abs(served_frames[9:] - still[9:]).mean() > 2.0   # the camera path moved the later chunks


def test_a_wan_session_pinned_to_a_decoder_rung_shows_the_tiny_decoders_frames_of_its_latents(serve_app):
    """extra_params.quality tiny_steps2 on a session whose decoder is the Wan one (both loaded): its sink runs
    every step on the tiny decoder (`tiny`: a decoder rung applies there), then 2 steps (`tiny_steps2`); the frames
    are the in-process pipeline's for the same rungs (SP-2 with the tiny decoder on the root against SP-1, after
    the codec on both sides), not the Wan decoder's."""
    base = dict(seed=6, prompt="a quarry")
    served = run(session(serve_app, 5, decoder="wan", quality="tiny_steps2", **base))
    assert served.error is None, served.error
    assert [(c["quality"], c["denoising_steps"]) for c in served.chunks] == [("tiny", None)] * 3 + [
        ("tiny_steps2", 2)] * 2
    frames = read_frames(served.video).astype(float)
    rungs = [(None, "tae")] * 3 + [(2, "tae")] * 2
    expected = through_h264(in_process_frames(5, rungs=rungs, **base))
    assert frames.shape == expected.shape == (57, H, W, 3) and np.abs(frames - expected).mean() < 0.25
    wan = through_h264(in_process_frames(5, rungs=[(None, None)] * 3 + [(2, None)] * 2, **base))
    assert np.abs(frames - wan).mean() > 2.0


def test_camera_trajectory_refusals_leave_live_sessions_alone(serve_app):
    bad_rotation = orbit_trajectory(5)
    bad_rotation["poses"][2][0][0] = 2.0
    bad_focal = orbit_trajectory(5)
    bad_focal["intrinsics"][1][0] = 0.0
    cases = [({"poses": [[1, 2]], "intrinsics": [[1, 2, 3, 4]]}, "trajectory_shape"),
             (bad_rotation, "trajectory_not_rigid"), (bad_focal, "trajectory_intrinsics"),
             ("poses.npy", "invalid_field")]

    async def scenario():
        live = asyncio.create_task(session(serve_app, 4, seed=11))
        await asyncio.sleep(2)
        codes = []
        for value, code in cases:
            msg = start_msg(extra_params={"camera_trajectory": value})
            codes.append((await expect_error(serve_app, [msg], code, close=1008))["code"])
        both = start_msg(extra_params={"camera_trajectory": orbit_trajectory(5),
                                       "camera_action_script": [["w", "w", "w"], ["", "", ""]]})
        codes.append((await expect_error(serve_app, [both], "conflicting_camera", close=1008))["code"])
        not_finite = json.dumps(start_msg(extra_params={"camera_trajectory": orbit_trajectory(5)}))
        not_finite = not_finite.replace("0.08", "1e400", 1)           # JSON's way to an infinite number
        codes.append((await expect_error(serve_app, [not_finite], "trajectory_not_finite", close=1008))["code"])
        # a trajectory session refuses camera and key events (its path is the camera) and keeps going
        async with RealtimeClient(serve_app) as client:
            await client.start("p", png_url(), W, H, 2, camera_trajectory=orbit_trajectory(21))

            async def steer(result, meta):
                if meta["generation_chunk_index"] == 0:
                    await client.interact("k1", keys=["w"])
                    await client.interact("p1", prompt="a desert road")
            scripted = await client.receive_session(steer)
        return codes, scripted, await live

    codes, scripted, live = run(scenario())
    assert codes == [code for _, code in cases] + ["conflicting_camera", "trajectory_not_finite"]
    errors = [m for m in scripted.messages if m["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("camera_scripted", "k1")]
    assert any(m["type"] == "session.interaction.queued" and m["event_id"] == "p1" for m in scripted.messages)
    assert scripted.done["chunks"] == 2
    assert live.error is None and live.done["chunks"] == 4


def test_python_client_sends_an_offline_path(serve_app, tmp_path, capsys):
    from deployments.client.cli import main
    traj = orbit_trajectory(21)
    np.save(tmp_path / "poses.npy", np.array(traj["poses"]))
    np.save(tmp_path / "intrinsics.npy", np.array(traj["intrinsics"]))
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (80, 140, 3), dtype=np.uint8)).save(tmp_path / "f.png")
    args = [serve_app, "--image", str(tmp_path / "f.png"), "--prompt", "a forest path", "--chunks", "2",
            "--poses", str(tmp_path / "poses.npy"), "--intrinsics", str(tmp_path / "intrinsics.npy")]
    assert main(args + ["-o", str(tmp_path / "out.mp4")]) == 0
    assert read_frames(tmp_path / "out.mp4").shape == (21, H, W, 3)
    assert main(args + ["--keys", "w", "-o", str(tmp_path / "x.mp4")]) == 2
    assert "--keys and --poses both drive the camera" in capsys.readouterr().err


def test_prompt_change_mid_session_is_the_in_process_blend(serve_app):
    """A prompt event with transition_chunks 2.7 (truncated to 2, as the reference) blends into the new
    prompt from the chunk that started it, exactly as the in-process pipeline does; a second
    session.start on the same connection is refused and the session goes on."""
    async def change(client, result, meta):
        if meta["generation_chunk_index"] == 0:
            await client.interact("p1", prompt="a desert road", transition_chunks=2.7)
            await client.send(start_msg())

    async def scenario():
        async with RealtimeClient(serve_app) as client:
            await client.start("a forest path", png_url(), W, H, 5, seed=6)
            return await client.receive_session(lambda result, meta: change(client, result, meta))

    served = run(scenario())
    assert served.done["chunks"] == 5 and served.close_code == 1000
    refusals = [m for m in served.messages if m["type"] == "error"]
    assert [m["code"] for m in refusals] == ["already_started"]
    k = next(c["generation_chunk_index"] for c in served.chunks if "p1" in c["started_event_ids"])
    assert 1 <= k <= 3
    completed = next(c["generation_chunk_index"] for c in served.chunks if "p1" in c["completed_event_ids"])
    assert completed == k + 1                                   # two chunks of transition
    frames = read_frames(served.video).astype(float)
    blended = through_h264(in_process_frames(5, 6, "a forest path", prompt_change=(k, "a desert road", 2)))
    assert np.abs(frames - blended).mean() < 0.25
    plain = through_h264(in_process_frames(5, 6, "a forest path"))
    first = LINGBOT_GEOMETRY.video_frames(k)                    # frames before chunk k
    assert np.abs(frames[first:] - plain[first:]).mean() > 2.0
    snapped = through_h264(in_process_frames(5, 6, "a forest path", prompt_change=(k, "a desert road", 0)))
    assert np.abs(frames[first:] - snapped[first:]).mean() > 0.5   # the blend is not a switch
