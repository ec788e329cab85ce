"""Sends in Serve's proxy, queued where the client's socket is and bounded in bytes: a viewer's, by whole chunks,
skipping to the next keyframe when the viewer falls behind, and a cut when it stays behind (docs/architecture.md,
"Many viewers"); a session owner's, in order, and a cut past a bound (`SendQueue`).

Behind Serve's proxy the ingress's sends never block: the proxy takes every message and Ray's stream buffers what
it has not sent. So a viewer that reads slower than the stream comes would pile its video up in the proxy until
the stall guard's timeout (front.py), and the ingress's own queue per viewer (deployments/session/audience.py)
never fills. The door therefore keeps each viewer's queue where the viewer's socket is: the ingress marks each
message of a chunk (`VIEWER_MARK`: the chunk's index, and on its first message whether a decoder can start
there); `ViewerPacer.send` queues them without waiting, and one task per viewer sends them in order. A chunk that
finds `queue_chunks` chunks (or `queue_bytes`) waiting drops them all (a skip): the viewer waits for the next
keyframe (the ingress asks the owner's encoder for one every few chunks while a session is shared). The
`max_skips`-th skip cuts the viewer. Unmarked messages (the start, the end, errors, the close) are never dropped.

Light on purpose: the proxy imports it (no torch, no dialect, no Ray at import)."""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

VIEWER_MARK = "lingbot.viewer"            # the ASGI send message's extra key: {"chunk": index, "keyframe": bool}


@dataclass(frozen=True)
class PacerLimits:
    queue_chunks: int = 4
    queue_bytes: int = 16 * 2 ** 20
    max_skips: int = 3

    def to_env(self) -> str:
        return f"{self.queue_chunks},{self.queue_bytes},{self.max_skips}"

    @classmethod
    def from_env(cls, text: str) -> PacerLimits:
        chunks, size, skips = (int(v) for v in text.split(","))
        return cls(chunks, size, skips)


def message_bytes(message: dict) -> int:
    return len(message.get("bytes") or b"") + len(message.get("text") or "")


@dataclass
class _Entry:
    """Messages sent in order: one chunk's (`chunk`), or one unmarked message."""
    messages: deque
    chunk: bool
    bytes: int = 0


