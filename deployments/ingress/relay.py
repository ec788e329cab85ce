"""Viewers at any ingress replica: a shared session's chunks reach viewers on other replicas (and nodes) through one
subscription per replica per session, never by asking the group again (docs/architecture.md, "Many viewers").

Each ingress replica has a `WatchPost` actor (named by the replica's tag, which starts every watch id it hands
out) and a `Relay` beside its stage. The owner's replica tells its post what it shares (`open`, the init segment,
`close` with the end); a viewer whose watch id another replica handed out makes this replica subscribe at that
replica's post once (a streaming call: the stream's start, then each chunk as the owner's replica publishes it,
then its end) and mirror the session into its own stage, where every local viewer of it gets its own bounded
queue as on the owner's replica. The owner's replica publishes a chunk to its post only while some replica
subscribes (the post tells it, with the keyframes other replicas' viewers ask for, through one long poll). When a
mirror's last viewer leaves, its subscription ends.

The session's bound on viewers holds over every replica: a viewer of a mirror takes a seat at the owner's post
first (one Ray call when it joins, one when it leaves), where the owner's replica's own count is told too; the
owner's replica learns the seats taken elsewhere through its long poll, for its own bound and the count its
owner is shown.

One Ray call per chunk per shared session with remote viewers, one streamed item per subscribing replica: no
per-viewer Ray call. A subscribing replica that falls behind (more than SUBSCRIBER_CHUNKS unread) loses what is
queued for it and its viewers wait for the next keyframe, as a slow viewer does."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from ..detach import fresh_task, outside_the_request
from ..session.audience import Audience, Ended, SharedChunk, Stage

log = logging.getLogger("ray.serve")

NAMESPACE = "lingbot-watch"
TAG_CHARS = 8
SUBSCRIBER_CHUNKS = 8          # chunks a subscribing replica may leave unread at the post
SEAT_TIMEOUT_S = 10.0          # a viewer's seat at the owner's post: not granted when the post does not answer
POLL_S = 30.0                  # the owner's long poll returns at least this often


@dataclass(frozen=True)
class Gap:
    """What a subscribing replica gets when it fell behind: its viewers wait for the next keyframe."""


@dataclass
class _PostedStream:
    dialect: str
    header: Any
    init: bytes
    max_viewers: int
    subscribers: set = field(default_factory=set)          # one asyncio.Queue per subscribing replica
    keyframe: bool = False                                  # a viewer elsewhere waits for one
    local: int = 0                                          # the owner's replica's own viewers, as it told
    seats: dict = field(default_factory=dict)               # replica tag -> its viewers of this session


def _offer(queue: asyncio.Queue, item) -> None:
    if queue.full():                                        # the subscriber fell behind: it skips to a keyframe
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(Gap())
    queue.put_nowait(item)


class WatchPost:
    """One replica's shared sessions, for the other replicas' viewers (a Ray actor; its methods run on one loop).
    An async actor may start calls out of their order, so the owner's replica numbers what it tells about each
    session (`tell`: open, init, publish, close) and the post applies them in that order."""

    def __init__(self):
        self.streams: dict[str, _PostedStream] = {}
        self.changed: Optional[asyncio.Event] = None
        self.next: dict[str, int] = {}                      # watch id -> the number of the next call to apply
        self.early: dict[str, dict[int, tuple]] = {}        # watch id -> calls that came before their turn

    async def tell(self, watch_id: str, number: int, what: str, *args) -> None:
        """Call `what` (open, init, publish, close) with `args` as the owner's replica's `number`-th about
        `watch_id` (from 0), once every call before it was applied."""
        early = self.early.setdefault(watch_id, {})
        early[number] = (what, args)
        while self.next.get(watch_id, 0) in early:
            what, args = early.pop(self.next.get(watch_id, 0))
            self.next[watch_id] = self.next.get(watch_id, 0) + 1
            await getattr(self, what)(watch_id, *args)
        if what == "close" and not early:
            self.next.pop(watch_id, None)
            self.early.pop(watch_id, None)

    def _changed(self) -> None:
        if self.changed is None:
            self.changed = asyncio.Event()
        self.changed.set()

    async def open(self, watch_id: str, dialect: str, header: Any, init: bytes, max_viewers: int) -> None:
        self.streams[watch_id] = _PostedStream(dialect, header, init, max_viewers)

    async def init(self, watch_id: str, init: bytes) -> None:
        stream = self.streams.get(watch_id)
        if stream is not None:
            stream.init = init
            for queue in stream.subscribers:
                _offer(queue, init)

    async def publish(self, watch_id: str, chunk: SharedChunk) -> None:
        stream = self.streams.get(watch_id)
        for queue in (stream.subscribers if stream is not None else ()):
            _offer(queue, chunk)

    async def close(self, watch_id: str, ended: Ended) -> None:
        stream = self.streams.pop(watch_id, None)
        for queue in (stream.subscribers if stream is not None else ()):
            _offer(queue, ended)
        self._changed()

    async def viewers(self, watch_id: str, local: int) -> None:
        stream = self.streams.get(watch_id)
        if stream is not None:
            stream.local = local

    async def seat(self, watch_id: str, tag: str) -> bool:
        """A viewer at replica `tag` may watch `watch_id`: False when it is not shared here or has max_viewers."""
        stream = self.streams.get(watch_id)
        if stream is None or stream.local + sum(stream.seats.values()) >= stream.max_viewers:
            return False
        stream.seats[tag] = stream.seats.get(tag, 0) + 1
        self._changed()
        return True

    async def unseat(self, watch_id: str, tag: str) -> None:
        stream = self.streams.get(watch_id)
        if stream is not None and stream.seats.get(tag, 0) > 0:
            stream.seats[tag] -= 1
            self._changed()

    async def want_keyframe(self, watch_id: str) -> None:
        if watch_id in self.streams:
            self.streams[watch_id].keyframe = True
            self._changed()

    async def subscribe(self, watch_id: str, tag: str = ""):
        """The stream of `watch_id` for replica `tag`: (dialect, header, init, max_viewers) first (None: not shared
        here), then chunks, init segments, gaps, and its end. Its end gives back that replica's seats."""
        stream = self.streams.get(watch_id)
        if stream is None:
            yield None
            return
        queue: asyncio.Queue = asyncio.Queue(SUBSCRIBER_CHUNKS + 2)
        stream.subscribers.add(queue)
        self._changed()
        try:
            yield stream.dialect, stream.header, stream.init, stream.max_viewers
            while True:
                item = await queue.get()
                yield item
                if isinstance(item, Ended):
                    return
        finally:
            stream.subscribers.discard(queue)
            stream.seats.pop(tag, None)
            self._changed()

    async def wanted(self) -> dict:
        """(The owner's long poll) {watch id: (subscribing replicas, a keyframe wanted, viewers at other replicas)}
        once something changed, or after POLL_S; the keyframe requests are taken."""
        if self.changed is None:
            self.changed = asyncio.Event()
        try:
            await asyncio.wait_for(self.changed.wait(), POLL_S)
        except asyncio.TimeoutError:
            pass
        self.changed.clear()
        out = {w: (len(s.subscribers), s.keyframe, sum(s.seats.values())) for w, s in self.streams.items()}
        for s in self.streams.values():
            s.keyframe = False
        return out

    def census(self) -> dict:
        return {w: {"subscribers": len(s.subscribers), "seats": sum(s.seats.values()), "local": s.local}
                for w, s in self.streams.items()}


