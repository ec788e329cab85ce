"""A client of both realtime video protocols: `python -m lingbot.client ws://host:8000/v1/realtime/video
--image first.png --prompt "..." --keys "w,w,wa,,j" --chunks 4 -o out.mp4`.

vllm (/v1/realtime/video): sends session.start (the image as a data: URL) with the keys as its action
script, and writes the fMP4 stream to a file as it arrives. sglang (/v1/realtime_video/generate): sends
an init (MessagePack, the image bytes, the keys as condition_inputs.camera_actions), restores the raw,
delta-gzip, WebP or JPEG frames, and writes them as MP4 (encoded here) or .npy. Both show a progress bar.
Also a library: `RealtimeClient` and `FramesClient` for tests and benchmarks. Connects without
permessage-deflate (H.264 and raw frames gain little from it).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import mimetypes
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .camera import parse_key_script
from .config import LINGBOT_GEOMETRY


def image_data_url(path_or_bytes, mime: Optional[str] = None) -> str:
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data = bytes(path_or_bytes)
    else:
        data = Path(path_or_bytes).read_bytes()
        mime = mime or mimetypes.guess_type(str(path_or_bytes))[0]
    return f"data:{mime or 'image/png'};base64,{base64.b64encode(data).decode()}"


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

    @property
    def video(self) -> bytes:
        return b"".join(self.data)


class _WebSocketClient:
    """What both protocols' clients share: the connection (API key as a bearer token, no permessage-deflate)
    and reading a session while a keepalive goes out every so often."""
    max_size = 2 ** 26                                     # the largest message accepted from the server

    def __init__(self, url: str, open_timeout: float = 30.0, api_key: Optional[str] = None):
        self.url = url
        self.open_timeout = open_timeout
        self.api_key = api_key
        self.ws = None

    async def __aenter__(self):
        import websockets
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self.ws = await websockets.connect(self.url, compression=None, max_size=self.max_size,
                                           open_timeout=self.open_timeout, additional_headers=headers)
        return self

    async def __aexit__(self, *exc):
        await self.ws.close()

    async def _send(self, data) -> None:
        """Send one message. A message the server closed the connection before is dropped: the server may
        refuse a session (a missing key, no capacity) before the client's first message goes out, and the
        close it sent is what reading the session reports."""
        import websockets
        try:
            await self.ws.send(data)
        except websockets.ConnectionClosed:
            pass

    async def keepalive(self) -> None:
        """The protocol's keepalive message."""
        raise NotImplementedError

    async def _keepalive_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.keepalive()

    async def _receive_with_keepalive(self, receive, interval: Optional[float]):
        """Await `receive` (a coroutine reading the session) while a keepalive goes out every `interval` s."""
        keepalive = asyncio.create_task(self._keepalive_every(interval)) if interval else None
        try:
            return await receive
        finally:
            if keepalive is not None:
                keepalive.cancel()


class RealtimeClient(_WebSocketClient):
    async def send(self, message: dict) -> None:
        await self._send(json.dumps(message))

    async def start(self, prompt: str, image_url: str, width: int, height: int, chunks: Optional[int] = None,
                    fps: float = 16.0, seed: int = 0, script: Optional[list] = None, **extra) -> None:
        msg = {"type": "session.start", "model": "lingbot-world", "prompt": prompt,
               "image_reference": {"image_url": image_url}, "width": width, "height": height, "fps": fps,
               "seed": seed, "extra_params": dict(extra)}
        if chunks is None:
            msg["extra_params"]["endless"] = True
        else:
            msg["num_frames"] = LINGBOT_GEOMETRY.video_frames(chunks)
        if script:
            msg["extra_params"]["camera_action_script"] = script
        await self.send(msg)

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
        pending_meta = None
        deadline = time.monotonic() + timeout
        try:
            while True:
                raw = await asyncio.wait_for(self.ws.recv(), timeout=max(0.01, deadline - time.monotonic()))
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
                if kind == "video.start":
                    result.start = msg
                elif kind == "video.chunk_metadata":
                    pending_meta = msg
                elif kind == "session.done":
                    result.done = msg
                elif kind == "error":
                    result.error = msg
        except websockets.ConnectionClosed as e:
            result.close_code = e.rcvd.code if e.rcvd is not None else None
        return result


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


