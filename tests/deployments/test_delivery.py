"""How a session's chunks reach its client: a quiet client that reads is never cut while clients that stop reading
are let go over either protocol, and the ranks start a chunk before the last one is encoded."""
import asyncio
import json
import time

from deployments.client import RealtimeClient
from lingbot.io.video import read_frames
from tests.deployments.clients import H, W, frames_url, png, png_url, run, session, start_msg
from tests.deployments.observe import live_sessions


def test_a_quiet_client_that_reads_is_never_cut_and_one_that_stops_reading_is_freed(serve_app):
    """Three clients on the group's two seats, side by side (each mostly waits, so together they take the time of
    the longest):

    - A quiet client that reads: 6 chunks to a client that never sends a message (no pings either), longer than
      stall_timeout_s (8 s here), and the session runs to its end. At 4 fps the 6 chunks are 17.25 s of video and
      pacing lets a session run at most 8 s ahead (pacing_lead_s), so it lasts 9.25 s or more on any machine.
    - Clients that stop reading (small receive buffer, small message queue, no pong) an endless session at 120 fps,
      over each protocol: each session ends and its connection closes, so reading again meets the end of the
      stream, not an endless one. Behind Serve's proxy the ingress's sends never block (the proxy takes the
      messages, Ray's stream buffers the rest); the proxy's door cuts the connection once one of its sends has
      been blocked for stall_timeout_s, and the ingress hears the client gone. The second protocol's raw frames
      (about 250 KB a chunk) block a send within a chunk or two: its session goes in about 10 s (it starts on
      the quiet client's seat once that session is over). The first protocol's chunks are small (about 8 KB), so
      the kernel's socket buffers take them for about 30 s before a send blocks: it goes after about 40 s, by
      the door or the proxy's keepalive (a ping every 20 s, 20 s to answer), whichever comes first. Before the
      door neither was let go at all (its video piled up in the proxy).

    The test waits while the ingress counts any of them live, not a fixed time."""
    import socket

    import msgpack
    import websockets

    from tests.deployments.conftest import TEST_SETTINGS
    port = int(serve_app.split(":")[2].split("/")[0])

    async def quiet():
        async with RealtimeClient(serve_app) as client:
            await client.start("a long road", png_url(), W, H, 6, fps=4)
            return await client.receive_session(timeout=600, ping_interval=None)

    async def stops_reading(protocol):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        url = serve_app if protocol == "vllm" else frames_url(serve_app)
        ws = await websockets.connect(url, sock=sock, compression=None, max_queue=2, ping_interval=None)
        if protocol == "vllm":
            await ws.send(json.dumps(start_msg(num_frames=None, fps=120, extra_params={"endless": True})))
        else:
            await ws.send(msgpack.packb({"type": "init", "prompt": "a forest path", "first_frame": png(), "fps": 120,
                                         "realtime_output_format": "raw", "decoder": "tae"}, use_bin_type=True))
        return ws

    async def read_to_the_end(ws):
        chunks = 0
        try:
            while True:
                chunks += isinstance(await asyncio.wait_for(ws.recv(), 30), bytes)
        except websockets.ConnectionClosed:
            return chunks, True
        except asyncio.TimeoutError:
            return chunks, False

    async def scenario():
        before = await asyncio.to_thread(live_sessions)
        first = await stops_reading("vllm")
        quiet_result = await quiet()                 # on the second seat, while the first stops reading
        second = await stops_reading("sglang")       # then on that seat too
        most, freed, t0 = 0, False, time.monotonic()
        while time.monotonic() - t0 < 120:
            live = await asyncio.to_thread(live_sessions)
            most = max(most, live - before)
            freed = live <= before                   # the ingress let both sessions go
            if freed:
                break
            await asyncio.sleep(1.0)
        return quiet_result, most, freed, await read_to_the_end(first), await read_to_the_end(second)

    result, most, freed, (vllm_chunks, vllm_closed), (raw_chunks, raw_closed) = run(scenario())
    assert result.error is None and result.done == {"type": "session.done", "chunks": 6, "stopped": False}
    assert result.arrivals[-1] - result.started_at > TEST_SETTINGS["stall_timeout_s"]     # outlived the bound
    assert sum(c["num_frames"] for c in result.chunks) == 12 * 6 - 3
    assert most >= 1 and freed, (most, freed)
    assert vllm_closed and raw_closed, "the session of a client that stopped reading was still streaming"
    assert vllm_chunks < 1000 and raw_chunks < 1000


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
