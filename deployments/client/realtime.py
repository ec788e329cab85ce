"""The client of the first protocol (`/v1/realtime/video`): JSON messages (session.start with the image as a
data: URL, session.interaction, session.ping, session.share) out; JSON metadata and fMP4 bytes per chunk back.
The same client watches a shared session (`/v1/realtime/watch/{watch_id}`): `receive_session` reads it."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from lingbot.config import LINGBOT_GEOMETRY

from .connection import WebSocketClient


@dataclass
class SessionResult:
    start: Optional[dict] = None
    chunks: list[dict] = field(default_factory=list)        # chunk metadata, in order
    data: list[bytes] = field(default_factory=list)         # fMP4 bytes per chunk
    arrivals: list[float] = field(default_factory=list)     # monotonic arrival of each chunk's bytes
    messages: list[dict] = field(default_factory=list)      # every JSON message from the server
    done: Optional[dict] = None
    error: Optional[dict] = None
    close_code: Optional[int] = None
    started_at: float = 0.0
    init: bytes = b""                                       # a viewer's: the fMP4 init segment, before its chunks

    @property
    def video(self) -> bytes:
        return self.init + b"".join(self.data)


class RealtimeClient(WebSocketClient):
    async def send(self, message: dict) -> None:
        await self._send(json.dumps(message))

    async def start(self, prompt: str, image_url: str, width: int, height: int, chunks: Optional[int] = None,
                    fps: Optional[float] = None, seed: int = 0, script: Optional[list] = None, **extra) -> None:
        """`fps` None: the field is left out and the session runs at the server's fps."""
        msg = {"type": "session.start", "model": "lingbot-world", "prompt": prompt,
               "image_reference": {"image_url": image_url}, "width": width, "height": height, "seed": seed,
               "extra_params": dict(extra)}
        if fps is not None:
            msg["fps"] = fps
        if chunks is None:
            msg["extra_params"]["endless"] = True
        else:
            msg["num_frames"] = LINGBOT_GEOMETRY.video_frames(chunks)
        if script:
            msg["extra_params"]["camera_action_script"] = script
        await self.send(msg)

    async def resume_world(self, world_id: str, chunks: Optional[int] = None, **extra) -> None:
        """session.start of a saved world: it goes on for `chunks` more chunks (None: endless); its prompt, first
        frame, seed and camera are the world's."""
        msg = {"type": "session.start", "model": "lingbot-world", "world_id": world_id, "extra_params": dict(extra)}
        if chunks is None:
            msg["extra_params"]["endless"] = True
        else:
            msg["num_frames"] = chunks * LINGBOT_GEOMETRY.pixel_frames(1)
        await self.send(msg)

    async def save(self) -> None:
        """session.save: the server answers session.saved {world_id, chunk_index} once the world is stored."""
        await self.send({"type": "session.save"})

    async def interact(self, event_id: str, keys: Optional[list[str]] = None, prompt: Optional[str] = None,
                       camera: Optional[dict] = None, transition_chunks: Optional[float] = None) -> None:
        event: dict[str, Any] = {}
        if keys is not None:
            event["keys"] = keys
        if prompt is not None:
            event["prompt"] = prompt
        if camera is not None:
            event["multi_modal_data"] = {"camera": camera}
        body: dict[str, Any] = {"event_id": event_id, "event": event}
        if transition_chunks is not None:
            body["transition_chunks"] = transition_chunks
        await self.send({"type": "session.interaction", "interaction": body})

    async def share(self, on: bool = True) -> None:
        """session.share (the server answers session.shared with the watch id and path), or session.unshare."""
        await self.send({"type": "session.share" if on else "session.unshare"})

    async def keepalive(self) -> None:
        """session.ping, as the protocol asks of clients that only watch."""
        await self.send({"type": "session.ping", "t": time.time()})

    async def receive_session(self, on_chunk=None, timeout: float = 600.0,
                              ping_interval: Optional[float] = 20.0) -> SessionResult:
        """Read until session.done, an error that closes, or the close, pinging every `ping_interval` s
        (None: never). on_chunk(result, meta) may be a coroutine function; it runs after each chunk's bytes
        arrived."""
        return await self._receive_with_keepalive(self._receive(on_chunk, timeout), ping_interval)

    async def _receive(self, on_chunk, timeout: float) -> SessionResult:
        import websockets
        result = SessionResult(started_at=time.monotonic())
        pending_meta, init_next = None, False
        deadline = time.monotonic() + timeout
        try:
            while True:
                raw = await asyncio.wait_for(self.ws.recv(), timeout=max(0.01, deadline - time.monotonic()))
                if isinstance(raw, bytes) and init_next:        # a viewer's init segment (announced by video.init)
                    result.init, init_next = raw, False
                    continue
                if isinstance(raw, bytes):
                    result.data.append(raw)
                    result.arrivals.append(time.monotonic())
                    result.chunks.append(pending_meta)
                    if on_chunk is not None:
                        out = on_chunk(result, pending_meta)
                        if asyncio.iscoroutine(out):
                            await out
                    continue
                msg = json.loads(raw)
                result.messages.append(msg)
                kind = msg.get("type")
                if kind in ("video.start", "watch.start"):
                    result.start = msg
                elif kind == "video.init":
                    init_next = True
                elif kind == "video.chunk_metadata":
                    pending_meta = msg
                elif kind == "session.done":
                    result.done = msg
                elif kind == "error":
                    result.error = msg
        except websockets.ConnectionClosed as e:
            result.close_code = e.rcvd.code if e.rcvd is not None else None
        return result
