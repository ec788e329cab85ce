"""A viewer's connection (`WS /v1/realtime/watch/{watch_id}`, `WS /v1/realtime_video/watch/{watch_id}`): found
by its watch id at this ingress's stage, bounded (the session's and the replica's viewers), then fed from its
queue (deployments/session/audience.py) until the stream ends, the owner unshares, or the viewer falls behind
too often. A viewer sends nothing but keepalives; anything else is refused with `viewer_read_only` (the
connection stays), counted against the same message rate as a session's client."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from ..session.audience import Ended, SharedChunk, Stage, Viewer, ViewerLimits
from ..session.codes import CLOSE_POLICY, CLOSE_TRY_AGAIN, ErrorCode, ProtocolError
from ..session.ports import ACTIVITY, ClientGone
from ..session.reading import ClientReader

log = logging.getLogger("ray.serve")


def viewer_limits(settings) -> ViewerLimits:
    return ViewerLimits(settings.viewer_queue_chunks, settings.viewer_queue_bytes, settings.viewer_max_skips)


def not_found() -> ProtocolError:
    """The same answer for every watch id that leads nowhere: never, no longer, or not on this route."""
    return ProtocolError(ErrorCode.WATCH_NOT_FOUND, "no shared session has this watch id", close=CLOSE_POLICY)


def too_many(settings, what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_MANY_VIEWERS, what, close=CLOSE_TRY_AGAIN, retry_after_s=settings.retry_after_s)


async def serve_viewer(wire, stage: Stage, settings, watch_id: str, metrics) -> None:
    """One viewer from its handshake (accepted, access checked) to its close; `metrics` (the ingress's) told the
    viewers at this replica, the bytes sent and the skips."""
    audience = stage.find(watch_id, wire.dialect)
    if audience is None and stage.relay is not None:     # shared at another replica: mirrored here
        audience = await stage.relay.mirror(watch_id, wire.dialect, stage)
    if audience is None:
        await wire.close_with(not_found())
        return
    viewer, full = await stage.join(audience, viewer_limits(settings))
    if viewer is None:
        await wire.close_with(not_found() if full == "ended" else too_many(
            settings, f"this server has {settings.max_viewers} viewers already" if full == "replica" else
            f"this session has {audience.max_viewers} viewers already"))
        return
    metrics.viewers(stage.viewers)
    lock = asyncio.Lock()                            # a keepalive's answer never splits a chunk's messages
    reader = asyncio.create_task(_read_viewer(wire, settings, lock))
    try:
        await wire.send(audience.header)
        await _feed(wire, viewer, reader, settings, lock, metrics)
    finally:
        reader.cancel()
        stage.leave(audience, viewer)
        metrics.viewers(stage.viewers)
        if viewer.skips:
            metrics.skipped(viewer.skips)
        if viewer.cut:
            metrics.refused(ErrorCode.VIEWER_TOO_SLOW)


async def _feed(wire, viewer: Viewer, reader: asyncio.Task, settings, lock: asyncio.Lock, metrics) -> None:
    """Send the viewer's queue as it fills, until the end, a cut, or the viewer leaves."""
    while True:
        item = asyncio.ensure_future(viewer.next())
        done, _ = await asyncio.wait({item, reader}, return_when=asyncio.FIRST_COMPLETED)
        if item not in done:                             # the viewer left (or a refusal closed it)
            item.cancel()
            return
        got = item.result()
        if got is None:
            await wire.close_with(ProtocolError(ErrorCode.VIEWER_TOO_SLOW, f"this viewer fell behind the stream "
                                                f"{settings.viewer_max_skips} times", close=CLOSE_POLICY))
            return
        if isinstance(got, Ended):
            await wire.viewer_end(got)
            return
        async with lock:
            sent = True
            if not viewer.sent_init and viewer.audience.init:    # unmarked: the door never drops it
                sent = await _send_all(wire, wire.viewer_init(viewer.audience.init), settings.stall_timeout_s)
                viewer.sent_init = True
            sent = sent and await _send_all(wire, got.messages, settings.stall_timeout_s, got)
        if not sent:
            return
        viewer.chunks_sent += 1
        metrics.video_bytes("viewer", got.nbytes)


async def _send_all(wire, messages: tuple, timeout_s: float, chunk: Optional[SharedChunk] = None) -> bool:
    """Each message in turn (a `chunk`'s marked for the door: its index, and on the first whether it starts with a
    keyframe); False when a send stayed blocked for stall_timeout_s (the connection is closed)."""
    try:
        for i, message in enumerate(messages):
            if chunk is None:
                await asyncio.wait_for(wire.send(message), timeout_s)
            else:
                mark = {"chunk": chunk.index, "keyframe": chunk.keyframe} if i == 0 else {"chunk": chunk.index}
                await asyncio.wait_for(wire.send_marked(message, mark), timeout_s)
        return True
    except asyncio.TimeoutError:
        await wire.close_with(ProtocolError(ErrorCode.STALL_TIMEOUT, f"the viewer read nothing for {timeout_s:g} s",
                                            close=CLOSE_POLICY))
        return False
    except (ClientGone, ConnectionError, RuntimeError):      # gone while we sent
        return False


async def _read_viewer(wire, settings, lock: asyncio.Lock) -> None:
    """A viewer's messages: keepalives answered (by the reader), anything else refused; returns when it left or a
    refusal closed it."""
    reader = ClientReader(wire, settings, lock, time.monotonic())

    async def refuse(error: ProtocolError) -> bool:
        if error.close is not None:
            await wire.close_with(error)
            return False
        async with lock:
            await wire.send_error(error)
        return True
    while True:
        msg = await reader.next_or_gone(refuse)
        if msg is None:
            return
        try:
            quiet = wire.control(msg, 0) == ACTIVITY     # the second protocol's heartbeat event
        except ProtocolError:
            quiet = False
        if not quiet and not await refuse(ProtocolError(ErrorCode.VIEWER_READ_ONLY, "a viewer sends nothing but "
                                                        "keepalives")):
            return
