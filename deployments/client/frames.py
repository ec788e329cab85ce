"""The client of the second protocol, SGLang's (`/v1/realtime_video/generate`): MessagePack maps in binary
messages (init, events, heartbeats) out; frame batches back, raw, delta-gzip, WebP or JPEG, restored to
uint8 arrays chunk by chunk."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .connection import WebSocketClient


@dataclass
class FrameChunk:
    """One chunk of the second protocol, restored: its frames, the headers of its batches, its chunk_stats."""
    index: int
    frames: Any                                            # uint8 [F, H, W, 3]
    headers: list[dict] = field(default_factory=list)
    stats: Optional[dict] = None


@dataclass
class FramesResult:
    chunks: list[FrameChunk] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)    # monotonic arrival of each chunk's last batch
    messages: list[dict] = field(default_factory=list)     # every map from the server (payloads left out)
    errors: list[dict] = field(default_factory=list)
    close_code: Optional[int] = None
    close_reason: str = ""
    started_at: float = 0.0

    @property
    def frames(self):
        import numpy as np
        return np.concatenate([c.frames for c in self.chunks]) if self.chunks else None


class FramesClient(WebSocketClient):
    """A client of SGLang's realtime video protocol (`/v1/realtime_video/generate`): MessagePack maps in
    binary messages; frames come back raw, as delta-gzip, WebP or JPEG, and are restored to uint8 arrays."""
    max_size = 2 ** 28                                     # raw frame batches

    def __init__(self, url: str, open_timeout: float = 30.0, api_key: Optional[str] = None):
        super().__init__(url, open_timeout, api_key)
        self._reference = None                             # the last restored frame (delta-gzip)

    async def send(self, message: dict) -> None:
        import msgpack
        await self._send(msgpack.packb(message, use_bin_type=True))

    async def share(self, on: bool = True) -> None:
        """Make the session watchable (the server answers a `shared` map with the watch id and path), or stop."""
        await self.send({"type": "share" if on else "unshare"})

    async def init(self, prompt: str, first_frame, max_chunks: Optional[int] = None, seed: int = 0,
                   fps: Optional[float] = None, size: Optional[str] = None, actions: Optional[list] = None,
                   output_format: str = "raw", quality: Optional[int] = None, max_width: Optional[int] = None,
                   delta: bool = False, **extra) -> None:
        """`first_frame`: image bytes or a data: URL; `actions`: one key list per latent frame; `fps` None: the field
        is left out and the session runs at the server's fps."""
        msg: dict[str, Any] = {"type": "init", "model": "lingbot-world", "prompt": prompt, "first_frame": first_frame,
                               "seed": seed, "realtime_output_format": output_format, **extra}
        for key, value in (("fps", fps), ("size", size), ("max_chunks", max_chunks), ("output_compression", quality),
                           ("realtime_preview_max_width", max_width)):
            if value is not None:
                msg[key] = value
        if actions:
            msg["condition_inputs"] = {"camera_actions": actions}
        if delta:
            msg["delta_reference"] = "previous-frame"
        await self.send(msg)

    async def resume_world(self, world_id: str, max_chunks: Optional[int] = None, output_format: str = "raw",
                           **extra) -> None:
        """An init of a saved world: it goes on for `max_chunks` more chunks; its prompt, first frame, seed and
        camera are the world's."""
        msg: dict[str, Any] = {"type": "init", "model": "lingbot-world", "world_id": world_id,
                               "realtime_output_format": output_format, **extra}
        if max_chunks is not None:
            msg["max_chunks"] = max_chunks
        await self.send(msg)

    async def save(self) -> None:
        """Save the session's world: the server answers a `saved` map with its world_id and chunk_index."""
        await self.send({"type": "save"})

    async def event(self, kind: str, payload: Any = None, event_id: Optional[int] = None) -> None:
        msg: dict[str, Any] = {"type": "event", "kind": kind, "payload": payload}
        if event_id is not None:
            msg["event_id"] = event_id
        await self.send(msg)

    async def hold(self, *transitions: list, event_id: Optional[int] = None) -> None:
        """Key state: the actions held after each transition, e.g. hold(["w"]) then hold([])."""
        now = int(time.time() * 1000)
        await self.event("camera_actions", {"mode": "state", "transitions": [
            {"actions": list(t), "client_ts_ms": now} for t in transitions]}, event_id)

    async def keepalive(self) -> None:
        await self.event("heartbeat")

    def restore(self, header: dict, payload: bytes):
        """A batch's frames as uint8 [F, H, W, 3]."""
        import numpy as np

        from lingbot.io.frames import decode_images, restore_delta_gzip
        n, w, h = header["num_frames"], header["width"], header["height"]
        encoding = header.get("encoding")
        if encoding == "raw":
            frames = np.frombuffer(payload, np.uint8).reshape(n, h, w, 3)
        elif encoding == "delta-gzip":
            reference = self._reference if header.get("delta_reference") == "previous-frame" else None
            frames = restore_delta_gzip(payload, w, h, n, reference)
        else:
            frames = decode_images(payload, header["payload_lengths"])
        if len(frames):
            self._reference = frames[-1]
        return frames

    async def receive_session(self, on_chunk=None, timeout: float = 600.0,
                              heartbeat_interval: Optional[float] = 20.0) -> FramesResult:
        """Read until the server closes, sending a heartbeat event every `heartbeat_interval` s (None: never).
        on_chunk(result, chunk) may be a coroutine function; it runs when a chunk's last batch arrived."""
        return await self._receive_with_keepalive(self._receive(on_chunk, timeout), heartbeat_interval)

    async def _receive(self, on_chunk, timeout: float) -> FramesResult:
        import msgpack
        import numpy as np
        import websockets
        result = FramesResult(started_at=time.monotonic())
        header, parts, headers = None, [], []
        deadline = time.monotonic() + timeout
        try:
            while True:
                raw = await asyncio.wait_for(self.ws.recv(), timeout=max(0.01, deadline - time.monotonic()))
                if header is not None:                     # the payload that follows a frame_batch_header
                    payload, batch, header = raw, header, None
                else:
                    msg = msgpack.unpackb(raw, raw=False)
                    kind = msg.get("type")
                    payload = msg.pop("payload", None)
                    result.messages.append(msg)
                    if kind == "error":
                        result.errors.append(msg)
                    elif kind == "chunk_stats" and result.chunks:
                        result.chunks[-1].stats = msg
                    if kind == "frame_batch_header":
                        header = msg
                    if kind != "frame_batch":
                        continue
                    batch = msg
                parts.append(self.restore(batch, payload))
                headers.append(batch)
                if batch["is_final_frame_batch"]:
                    result.chunks.append(FrameChunk(batch["chunk_index"], np.concatenate(parts), headers))
                    result.arrivals.append(time.monotonic())
                    parts, headers = [], []
                    if on_chunk is not None:
                        out = on_chunk(result, result.chunks[-1])
                        if asyncio.iscoroutine(out):
                            await out
        except websockets.ConnectionClosed as e:
            result.close_code = e.rcvd.code if e.rcvd is not None else None
            result.close_reason = e.rcvd.reason if e.rcvd is not None else ""
        return result