class FramesClient(_WebSocketClient):
    """A client of SGLang's realtime video protocol (`/v1/realtime_video/generate`): MessagePack maps in
    binary messages; frames come back raw, as delta-gzip, WebP or JPEG, and are restored to uint8 arrays."""
    max_size = 2 ** 28                                     # raw frame batches

    def __init__(self, url: str, open_timeout: float = 30.0, api_key: Optional[str] = None):
        super().__init__(url, open_timeout, api_key)
        self._reference = None                             # the last restored frame (delta-gzip)

    async def send(self, message: dict) -> None:
        import msgpack
        await self._send(msgpack.packb(message, use_bin_type=True))

    async def init(self, prompt: str, first_frame, max_chunks: Optional[int] = None, seed: int = 0,
                   fps: float = 16.0, size: Optional[str] = None, actions: Optional[list] = None,
                   output_format: str = "raw", quality: Optional[int] = None, max_width: Optional[int] = None,
                   delta: bool = False, **extra) -> None:
        """`first_frame`: image bytes or a data: URL; `actions`: one key list per latent frame."""
        msg: dict[str, Any] = {"type": "init", "model": "lingbot-world", "prompt": prompt, "first_frame": first_frame,
                               "fps": fps, "seed": seed, "realtime_output_format": output_format, **extra}
        for key, value in (("size", size), ("max_chunks", max_chunks), ("output_compression", quality),
                           ("realtime_preview_max_width", max_width)):
            if value is not None:
                msg[key] = value
        if actions:
            msg["condition_inputs"] = {"camera_actions": actions}
        if delta:
            msg["delta_reference"] = "previous-frame"
        await self.send(msg)

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

        from .io.frames import decode_images, restore_delta_gzip
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


def protocol_of(url: str, protocol: str) -> str:
    if protocol != "auto":
        return protocol
    return "sglang" if "/realtime_video/" in url else "vllm"


async def _main_frames(args, script: list) -> int:
    """--protocol sglang: frames restored on this side, written as H.264 MP4 (or .npy for the exact uint8)."""
    import numpy as np
    from tqdm import tqdm

    from .io.video import H264Writer
    actions = [list(k) for chunk in script for k in chunk]
    while actions and not actions[-1]:
        actions.pop()
    async with FramesClient(args.url, api_key=args.api_key) as client:
        await client.init(args.prompt, Path(args.image).read_bytes(), args.chunks, args.seed, args.fps,
                          actions=actions, output_format=args.format, delta=args.delta)
        bar = tqdm(total=args.chunks, unit="chunk", desc="receiving", file=sys.stderr)
        state: dict[str, Any] = {}

        def on_chunk(result, chunk):
            if not args.output.endswith(".npy"):
                if "writer" not in state:
                    h, w = chunk.frames.shape[1:3]
                    state["writer"] = H264Writer(args.output, w, h, args.fps)
                state["writer"].write(chunk.frames)
            bar.update()
            if len(result.arrivals) == 1:
                bar.set_postfix(ttfc=f"{result.arrivals[0] - result.started_at:.2f}s")
        result = await client.receive_session(on_chunk)
        bar.close()
    if "writer" in state:
        state["writer"].close()
    if result.errors:
        error = result.errors[-1]
        print(f"server error {error.get('code')}: {error.get('content')}", file=sys.stderr)
        return 1
    if result.close_code != 1000:
        print(f"server closed the session: {result.close_code} {result.close_reason}", file=sys.stderr)
        return 1
    if args.output.endswith(".npy") and result.chunks:
        np.save(args.output, result.frames)
    frames = sum(len(c.frames) for c in result.chunks)
    print(f"wrote {len(result.chunks)} chunks, {frames} frames ({args.format}) to {args.output}")
    return 0


