"""GET /v1/recordings/{id} (the MP4, with byte ranges) and /v1/recordings/{id}/journal (the world's journal, JSON):
a finished recording, keyed like the session that made it (deployments/session/recording.py).

With api_keys a key is presented (401 otherwise) and must be the one that started the session; an unknown,
unfinished, expired or another key's recording is answered alike (404 recording_not_found). A `Range: bytes=`
header with one range is answered 206 with that part (416 range_not_satisfiable past the end); several ranges
are answered with the whole file (RFC 9110 lets a server ignore them). The body is read from the store in
pieces, off the event loop, whatever the store (a folder or object storage)."""
from __future__ import annotations

import asyncio
import re
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..session.codes import ErrorCode
from ..session.recording import Recordings
from .access import presented_key

PIECE_BYTES = 2 ** 20
RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class RangeNotSatisfiable(ValueError):
    pass


def byte_range(header: Optional[str], size: int) -> Optional[tuple[int, int]]:
    """The [start, end) a Range header asks of `size` bytes; None: the whole file (no header, several ranges or
    another unit); RangeNotSatisfiable where it starts past the end."""
    if not header:
        return None
    match = RANGE.fullmatch(header.strip())
    if match is None or (not match[1] and not match[2]):
        return None
    if not match[1]:                                 # the last N bytes
        suffix = int(match[2])
        if suffix == 0:
            raise RangeNotSatisfiable(header)
        return max(0, size - suffix), size
    start = int(match[1])
    end = size if not match[2] else min(size, int(match[2]) + 1)
    if start >= size or end <= start:
        raise RangeNotSatisfiable(header)
    return start, end


def _refusal(code: ErrorCode, message: str, status: int, **headers) -> JSONResponse:
    return JSONResponse({"error": code.value, "message": message}, status_code=status, headers=headers)


async def serve_recording(recordings: Optional[Recordings], request: Request, recording_id: str, api_keys,
                          journal: bool = False) -> Response:
    if recordings is None:
        return _refusal(ErrorCode.RECORDING_UNAVAILABLE, "this deployment keeps no recordings (recordings_dir)", 503)
    key = presented_key(dict(request.headers), {}, api_keys)   # (headers only)
    if key is None:
        return _refusal(ErrorCode.UNAUTHORIZED, "a valid API key is required", 401)
    meta = await asyncio.to_thread(recordings.described, recording_id, f"key:{key}" if key else "")
    if meta is None:
        return _refusal(ErrorCode.RECORDING_NOT_FOUND, "no recording has this id (unknown, unfinished or expired)",
                        404)
    store = recordings.store
    name = f"{recording_id}.json" if journal else f"{recording_id}.mp4"
    size = await asyncio.to_thread(store.size, name)
    if size is None:                                 # deleted by a sweep since its description was read
        return _refusal(ErrorCode.RECORDING_NOT_FOUND, "no recording has this id (unknown, unfinished or expired)",
                        404)
    headers = {"Accept-Ranges": "bytes", "Cache-Control": "private, max-age=3600"}
    try:
        wanted = byte_range(request.headers.get("range"), size)
    except RangeNotSatisfiable:
        return _refusal(ErrorCode.RANGE_NOT_SATISFIABLE, f"the recording has {size} bytes", 416,
                        **{"Content-Range": f"bytes */{size}"})
    start, end = wanted if wanted is not None else (0, size)
    headers["Content-Length"] = str(end - start)
    if wanted is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"

    async def pieces():
        at = start
        while at < end:
            piece = await asyncio.to_thread(store.read_range, name, at, min(end, at + PIECE_BYTES))
            if not piece:
                return
            at += len(piece)
            yield piece

    return StreamingResponse(pieces(), status_code=206 if wanted is not None else 200, headers=headers,
                             media_type="application/json" if journal else "video/mp4")
