"""How a session's chunks reach its client: a quiet client that reads is never cut, one that stops reading is let
go over either protocol, and the ranks start a chunk before the last one is encoded."""
import asyncio
import json
import time

import pytest

from deployments.client import RealtimeClient
from lingbot.io.video import read_frames
from tests.deployments.clients import H, W, frames_url, png, png_url, run, session, start_msg
from tests.deployments.observe import live_sessions


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
