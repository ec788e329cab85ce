"""Clients of the package's served app (tests/deployments/conftest.py) over both protocols, as the served tests
drive it: the test image, a session read to its end, a start message to vary, a refusal to expect, and a session
left streaming in the background while a test does something else."""
import asyncio
import base64
import io
import json
import socket
from urllib.parse import urlsplit

import msgpack
import numpy as np
import websockets
from PIL import Image

from deployments.client import FramesClient, RealtimeClient, image_data_url
from lingbot.config import LINGBOT_GEOMETRY
from lingbot.io.video import read_frames, split_init_segment
from tests.waits import async_wait_until

W, H = 112, 64                             # the tiny preset's frame size


def png_url(seed=0) -> str:
    """The test image (80x140 noise: resized to W x H by the server) as a data: URL."""
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (80, 140, 3), dtype=np.uint8)).save(buf, "PNG")
    return image_data_url(buf.getvalue(), "image/png")


def png() -> bytes:
    """The test image's PNG bytes (the second protocol's first_frame)."""
    return base64.b64decode(png_url().partition(",")[2])


def run(coro):
    return asyncio.run(coro)


# ---- the first protocol (/v1/realtime/video: JSON and fMP4) ------------------------------------
async def session(url, chunks, seed=0, script=None, on_chunk=None, prompt="a forest path", **extra):
    """A session of `chunks` chunks (None: endless) read to its end; on_chunk(client, result, meta) after each."""
    async with RealtimeClient(url) as client:
        await client.start(prompt, png_url(), W, H, chunks, seed=seed, script=script, **extra)

        async def hook(result, meta):
            if on_chunk is not None:
                await on_chunk(client, result, meta)
        return await client.receive_session(hook)


async def streaming_session(url, chunks, seed=0, timeout_s=120.0) -> asyncio.Task:
    """A session of `chunks` chunks running in the background, returned once its first chunk has arrived (so it
    streams while the caller goes on); the task gives its SessionResult."""
    first = asyncio.Event()

    async def streaming(client, result, meta):
        first.set()
    task = asyncio.create_task(session(url, chunks, seed=seed, on_chunk=streaming))
    await async_wait_until(lambda: first.is_set() or task.done(), timeout_s, "the live session's first chunk")
    assert first.is_set(), f"the live session ended before its first chunk: {task.result().error}"
    return task


def chunk_frames(result):
    """Decoded frames split by chunk."""
    frames = read_frames(result.video)
    out, start = [], 0
    for meta in result.chunks:
        out.append(frames[start:start + meta["num_frames"]])
        start += meta["num_frames"]
    assert start == len(frames)
    return out


def start_msg(**overrides):
    """A valid session.start of 2 chunks (the test image, seed 0), with `overrides`."""
    msg = {"type": "session.start", "prompt": "p", "image_reference": {"image_url": png_url()}, "width": W,
           "height": H, "num_frames": LINGBOT_GEOMETRY.video_frames(2), "seed": 0}
    msg.update(overrides)
    return msg


async def expect_error(url, messages, code, close=None):
    """Send `messages` (dicts as JSON, str and bytes as they are) on a new connection: the first error answered
    has `code` and a message without a traceback; with `close`, the connection then closes with that code."""
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


# ---- the second protocol (/v1/realtime_video/generate: MessagePack and raw frames) -------------
def frames_url(serve_app: str) -> str:
    return serve_app.replace("/v1/realtime/video", "/v1/realtime_video/generate")


async def frames_session(url, chunks, seed=0, prompt="a forest path", on_chunk=None, **init):
    """A session of the second protocol read to its end; on_chunk(client, result, chunk) after each chunk."""
    async with FramesClient(url) as client:
        await client.init(prompt, png(), chunks, seed, **init)

        async def hook(result, chunk):
            if on_chunk is not None:
                await on_chunk(client, result, chunk)
        return await client.receive_session(hook)


# ---- viewers -------------------------------------------------------------------------------------
async def stalled_viewer(watch_url: str):
    """A viewer that never reads (a 4 KiB receive buffer, no reads): once the kernel's buffers are full, its chunks
    wait at the server, which skips it to keyframes and then cuts it. The open connection."""
    where = urlsplit(watch_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((where.hostname, where.port))
    return await websockets.connect(watch_url, sock=sock, compression=None, max_queue=1, ping_interval=None,
                                    max_size=2 ** 28)


async def until(client, kind: str) -> dict:
    """The first protocol's next message of type `kind` (others before it skipped)."""
    while True:
        msg = await asyncio.wait_for(client.ws.recv(), 60)
        if isinstance(msg, str) and json.loads(msg)["type"] == kind:
            return json.loads(msg)


async def refused(url: str) -> tuple[dict, int]:
    """(the error message, the close code) of a connection the server refuses at once (in the route's dialect:
    JSON, or the second protocol's MessagePack with the text under `content`)."""
    async with websockets.connect(url, compression=None) as ws:
        raw = await asyncio.wait_for(ws.recv(), 30)
        error = json.loads(raw) if isinstance(raw, str) else msgpack.unpackb(raw)
        error.setdefault("message", error.get("content"))
        try:
            await asyncio.wait_for(ws.recv(), 30)
        except websockets.ConnectionClosed as e:
            return error, e.rcvd.code
    raise AssertionError("the connection stayed open")


def fragments(result) -> dict[int, bytes]:
    """Each chunk's fMP4 fragment by generation index, the init segment split off the first."""
    return {meta["generation_chunk_index"]: split_init_segment(data)[1] for meta, data in zip(result.chunks,
                                                                                               result.data)}