class Relay:
    """One ingress replica's side: its post, what other replicas subscribe to here, and its mirrors of theirs."""

    def __init__(self):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        self.tag = uuid.uuid4().hex[:TAG_CHARS]
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)   # (as the keeper)
        self.post = ray.remote(WatchPost).options(name=f"post-{self.tag}", namespace=NAMESPACE, num_cpus=0,
                                                  max_concurrency=10_000, scheduling_strategy=here).remote()
        self.subscribed: set[str] = set()                  # watch ids of this replica with subscribers elsewhere
        self.local: dict[str, Audience] = {}               # this replica's shared sessions
        self.mirrors: dict[str, asyncio.Task] = {}         # watch id -> the task feeding its mirror here
        self.posts: dict[str, Any] = {}                     # watch id -> the owner's post of a mirror here
        self.joining: dict[str, asyncio.Future] = {}       # watch id -> a subscription in the making
        self.follower: Optional[asyncio.Task] = None
        self.told: dict[str, int] = {}                      # watch id -> calls told the post about it

    def _tell(self, watch_id: str, what: str, *args) -> None:
        number = self.told.get(watch_id, 0)
        self.told[watch_id] = number + 1
        outside_the_request(self.post.tell.remote, watch_id, number, what, *args)

    # ---- the owner's replica ---------------------------------------------------------------------------
    def opened(self, audience: Audience) -> None:
        self.local[audience.watch_id] = audience
        self._tell(audience.watch_id, "open", audience.dialect, audience.header, audience.init, audience.max_viewers)
        if self.follower is None or self.follower.done():
            self.follower = fresh_task(self._follow())

    def init_known(self, audience: Audience) -> None:
        self._tell(audience.watch_id, "init", audience.init)

    def published(self, audience: Audience, chunk: SharedChunk) -> None:
        if audience.watch_id in self.subscribed:
            self._tell(audience.watch_id, "publish", chunk)

    def counted(self, audience: Audience) -> None:
        """The owner's replica's own viewers of `audience` changed: its post bounds the others by them."""
        self._tell(audience.watch_id, "viewers", len(audience.viewers))

    def closed(self, audience: Audience, ended: Ended) -> None:
        self.local.pop(audience.watch_id, None)
        self.subscribed.discard(audience.watch_id)
        self._tell(audience.watch_id, "close", ended)
        self.told.pop(audience.watch_id, None)

    async def _follow(self) -> None:
        """Which of this replica's sessions have subscribers elsewhere, and the keyframes their viewers ask for."""
        while self.local:
            try:
                wanted = await self.post.wanted.remote()
            except Exception as e:                          # the post died: nobody elsewhere can subscribe now
                log.warning("watch relay: the post is gone (%s)", type(e).__name__)
                self.subscribed.clear()
                return
            self.subscribed = {w for w, (n, _, _) in wanted.items() if n}
            for watch_id, (_, keyframe, elsewhere) in wanted.items():
                audience = self.local.get(watch_id)
                if audience is not None:
                    audience.remote_viewers = elsewhere
                    if keyframe:
                        audience.on_keyframe_wanted()

    # ---- a viewer's replica ----------------------------------------------------------------------------
    async def mirror(self, watch_id: str, dialect: str, stage: Stage) -> Optional[Audience]:
        """The audience here of a session shared at another replica (subscribed once; later viewers find it in the
        stage); None when no replica shares `watch_id` on this protocol's route."""
        if watch_id in self.joining:
            await asyncio.shield(self.joining[watch_id])
            return stage.find(watch_id, dialect)
        tag = watch_id[:TAG_CHARS]
        if tag == self.tag or len(watch_id) <= TAG_CHARS:
            return None
        self.joining[watch_id] = asyncio.get_running_loop().create_future()
        try:
            return await self._subscribe(watch_id, tag, dialect, stage)
        finally:
            self.joining.pop(watch_id).set_result(None)

    async def _subscribe(self, watch_id: str, tag: str, dialect: str, stage: Stage) -> Optional[Audience]:
        import ray
        try:
            post = ray.get_actor(f"post-{tag}", namespace=NAMESPACE)
        except ValueError:                                  # no such replica (or it is gone)
            return None
        stream = outside_the_request(post.subscribe.options(num_returns="streaming").remote, watch_id, self.tag)
        try:
            first = await (await stream.__anext__())
        except Exception:                                   # (StopAsyncIteration, or the replica died meanwhile)
            first = None
        if first is None or first[0] != dialect:
            ray.cancel(stream)
            return None
        _, header, init, max_viewers = first
        audience = Audience(watch_id, dialect, header, init, max_viewers,
                            lambda: outside_the_request(post.want_keyframe.remote, watch_id), mirror=True)
        stage.audiences[watch_id] = audience
        self.posts[watch_id] = post
        self.mirrors[watch_id] = fresh_task(self._feed(stream, audience, stage))
        log.info("watch relay: mirroring %s... from replica %s", watch_id[:TAG_CHARS + 4], tag)
        return audience

    async def _feed(self, stream, audience: Audience, stage: Stage) -> None:
        ended = Ended(0, True)
        try:
            async for ref in stream:
                item = await ref
                if isinstance(item, SharedChunk):
                    audience.publish(item)
                elif isinstance(item, Gap):
                    for viewer in list(audience.viewers):
                        viewer.queue.clear()
                        viewer.queued_bytes = 0
                        viewer.waiting_for_keyframe = True
                    audience.want_keyframe()
                elif isinstance(item, bytes):
                    audience.init = item
                elif isinstance(item, Ended):
                    ended = item
                    break
        except asyncio.CancelledError:
            import ray
            ray.cancel(stream)                             # the last viewer here left: the subscription ends
            raise
        except Exception as e:                              # the owner's replica died: its viewers here are told
            log.warning("watch relay: the stream of %s... ended (%s)", audience.watch_id[:TAG_CHARS + 4],
                        type(e).__name__)
        finally:
            self.mirrors.pop(audience.watch_id, None)
            self.posts.pop(audience.watch_id, None)
        stage.close(audience, ended)

    async def seat(self, audience: Audience) -> bool:
        """A seat for one more viewer of a mirror here, at the owner's post (False: the session has its viewers, or
        its post did not answer)."""
        post = self.posts.get(audience.watch_id)
        if post is None:
            return False
        try:
            return await asyncio.wait_for(outside_the_request(post.seat.remote, audience.watch_id, self.tag),
                                          SEAT_TIMEOUT_S)
        except Exception as e:                              # (the owner's replica gone, or too busy to answer)
            log.warning("watch relay: no seat for a viewer of %s... (%s)", audience.watch_id[:TAG_CHARS + 4],
                        type(e).__name__)
            return False

    def unseat(self, audience: Audience) -> None:
        post = self.posts.get(audience.watch_id)
        if post is not None:
            outside_the_request(post.unseat.remote, audience.watch_id, self.tag)

    def unmirror(self, audience: Audience) -> None:
        self.posts.pop(audience.watch_id, None)
        task = self.mirrors.pop(audience.watch_id, None)
        if task is not None:
            task.cancel()

    def census(self) -> dict:
        return {"local": len(self.local), "subscribed": len(self.subscribed), "mirrors": len(self.mirrors)}