class _QueuedSends:
    """A task of its own that sends what is queued, woken when more comes; `finish` once the app has ended."""

    def __init__(self, send: Callable):
        self._send = send
        self.finishing = False                    # the app has ended: the sender stops once the queue is empty
        self.wake = asyncio.Event()
        self.task = asyncio.ensure_future(self._sender())

    async def _sender(self) -> None:
        raise NotImplementedError

    async def _work(self) -> bool:
        """Wait until something is queued; False once the app has ended and nothing is (the sender stops)."""
        while not self.queue:
            if self.finishing:
                return False
            self.wake.clear()
            await self.wake.wait()
        return True

    async def finish(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) until everything queued is sent: the app has ended, its close is the last."""
        self.finishing = True
        self.wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass

    def close(self) -> None:
        self.task.cancel()


class ViewerPacer(_QueuedSends):
    """One viewer's sends, queued by whole chunks (see the module's docstring). `send` never waits; `cut()` is told
    once, when the viewer fell behind max_skips times (its connection is then cut, as the stall guard does)."""

    def __init__(self, send: Callable, limits: PacerLimits, cut: Callable[[], None],
                 skipped: Callable[[], None] = lambda: None):
        super().__init__(send)
        self.limits, self._cut, self._skipped = limits, cut, skipped
        self.queue: deque[_Entry] = deque()       # waiting to be sent, in order
        self.incoming: Optional[_Entry] = None    # the chunk whose messages are arriving (None: dropped)
        self.chunks = 0                           # whole chunks waiting in the queue
        self.bytes = 0                            # bytes held: waiting, and what is left of the one being sent
        self.waiting_for_keyframe = False
        self.skips = 0
        self.cut = False

    async def send(self, message: dict) -> None:
        if not self.cut:
            mark = message.pop(VIEWER_MARK, None)
            if mark is None:                      # the start, the end, an error, the close: never dropped
                self.incoming = None              # (a chunk's messages come together: it is whole)
                self._enqueue(_Entry(deque([message]), False, message_bytes(message)))
            elif "keyframe" in mark:              # a chunk begins
                self._begin(message, bool(mark["keyframe"]))
            elif self.incoming is not None:       # the rest of a chunk being kept
                size = message_bytes(message)
                if self.bytes + size > self.limits.queue_bytes:
                    self._skip()                  # (drops this chunk too, unless it is being sent)
                if self.incoming is not None and not self.cut:
                    self.incoming.messages.append(message)
                    self.incoming.bytes += size
                    self.bytes += size
            self.wake.set()
        await asyncio.sleep(0)                    # a turn for the sender (a sender in a loop)

    def _begin(self, message: dict, keyframe: bool) -> None:
        size = message_bytes(message)
        if self.chunks >= self.limits.queue_chunks or self.bytes + size > self.limits.queue_bytes:
            self._skip()
            if self.cut:
                return
        if self.waiting_for_keyframe and not keyframe:
            self.incoming = None
            return
        self.waiting_for_keyframe = False
        self.incoming = _Entry(deque([message]), True, size)
        self._enqueue(self.incoming)

    def _enqueue(self, entry: _Entry) -> None:
        self.queue.append(entry)
        self.bytes += entry.bytes
        self.chunks += entry.chunk

    def _skip(self) -> None:
        """Drop every waiting chunk (the unmarked messages stay); wait for a keyframe, or cut at max_skips."""
        dropped = [e for e in self.queue if e.chunk]
        self.queue = deque(e for e in self.queue if not e.chunk)
        self.bytes -= sum(e.bytes for e in dropped)
        self.chunks = 0
        if any(e is self.incoming for e in dropped):
            self.incoming = None
        self.skips += 1
        self.waiting_for_keyframe = True
        if self.skips < self.limits.max_skips:
            self._skipped()
        else:
            self.cut = True
            self.queue.clear()
            self._cut()

    async def _sender(self) -> None:
        while not self.cut:
            if not await self._work():
                return
            entry = self.queue.popleft()
            self.chunks -= entry.chunk
            while not self.cut:
                if entry.messages:
                    message = entry.messages.popleft()
                    size = message_bytes(message)
                    entry.bytes -= size
                    self.bytes -= size
                    await self._send(message)
                    if message.get("type") == "websocket.close":
                        return
                elif entry is self.incoming:      # its next message has not come yet
                    self.wake.clear()
                    await self.wake.wait()
                else:
                    break

    async def finish(self, timeout_s: float) -> None:
        self.incoming = None
        await super().finish(timeout_s)


class SendQueue(_QueuedSends):
    """A session's sends in Serve's proxy, in order, by a task of their own; `send` never waits. Without it the
    proxy's send blocks while the client does not read, and Ray's stream from the ingress buffers behind it all
    that the session makes until the stall timeout (a raw-frames session: about 19 MB a second). Past `max_bytes`
    waiting, the queue is dropped and `cut()` told once (the caller cuts the connection, as after a stall). A send
    that fails (the client gone) fails the next `send` of the app with its error."""

    def __init__(self, send: Callable, max_bytes: int, cut: Callable[[], None]):
        super().__init__(send)
        self.max_bytes, self._cut = max_bytes, cut
        self.queue: deque = deque()
        self.bytes = 0                            # waiting, and the one being sent
        self.cut = False
        self.failed: Optional[BaseException] = None

    async def send(self, message: dict) -> None:
        if self.failed is not None:
            raise self.failed
        if not self.cut:
            size = message_bytes(message)
            if self.bytes + size > self.max_bytes:
                self.cut, self.bytes = True, 0
                self.queue.clear()
                self._cut()
            else:
                self.queue.append(message)
                self.bytes += size
                self.wake.set()
        await asyncio.sleep(0)                    # a turn for the sender (a sender in a loop)

    async def _sender(self) -> None:
        while not self.cut:
            if not await self._work():
                return
            message = self.queue[0]
            try:
                await self._send(message)
            except Exception as e:                # (the client gone: the app hears it on its next send)
                self.failed, self.cut = e, True
                self.queue.clear()
                return
            if self.cut:                          # (cut while it was sent: the queue is gone)
                return
            self.queue.popleft()
            self.bytes -= message_bytes(message)
            if message.get("type") == "websocket.close":
                return
