"""The Ray Serve application end to end (a real Serve app, real WebSocket clients): a session's stream, two
sessions against the group's two places, the start timeout, the HTTP endpoints and the peers' descriptions of the
server. The package's other served modules share the app (conftest.py): test_refusals, test_controls, test_delivery,
test_quality, test_metrics and the rest."""
import asyncio
import json
import urllib.error
import urllib.request

from deployments.client import RealtimeClient
from lingbot.io.video import read_frames
from tests.deployments.clients import H, W, png_url, run, session
from tests.deployments.conftest import HTTP
from tests.deployments.observe import live_sessions
from tests.waits import wait_until


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
            held = await asyncio.to_thread(live_sessions)
            await a.ws.close()                                    # client gone mid-session
            await asyncio.to_thread(wait_until, lambda: live_sessions() < held, 30,
                                    "the ingress to let the session of the client that left go")
            admitted = await session(serve_app, 2, seed=4)
            await b.send({"type": "session.stop"})
            rest = await b.receive_session()
            return admitted, rest

    admitted, rest = run(disconnect_then_admit())
    assert admitted.error is None and admitted.done["chunks"] == 2
    assert rest.done is not None and rest.done["stopped"] is True


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
    facts, settings = ModelFacts.of(get_preset("tiny"), True, ("tae", "wan")), ServeSettings(**TEST_SETTINGS)
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
        "num_inference_steps": facts.steps, "decoders": ["tae", "wan"]}
    listed = json.loads(get("/v1/models")[1])
    (card,) = listed["data"]
    assert listed["object"] == "list" and card["id"] == "lingbot-world" and card["object"] == "model"
    assert card["root"] == "random:tiny" and isinstance(card["created"], int) and card["created"] > 1.7e9


def test_the_ingress_asks_serve_where_its_proxies_listen(serve_app):
    """What the ingress's start checks against api_keys (deployments/ingress/app.py, check_exposure): the address
    Serve's proxies listen on, as the running Serve's controller says it (this app: 127.0.0.1, nothing refused)."""
    from deployments.ingress.front import proxy_host
    assert proxy_host() == "127.0.0.1"
