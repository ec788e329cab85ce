"""Spectators: one shared session's stream fanned out to the viewers at this ingress, and the stage that finds a
shared session by its watch id (docs/architecture.md, "Many viewers").

A chunk is made once. The owner's session life hands each delivered chunk to its `Audience` as a `SharedChunk`
(the viewers' messages, rendered once for all of them); `publish` never waits: each `Viewer` has its own bounded
queue (chunks and bytes) that its own socket task drains. A viewer starts at a keyframe (its first chunk is one,
the init segment before it); one whose queue is full drops what it holds and waits for the next keyframe (a
skip, counted), and one that skipped `max_skips` times is cut. The owner's pace is the only pace: nothing a
viewer does reaches the owner's session or its group, except that a viewer joining or skipping asks the
owner's encoder for a keyframe at its next chunk (`on_keyframe_wanted`, at most one request a chunk).

A watch id is the sharing replica's relay tag and 192 random bits (`secrets`), never derived from the session id;
unknown, stale and unshared ids are answered alike. With a relay (deployments/ingress/relay.py) a replica's stage
also mirrors the sessions other replicas share, for its own viewers.

Plain Python: no Ray, no Starlette."""
from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class SharedChunk:
    """One chunk as the viewers get it: `messages` ready for the viewers' wire (metadata and bytes, nothing the
    owner sent), `keyframe` whether a decoder can start at it."""
    index: int
    keyframe: bool
    messages: tuple
    nbytes: int


@dataclass(frozen=True)
class Ended:
    """The stream is over: the session ended (`stopped` by its owner or not, `chunks` delivered) or was unshared."""
    chunks: int
    stopped: bool
    unshared: bool = False


@dataclass
class ViewerLimits:
    queue_chunks: int = 4              # chunks a viewer may hold unsent
    queue_bytes: int = 8 * 2 ** 20     # bytes a viewer may hold unsent
    max_skips: int = 3                 # a viewer that fell behind this often is cut


class Viewer:
    """One viewer's queue: what it has not been sent yet, from its first keyframe on."""

    def __init__(self, audience: Audience, limits: ViewerLimits):
        self.audience = audience
        self.limits = limits
        self.queue: deque[SharedChunk] = deque()
        self.queued_bytes = 0
        self.waiting_for_keyframe = True   # a viewer starts at a keyframe, and again after each skip
        self.sent_init = False
        self.skips = 0
        self.cut = False                   # fell behind max_skips times: the socket task closes it
        self.ended: Optional[Ended] = None
        self.chunks_sent = 0
        self.wake = asyncio.Event()

    def offer(self, chunk: SharedChunk) -> None:
        """Queue `chunk` (never waits). A viewer waiting for a keyframe takes only a keyframe; a full queue is
        dropped whole, and the viewer waits for the next keyframe (a skip), or is cut after max_skips."""
        if self.cut or self.ended is not None:
            return
        if self.waiting_for_keyframe and not chunk.keyframe:
            self.audience.want_keyframe()
            return
        if len(self.queue) >= self.limits.queue_chunks or self.queued_bytes + chunk.nbytes > self.limits.queue_bytes:
            self.queue.clear()
            self.queued_bytes = 0
            self.skips += 1
            self.audience.skips += 1
            if self.skips >= self.limits.max_skips:
                self.cut = True
            else:
                self.waiting_for_keyframe = True
                self.audience.want_keyframe()
            self.wake.set()
            return
        self.waiting_for_keyframe = False
        self.queue.append(chunk)
        self.queued_bytes += chunk.nbytes
        self.wake.set()

    def finish(self, ended: Ended) -> None:
        self.ended = ended
        self.wake.set()

    async def next(self) -> Any:
        """The next thing to send: a SharedChunk, else Ended once the queue is empty, or None when it was cut."""
        while True:
            if self.cut:
                return None
            if self.queue:
                chunk = self.queue.popleft()
                self.queued_bytes -= chunk.nbytes
                return chunk
            if self.ended is not None:
                return self.ended
            self.wake.clear()
            await self.wake.wait()


