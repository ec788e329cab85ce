"""The clients against a real WebSocket server that refuses at once: the refusal is reported, not raised."""
import asyncio

import websockets

from deployments.client import FramesClient, RealtimeClient
from tests.waits import async_wait_until


async def refuse(ws):
    await ws.close(1008, "a valid API key is required")


async def session_against_refusing_server(client_cls):
    async with websockets.serve(refuse, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with client_cls(f"ws://127.0.0.1:{port}/") as client:
            await client.ws.wait_closed()              # the refusal arrives before the first message goes out
            if isinstance(client, FramesClient):
                await client.init("p", b"not sent", 1)
                await client.event("heartbeat")
                return await client.receive_session(heartbeat_interval=0.01, timeout=5)
            await client.start("p", "data:,", 64, 64, 1)
            await client.interact("e1", keys=["w"])
            return await client.receive_session(ping_interval=0.01, timeout=5)


def test_messages_after_a_refusal_are_dropped_and_the_close_is_reported():
    frames = asyncio.run(session_against_refusing_server(FramesClient))
    assert (frames.close_code, frames.close_reason) == (1008, "a valid API key is required")
    assert frames.chunks == [] and frames.errors == []
    realtime = asyncio.run(session_against_refusing_server(RealtimeClient))
    assert realtime.close_code == 1008 and realtime.chunks == []


def test_a_start_without_fps_leaves_the_field_out_so_the_server_chooses():
    """Both clients send `fps` only when given one: without it the session runs at the server's fps (a deployment
    served at another fps than 16 no longer refuses the clients' defaults as invalid_field)."""
    import json

    import msgpack

    async def first_messages(send_start):
        seen = []

        async def record(ws):
            seen.append(await ws.recv())
            await ws.close(1000)

        async def recorded(starts: int):
            await async_wait_until(lambda: len(seen) >= starts, 10, f"the server to record start {starts}")
        async with websockets.serve(record, "127.0.0.1", 0) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
            for kw in ({}, {"fps": 8.0}):
                await send_start(url, kw)
                await recorded(1 if not kw else 2)
        return seen

    async def realtime(url, kw):
        async with RealtimeClient(url) as client:
            await client.start("p", "data:,", 64, 64, 1, **kw)

    async def frames(url, kw):
        async with FramesClient(url) as client:
            await client.init("p", b"png", 1, **kw)

    plain, paced = [json.loads(m) for m in asyncio.run(first_messages(realtime))]
    assert "fps" not in plain and paced["fps"] == 8.0
    plain, paced = [msgpack.unpackb(m, raw=False) for m in asyncio.run(first_messages(frames))]
    assert "fps" not in plain and paced["fps"] == 8.0
