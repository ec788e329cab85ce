"""What the served app refuses, and that a refusal touches nobody else: bad and hostile input is answered with
its own code (never an internal error) while another session streams, and oversized handshake headers are
answered at once."""
import asyncio
import base64
import json
import time
import urllib.error
import urllib.request

import websockets

from deployments.client import RealtimeClient
from lingbot.io.video import read_frames
from tests.deployments.clients import H, W, expect_error, png_url, run, start_msg, streaming_session
from tests.deployments.conftest import HTTP


def test_bad_input_is_refused_and_others_are_untouched(serve_app):
    not_image = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()

    async def scenario():
        live = await streaming_session(serve_app, 5, seed=11)
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