@dataclass
class Audience:
    """One shared session's viewers at this ingress. `header` is what a viewer is told first (the stream's kind,
    size, rate and mime); `init` the fMP4 init segment (b"" for frame batches)."""
    watch_id: str
    dialect: str                       # the owner's protocol: its viewers watch on that protocol's route
    header: dict
    init: bytes
    max_viewers: int
    on_keyframe_wanted: Callable[[], None] = lambda: None
    viewers: set = field(default_factory=set)
    skips: int = 0                     # viewers that fell behind and skipped to a keyframe
    cuts: int = 0                      # viewers cut for staying behind
    bytes_out: int = 0                 # bytes queued for viewers
    _asked: bool = False               # a keyframe is asked for and not published yet
    ended: Optional[Ended] = None
    mirror: bool = False               # another replica's shared session, fed through its relay (ingress/relay.py)
    remote_viewers: int = 0            # (the owner's replica) its viewers at other replicas, as its post last said

    @property
    def watching(self) -> int:
        """The session's viewers as far as this replica knows: its own, and (the owner's) those elsewhere."""
        return len(self.viewers) + self.remote_viewers

    def join(self, limits: ViewerLimits) -> Optional[Viewer]:
        """A new viewer (None when the session has max_viewers already). It asks for a keyframe."""
        if self.ended is not None or self.watching >= self.max_viewers:
            return None
        viewer = Viewer(self, limits)
        self.viewers.add(viewer)
        self.want_keyframe()
        return viewer

    def leave(self, viewer: Viewer) -> None:
        self.viewers.discard(viewer)
        self.cuts += viewer.cut

    def want_keyframe(self) -> None:
        if not self._asked:
            self._asked = True
            self.on_keyframe_wanted()

    def publish(self, chunk: SharedChunk) -> None:
        """Offer a delivered chunk to every viewer (never waits)."""
        if chunk.keyframe:
            self._asked = False
        for viewer in list(self.viewers):
            before = viewer.queued_bytes
            viewer.offer(chunk)
            self.bytes_out += max(0, viewer.queued_bytes - before)

    def end(self, ended: Ended) -> None:
        self.ended = ended
        for viewer in list(self.viewers):
            viewer.finish(ended)


def new_watch_id(prefix: str = "") -> str:
    """`prefix` (the replica's relay tag: where the session is shared) and 192 random bits, URL-safe (32
    characters)."""
    return prefix + secrets.token_urlsafe(24)


class Stage:
    """The shared sessions of one ingress replica, by watch id, and its bound on viewers in all. With a `relay`
    (deployments/ingress/relay.py) viewers at other replicas watch this replica's sessions and this replica's
    viewers watch theirs: it is told what the owners share, publish and end here, and it mirrors other replicas'
    sessions into this stage."""

    def __init__(self, max_viewers: int, relay: Any = None):
        self.max_viewers = max_viewers
        self.audiences: dict[str, Audience] = {}
        self.relay = relay

    @property
    def viewers(self) -> int:
        return sum(len(a.viewers) for a in self.audiences.values())

    def open(self, dialect: str, header: dict, init: bytes, max_viewers: int,
             on_keyframe_wanted: Callable[[], None]) -> Audience:
        audience = Audience(new_watch_id(self.relay.tag if self.relay else ""), dialect, header, init, max_viewers,
                            on_keyframe_wanted)
        self.audiences[audience.watch_id] = audience
        if self.relay is not None:
            self.relay.opened(audience)
        return audience

    def publish(self, audience: Audience, chunk: SharedChunk) -> None:
        """An owner's chunk to its viewers here and, through the relay, at other replicas (never waits)."""
        audience.publish(chunk)
        if self.relay is not None:
            self.relay.published(audience, chunk)

    def init_known(self, audience: Audience, init: bytes) -> None:
        audience.init = init
        if self.relay is not None:
            self.relay.init_known(audience)

    async def join(self, audience: Audience, limits: ViewerLimits) -> tuple[Optional[Viewer], str]:
        """A new viewer of `audience` here, or None and what is full ("replica", "session") or "ended". A viewer of a
        mirror takes its seat at the owner's replica first (the session's bound holds over every replica); the
        owner's replica tells the others how many watch it here."""
        if self.viewers >= self.max_viewers:
            self.left(audience)
            return None, "replica"
        if audience.mirror and (self.relay is None or not await self.relay.seat(audience)):
            self.left(audience)
            return None, "ended" if audience.ended is not None else "session"
        viewer = audience.join(limits)
        if viewer is None:
            self.leave(audience, None)
            return None, "ended" if audience.ended is not None else "session"
        if self.relay is not None and not audience.mirror:
            self.relay.counted(audience)
        return viewer, ""

    def leave(self, audience: Audience, viewer: Optional[Viewer]) -> None:
        """A viewer `join` let in left (None: `join` took its seat but could not let it in)."""
        if viewer is not None:
            audience.leave(viewer)
        if self.relay is not None:
            if audience.mirror:
                self.relay.unseat(audience)
            elif viewer is not None:
                self.relay.counted(audience)
        self.left(audience)

    def left(self, audience: Audience) -> None:
        """A viewer left: a mirror without viewers stops (its subscription at the owner's replica ends)."""
        if audience.mirror and not audience.viewers and self.audiences.get(audience.watch_id) is audience:
            del self.audiences[audience.watch_id]
            if self.relay is not None:
                self.relay.unmirror(audience)

    def find(self, watch_id: str, dialect: str) -> Optional[Audience]:
        """The live audience of `watch_id` on that protocol's route; None for any other (unknown, ended,
        unshared, or the other protocol's), alike."""
        audience = self.audiences.get(watch_id)
        return audience if audience is not None and audience.dialect == dialect and audience.ended is None else None

    def close(self, audience: Audience, ended: Ended) -> None:
        """The audience's end: every viewer is told, the watch id dies."""
        audience.end(ended)
        if self.audiences.get(audience.watch_id) is audience:
            del self.audiences[audience.watch_id]
        if self.relay is not None and not audience.mirror:
            self.relay.closed(audience, ended)
