"""A group's control mailbox: the ingress's direct line to the group that runs its session.

Client controls (interactions) are posted here by the ingress, off Serve's request routing (a Serve
handle call could reach any replica; the mailbox belongs to one group). The group long-polls `take`,
which answers as soon as something arrives, so a control wakes the group's chunk loop instead of being
found by polling. Plain Python with async methods; the group makes it an async Ray actor.
"""
from __future__ import annotations

import asyncio
from collections import defaultdict

from ..session.requests import Interaction
from .tombstones import Tombstones


class ControlMailbox:
    def __init__(self):
        self.items: dict[str, list[Interaction]] = defaultdict(list)
        self.closed = Tombstones()            # a close may overtake a post in flight: drop what comes after it
        self.arrived = asyncio.Event()

    async def ready(self) -> bool:
        return True

    async def post(self, session_id: str, interaction: Interaction) -> None:
        if session_id not in self.closed:
            self.items[session_id].append(interaction)
            self.arrived.set()

    async def take(self, timeout_s: float) -> dict[str, list[Interaction]]:
        """Every pending interaction per session, in the order the client sent them (posts may land out of
        order: each carries the ingress's sequence number); waits up to timeout_s for the first one."""
        if not self.items:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        out = {sid: sorted(items, key=lambda i: i.seq) for sid, items in self.items.items() if items}
        self.items.clear()
        return out

    async def close(self, session_id: str) -> None:
        self.items.pop(session_id, None)
        self.closed.add(session_id)

    async def census(self) -> dict[str, int]:
        """Sessions with controls waiting (0 once none is open)."""
        return {"sessions": len(self.items)}
