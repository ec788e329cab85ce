"""A refusal on the wire, light enough for Serve's proxy to import (front.py; the dialects use it too): the error
message the second protocol sends, and a close bounded in time. No torch, no dialect, no Ray."""
from __future__ import annotations

import asyncio

import msgpack

from ..session.codes import ProtocolError

CLOSE_TIMEOUT_S = 5.0                     # a clogged socket (a client that stopped reading) may never take the close


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def error_message(error: ProtocolError) -> bytes:
    """{"type": "error", "content": ...} as SGLang sends it, with our stable code beside it."""
    return pack({"type": "error", "content": error.message, "code": error.code,
                 **{k: v for k, v in error.extra.items() if v is not None}})


MAX_REASON_BYTES = 123                    # a close frame's reason: 125 bytes of payload less the code's 2


def close_reason(text: str) -> str:
    """`text` cut to what a close frame carries: at most MAX_REASON_BYTES of UTF-8, never inside a character (a
    reason built from a client's text may be any script; cut by characters, 120 of them can be 480 bytes, and the
    close fails)."""
    return text.encode()[:MAX_REASON_BYTES].decode(errors="ignore")


async def close_quietly(ws, message, code: int, reason: str = "") -> None:
    """Send `message` (a JSON map, bytes, or None) on Starlette WebSocket `ws`, then close; bounded in time, never
    raising."""
    async def close():
        if isinstance(message, (bytes, bytearray)):
            await ws.send_bytes(message)
        elif message is not None:
            await ws.send_json(message)
        await ws.close(code=code, reason=close_reason(reason))
    try:
        await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
    except Exception:
        pass
