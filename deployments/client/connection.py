"""What the clients of both protocols share: the WebSocket connection (the API key as a bearer token, no
permessage-deflate: H.264 and raw frames gain little from it), sending that drops what a closed connection
no longer takes, reading a session while a keepalive goes out, and the image as a data: URL."""
from __future__ import annotations

import asyncio
import base64
import mimetypes
from pathlib import Path
from typing import Optional


def image_data_url(path_or_bytes, mime: Optional[str] = None) -> str:
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data = bytes(path_or_bytes)
    else:
        data = Path(path_or_bytes).read_bytes()
        mime = mime or mimetypes.guess_type(str(path_or_bytes))[0]
    return f"data:{mime or 'image/png'};base64,{base64.b64encode(data).decode()}"


class WebSocketClient:
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
        """The closing handshake, reading what the server still sends meanwhile: a client that stopped reading a
        stream has a full receive queue, which stops the connection reading, so the server's close frame would
        wait behind it until the close timed out (10 s, then an abnormal close, 1006)."""
        import websockets
        closing = asyncio.ensure_future(self.ws.close())
        try:
            while not closing.done():
                await self.ws.recv()
        except (websockets.ConnectionClosed, websockets.exceptions.ConcurrencyError):
            pass                                    # closed; or another task reads, which drains it too
        await closing

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
