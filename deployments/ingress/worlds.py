"""GET /v1/worlds (the client's saved worlds, newest first), GET /v1/worlds/{id}/frame (a world's first frame as a
PNG: the page's thumbnail) and DELETE /v1/worlds/{id} (deployments/session/worlds.py).

With api_keys a key is presented (401 otherwise) and a world is the key's that saved it: another key's world is
answered like one that does not exist (404 world_not_found), and never listed. Without keys every world is
nobody's: listed to anyone, found by its id. The store is read off the event loop, on the worlds' thread."""
from __future__ import annotations

import asyncio
import io
from typing import Optional

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..session.codes import ErrorCode
from ..session.worlds import Worlds
from .access import presented_key


def _refusal(code: ErrorCode, message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": code.value, "message": message}, status_code=status)


def _tenant(request: Request, api_keys) -> Optional[str]:
    key = presented_key(dict(request.headers), {}, api_keys)   # (headers only)
    return None if key is None else (f"key:{key}" if key else "")


async def answer_worlds(worlds: Optional[Worlds], request: Request, api_keys, world_id: Optional[str] = None,
                        what: str = "list") -> Response:
    """`what`: list (the tenant's worlds), frame (a world's first frame, PNG) or delete."""
    if worlds is None:
        return _refusal(ErrorCode.WORLDS_OFF, "this deployment keeps no worlds (worlds_dir is empty)", 404)
    tenant = _tenant(request, api_keys)
    if tenant is None:
        return _refusal(ErrorCode.UNAUTHORIZED, "a valid API key is required", 401)
    loop = asyncio.get_running_loop()
    try:
        if what == "list":
            return JSONResponse({"worlds": await loop.run_in_executor(worlds.executor, worlds.listing, tenant)})
        if what == "delete":
            if await loop.run_in_executor(worlds.executor, worlds.delete, world_id, tenant):
                return Response(status_code=204)
        else:
            image = await loop.run_in_executor(worlds.executor, worlds.first_frame, world_id, tenant)
            if image is not None:
                return Response(png(image), media_type="image/png", headers={"Cache-Control": "private, max-age=3600"})
    except OSError:
        return _refusal(ErrorCode.WORLD_UNAVAILABLE, "the world store cannot be read now", 503)
    return _refusal(ErrorCode.WORLD_NOT_FOUND, "no world has this id", 404)


def png(image: np.ndarray) -> bytes:
    """A first frame (float32 [3, H, W] in [-1, 1]) as PNG bytes."""
    from PIL import Image
    rgb = ((np.clip(image, -1.0, 1.0) + 1.0) * 127.5).round().astype(np.uint8).transpose(1, 2, 0)
    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()