async def _main(args) -> int:
    from PIL import Image
    from tqdm import tqdm
    Image.open(args.image).verify()
    script = parse_key_script(args.keys, args.chunks, LINGBOT_GEOMETRY.latent_frames)
    if protocol_of(args.url, args.protocol) == "sglang":
        if args.poses or args.intrinsics:
            raise ValueError("--poses/--intrinsics travel over the vllm protocol only (/v1/realtime/video)")
        return await _main_frames(args, script)
    async with RealtimeClient(args.url, api_key=args.api_key) as client:
        width, height = args.width, args.height
        if width is None or height is None:
            import urllib.request
            http = args.url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0]
            with urllib.request.urlopen(f"{http}/v1/config", timeout=10) as r:
                served = json.loads(r.read())
            width, height = served["width"], served["height"]
        script = [list(keys) for keys in script]
        extra = {}
        if args.poses or args.intrinsics:
            if not (args.poses and args.intrinsics):
                raise ValueError("--poses and --intrinsics go together")
            if args.keys:
                raise ValueError("--keys and --poses both drive the camera; give one")
            import numpy as np
            extra["camera_trajectory"] = {"poses": np.load(args.poses, allow_pickle=False).tolist(),
                                          "intrinsics": np.load(args.intrinsics, allow_pickle=False).tolist()}
            script = None
        await client.start(args.prompt, image_data_url(args.image), width, height, args.chunks, args.fps, args.seed,
                           script=script, **extra)
        out = open(args.output, "wb")
        bar = tqdm(total=args.chunks, unit="chunk", desc="receiving", file=sys.stderr)

        def on_chunk(result, meta):
            out.write(result.data[-1])
            out.flush()
            bar.update()
            if len(result.arrivals) == 1:
                bar.set_postfix(ttfc=f"{result.arrivals[0] - result.started_at:.2f}s")
        result = await client.receive_session(on_chunk)
        bar.close()
        out.close()
    if result.error is not None:
        print(f"server error {result.error.get('code')}: {result.error.get('message')}", file=sys.stderr)
        return 1
    frames = sum(c["num_frames"] for c in result.chunks)
    print(f"wrote {len(result.chunks)} chunks, {frames} frames, {len(result.video)} bytes to {args.output}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lingbot.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="ws://host:8000/v1/realtime/video (or /v1/realtime_video/generate)")
    p.add_argument("--protocol", default="auto", choices=("auto", "vllm", "sglang"),
                   help="vllm: JSON + fMP4 (/v1/realtime/video); sglang: MessagePack + frames "
                        "(/v1/realtime_video/generate); auto: from the URL's path")
    p.add_argument("--format", default="raw", choices=("raw", "webp", "jpeg"),
                   help="sglang: how frames travel (raw is the model's exact uint8 output)")
    p.add_argument("--delta", action="store_true", help="sglang, raw: XOR with the previous frame, gzipped")
    p.add_argument("--image", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--keys", default="", help='one key set per latent frame, e.g. "w,w,wa,,j"')
    p.add_argument("--poses", default=None, help="offline camera path: .npy [F, 4, 4] camera-to-world per video "
                                                 "frame (sent as extra_params.camera_trajectory)")
    p.add_argument("--intrinsics", default=None, help="with --poses: .npy [F, 4] fx, fy, cx, cy at 832x480")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fps", type=float, default=16.0)
    p.add_argument("--width", type=int, default=None, help="default: the server's size (GET /v1/config)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--api-key", default=os.environ.get("LINGBOT_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $LINGBOT_API_KEY)")
    p.add_argument("-o", "--output", required=True,
                   help="output .mp4 (vllm: the fMP4 stream as sent; sglang: the frames encoded here), or .npy "
                        "(sglang: the uint8 frames)")
    args = p.parse_args(argv)
    if args.chunks < 1:
        p.error("--chunks must be >= 1")
    try:
        return asyncio.run(_main(args))
    except (OSError, ValueError) as e:
        print(f"lingbot.client: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
