"""Clients of the two realtime video protocols, for people, tests and benchmarks (docs/architecture.md, "The
protocol"). A client: it imports no Ray and nothing of the app, only the engine's controls and media helpers.

connection.py what both share (the WebSocket, keepalives, the image as a data: URL) · realtime.py the first
protocol's `RealtimeClient` (JSON + fMP4) · frames.py the second protocol's `FramesClient` (MessagePack +
frames) · cli.py the command, `python -m deployments.client URL --image first.png --prompt "..." -o out.mp4`.
"""
from .connection import WebSocketClient, image_data_url
from .frames import FrameChunk, FramesClient, FramesResult
from .realtime import RealtimeClient, SessionResult

__all__ = ["FrameChunk", "FramesClient", "FramesResult", "RealtimeClient", "SessionResult", "WebSocketClient",
           "image_data_url"]
