"""Ids of sessions that ended, for the group's actors (ranks, muxer, mailbox) whose calls may arrive out of
order. Plain Python."""
from __future__ import annotations

from collections import OrderedDict


class Tombstones:
    """Ids of sessions that ended, newest kept (bounded). Calls to a threaded or async actor run in any order:
    a close can overtake its open, a stop can land before, during or after the chunk it is meant for."""

    def __init__(self, capacity: int = 10000):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, session_id: str) -> None:
        self._ids[session_id] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._ids
