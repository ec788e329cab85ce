"""The clients against a real WebSocket server that refuses at once: the refusal is reported, not raised."""
import asyncio

import websockets

from deployments.client import FramesClient, RealtimeClient


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
