"""What both wire dialects share on a Starlette WebSocket: raw sends, bounded closes, and reading one message
(a disconnect becomes the session layer's ClientGone). Each dialect (vllm.py, sglang.py) adds its codec."""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import WebSocket

from ..session.codes import ProtocolError
from ..session.ports import ClientGone
from .closing import close_quietly
from .pacing_door import VIEWER_MARK
from .parsing import INLINE_DECODE_BYTES


class WebSocketWire:
    """The Starlette side of a Wire (deployments/session/ports.py); subclasses are the dialects."""

    def __init__(self, ws: WebSocket, settings, fetcher=None):
        self.ws = ws
        self.settings = settings
        self.fetcher = fetcher

    async def send(self, data) -> None:
        if isinstance(data, (bytes, bytearray)):
            await self.ws.send_bytes(data)
        elif isinstance(data, str):               # rendered once already (a viewer's message)
            await self.ws.send_text(data)
        else:
            await self.ws.send_json(data)

    async def send_marked(self, data, mark: dict) -> None:
        """One message of a viewer's chunk, with the mark the door in Serve's proxy reads (pacing_door.py); any
        other server ignores the extra key."""
        key = "bytes" if isinstance(data, (bytes, bytearray)) else "text"
        await self.ws.send({"type": "websocket.send", key: data, VIEWER_MARK: mark})

    async def receive(self, timeout: float) -> dict:
        """The next ASGI message ("text" or "bytes"), not decoded (the dialect's `decode`); ClientGone when the
        client closed or left."""
        message = await asyncio.wait_for(self.ws.receive(), timeout=timeout)
        if message["type"] == "websocket.disconnect":
            raise ClientGone(message.get("code", 1000))
        return message

    @staticmethod
    async def _decoded(decode, payload, limit: int, containers: int) -> dict:
        """decode(payload, limit, containers): off the event loop when the payload is large (a start with its image,
        a large control), at once otherwise."""
        if len(payload) > INLINE_DECODE_BYTES:
            return await asyncio.to_thread(decode, payload, limit, containers)
        return decode(payload, limit, containers)

    def error_close(self, error: ProtocolError) -> tuple[Optional[object], str]:
        """(message to send before the close, or None; the close reason) for a refusal that closes."""
        raise NotImplementedError

    async def close_with(self, error: ProtocolError) -> None:
        message, reason = self.error_close(error)
        await close_quietly(self.ws, message, error.close, reason)

    def keepalive_reply(self, msg: dict) -> Optional[dict]:
        return None

    def queued(self, interaction) -> Optional[dict]:
        return None
