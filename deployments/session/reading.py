"""Reading a session's client (life.py): each message counted against the session's rate before it is decoded (a
dropped one is never decoded), then decoded against its bounds (size, containers, depth), keepalives answered and
bad messages refused; and while the session waits for a group, its interactions parsed at once and kept, bounded,
for the stream (docs/security.md, "Crowds and slow clients"). Plain Python: no Ray, no Starlette."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Optional

from .codes import ErrorCode, ProtocolError
from .ports import ACTIVITY, SAVE, SHARE, STOP, UNSHARE, ClientGone, Wire
from .rate import MessageRate
from .requests import Interaction

log = logging.getLogger("ray.serve")

EVENT_BYTES = 64             # what an interaction weighs besides its prompt and key sets (its id, a camera event)

Refuse = Callable[[ProtocolError], Awaitable[bool]]     # refuse with a code; False once the refusal ended the session


class ClientReader:
    """One client's messages, read for its session: `next_message`. `send_lock` keeps a keepalive's answer out of
    a chunk's messages. It keeps no reference to the session (a cycle would leave an ended session, and the
    references its lease holds, to the cyclic garbage collector)."""

    def __init__(self, wire: Wire, settings, send_lock: asyncio.Lock, now: float):
        self.wire, self.settings, self.send_lock = wire, settings, send_lock
        self.rate = MessageRate(settings.max_messages_per_s, now)

    async def next_message(self, deadline: float, refuse: Refuse, start: bool = False) -> Optional[dict]:
        """The next client message that needs handling (`start`: the session's start, with its bounds; else a later
        message, with far fewer containers allowed), read until `deadline` (monotonic; raises asyncio.TimeoutError
        after it, ClientGone when the client left); `refuse` answers a bad one (and says whether the session goes
        on). None means a refusal ended the session."""
        s = self.settings
        while True:
            raw = await self.wire.receive(max(deadline - time.monotonic(), 0.001))
            now = time.monotonic()
            if not self.rate.take(now):                     # dropped undecoded; the client hears it once a second
                refusal = self.rate.refusal(now)
                if refusal is not None and not await refuse(refusal):
                    return None
                continue
            try:
                msg = await self.wire.decode(raw, s.max_start_bytes if start else s.max_control_bytes, start)
            except ProtocolError as e:
                if not await refuse(e):
                    return None
                continue
            reply = self.wire.keepalive_reply(msg)
            if reply is None:
                return msg
            async with self.send_lock:
                await self.wire.send(reply)

    async def next_or_gone(self, refuse: Refuse) -> Optional[dict]:
        """The next message that needs handling, however long it takes; None when the client left or a refusal
        ended the session."""
        while True:
            try:
                return await self.next_message(time.monotonic() + 3600.0, refuse)
            except asyncio.TimeoutError:
                continue
            except ClientGone:
                return None


class EarlyControls:
    """The interactions a client sends while its session waits for a group, kept for the stream in their order:
    parsed (never the message itself: a message of 128 KiB can be megabytes of Python objects), at most
    `max_count` of them and `max_bytes` of their weight (prompts, key sets, EVENT_BYTES each). One past either
    bound is refused (too_many_controls), never kept. The session's control reader takes them first."""

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.kept: deque[Interaction] = deque()
        self.bytes = 0
        self.share: Optional[bool] = None        # session.share / unshare while it waited: the last one applies

    def __len__(self) -> int:
        return len(self.kept)

    @staticmethod
    def weight(interaction: Interaction) -> int:
        text = (interaction.prompt or "").encode()
        return EVENT_BYTES + len(text) + sum(len(k) for k in (interaction.keys or ())) + \
            sum(len(h) for h in (interaction.hold or ()))

    def keep(self, interaction: Interaction) -> Optional[ProtocolError]:
        """Keep `interaction` for the stream; the refusal when it would pass a bound (it is not kept)."""
        weight = self.weight(interaction)
        if len(self.kept) >= self.max_count or self.bytes + weight > self.max_bytes:
            return ProtocolError(ErrorCode.TOO_MANY_CONTROLS, f"more than {self.max_count} interactions (or "
                                 f"{self.max_bytes} bytes of them) wait for the session's group",
                                 event_id=interaction.event_id)
        self.kept.append(interaction)
        self.bytes += weight
        return None

    def take(self) -> Interaction:
        interaction = self.kept.popleft()
        self.bytes -= self.weight(interaction)
        return interaction


async def watch_client(reader: ClientReader, control: Callable[[dict, int], Any], early: EarlyControls,
                       refuse: Refuse, first_seq: int) -> Optional[bool]:
    """Read the client while its session waits for a group, so that one who leaves is seen at once (its place in
    the queue goes, and nothing is sent to a closed connection: Serve's proxy logs that as an error). Each message
    is parsed at once (`control(msg, seq)`, its sequence counted from `first_seq`): a bad one is refused with its
    code, an interaction kept in `early` (or refused past its bounds). True when the client stopped the session,
    None when it left or a refusal ended it."""
    while True:
        msg = await reader.next_or_gone(refuse)
        if msg is None:
            return None
        try:
            parsed = control(msg, first_seq + len(early))
        except ProtocolError as e:
            if not await refuse(e):
                return None
            continue
        if parsed == STOP:
            return True
        if parsed in (SHARE, UNSHARE):
            early.share = parsed == SHARE
            continue
        if parsed == SAVE and not await refuse(ProtocolError(ErrorCode.NOTHING_TO_SAVE, "the session has no chunk "
                                                             "yet to save: it waits for a model group")):
            return None
        if parsed == ACTIVITY or not isinstance(parsed, Interaction):
            continue
        refusal = early.keep(parsed)
        if refusal is not None and not await refuse(refusal):
            return None


def unknown_fields_said(start, metrics, session_id: str) -> None:
    """A start's fields this server does not know: ignored, as the peers ignore them; counted, and said once."""
    names = start.unknown_fields
    if names:
        metrics.unknown_fields(len(names))
        log.info("session %s: start fields not known here, ignored: %s%s", session_id, ", ".join(names[:16]),
                 f" (+{len(names) - 16} more)" if len(names) > 16 else "")
