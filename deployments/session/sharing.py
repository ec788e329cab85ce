"""The owner's side of sharing a session (life.py): `session.share` / `session.unshare` (or a start asking for
spectators), each delivered chunk handed to the session's audience, and the audience's end with the session.

The owner's dialect renders the viewers' messages once per chunk (`Wire.viewer_chunk`: nothing the owner sent,
no event ids); the fMP4 init segment is kept from the stream's first chunk, so that a session shared later can
still give each viewer one. A viewer joining or skipping asks the owner's encoder for a keyframe at its next
chunk (`GroupLink.want_keyframe`, one Ray call, not one per chunk).

Plain Python: no Ray, no Starlette."""
from __future__ import annotations

import logging
from typing import Any, Optional

from lingbot.io.video import fragment_starts_with_keyframe, split_init_segment

from .audience import Audience, Ended, SharedChunk, Stage
from .codes import ErrorCode, ProtocolError
from .events import Admitted, ChunkReady

log = logging.getLogger("ray.serve")


def chunk_starts_with_keyframe(event: ChunkReady, fmp4_part: bytes) -> bool:
    """Whether a viewer can start at this chunk: its fragment's first sample is a sync sample, or its first frame
    batch stands alone (raw, images, or a delta-gzip batch without a reference)."""
    if event.batches:
        return not event.batches[0].delta_reference
    return bool(fmp4_part) and fragment_starts_with_keyframe(fmp4_part)


class Sharing:
    """One session's sharing at its ingress: its audience while shared (None otherwise)."""

    def __init__(self, session_id: str, wire, groups, stage: Optional[Stage], settings):
        self.session_id, self.wire, self.groups, self.stage, self.settings = session_id, wire, groups, stage, settings
        self.audience: Optional[Audience] = None
        self.init = b""                      # the fMP4 init segment, from the stream's first chunk
        self.admitted: Optional[Admitted] = None
        self.start = None                    # the session's start, once it streams
        self.since_keyframe = 0              # chunks since the last one a viewer could start at
        self.told_viewers = 0                # the viewer count the owner was last told

    @property
    def viewers(self) -> int:
        return 0 if self.audience is None else self.audience.watching

    def streaming_on(self, admitted: Admitted, start, group_sid: str) -> None:
        """The session streams on a group (again, after a resume: keyframes are asked of the new group's muxer)."""
        self.admitted, self.start, self.group_sid = admitted, start, group_sid

    async def share(self) -> Optional[ProtocolError]:
        """Make the session watchable (again: the same watch id) and tell the owner; the refusal when this
        deployment shares nothing."""
        if self.stage is None or self.settings.max_viewers_per_session <= 0:
            return ProtocolError(ErrorCode.SHARING_OFF, "this deployment does not share sessions "
                                 "(max_viewers_per_session is 0)")
        if self.admitted is None:             # (life.py shares once the session streams)
            return None
        if self.audience is None:
            header = self.wire.viewer_header(self.admitted, self.start)     # what a viewer is told first
            self.audience = self.stage.open(self.wire.dialect, header, self.init,
                                            self.settings.max_viewers_per_session, self._want_keyframe)
            log.info("session %s: shared", self.session_id)
        self.told_viewers = self.viewers
        await self.wire.send(self.wire.shared_message(self.audience.watch_id, self.viewers))
        return None

    async def unshare(self) -> Optional[ProtocolError]:
        """Every viewer told the stream is over (stopped), the watch id dead; the owner told."""
        if self.audience is not None:
            self.end(0, True, unshared=True)
        await self.wire.send(self.wire.shared_message(None, 0))

    def _want_keyframe(self) -> None:
        if self.admitted is not None and self.admitted.muxer is not None:
            self.groups.want_keyframe(self.admitted.muxer, self.group_sid)

    def delivered(self, event: ChunkReady, transport_index: int) -> Any:
        """A chunk the owner got: to every viewer (never waits). The owner's `shared` message again when the number
        of viewers changed since it was last told (its page shows it), else None."""
        init, fragment = b"", event.data
        if event.data and (not self.init or self.audience is not None):
            try:
                init, fragment = split_init_segment(event.data)
            except ValueError:               # not an fMP4 stream's bytes: shared as they are
                pass
        if init and not self.init:
            self.init = init
            if self.audience is not None:
                self.stage.init_known(self.audience, init)
        if self.audience is None:
            return None
        messages = self.wire.viewer_chunk(event, transport_index, fragment, self.audience.watch_id)
        keyframe = chunk_starts_with_keyframe(event, fragment)
        self.stage.publish(self.audience, SharedChunk(event.index, keyframe, messages, sum(len(m) for m in messages)))
        self.since_keyframe = 0 if keyframe else self.since_keyframe + 1
        if self.audience.watching and self.since_keyframe >= self.settings.viewer_keyframe_chunks - 1:
            self.audience.want_keyframe()    # (where a viewer the proxy's door skipped starts again)
        if self.viewers == self.told_viewers:
            return None
        self.told_viewers = self.viewers
        return self.wire.shared_message(self.audience.watch_id, self.viewers)

    def end(self, chunks: int, stopped: bool, unshared: bool = False) -> None:
        """The session is over (or unshared): its viewers are told, its watch id dies."""
        if self.audience is not None and self.stage is not None:
            self.stage.close(self.audience, Ended(chunks, stopped, unshared))
        self.audience = None
