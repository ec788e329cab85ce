"""Admission, the second phase of a session's life (life.py): hold a lease on a group, waiting in the ingress's
queue while every group is full (docs/architecture.md, "A session's life" and "Autoscaling on the queue").

A lease call that a full deployment holds back (Serve queues it at the handle, where the autoscaler counts it)
and a group that answers full both mean waiting. Every WAIT_TICK_S of it the session asks whether it may wait
on (a group may still come, or admission_wait_s has not passed since none can) and tells its client its place
and the estimate when they changed. `SessionLife` holds one Admission and gives it what it works with: the
session's id, its wire (and the lock that keeps a chunk's messages together), the groups, the waiting room and
admission_wait_s.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from .codes import RETRYABLE, ErrorCode
from .events import Admitted, SessionFailed, SessionRequest
from .ports import GroupLink, Wire
from .waiting import WaitingRoom, may_wait

WAIT_TICK_S = 0.5            # a waiting session's client is told its place this often (when it changed)
HELD_S = 5.0                 # a group's "a seat held back" (SessionFailed.seat_held) keeps a session waiting this long


class Admission:
    """A session's leases on groups: the first (queued while every group is full) and one per resume."""

    def __init__(self, session_id: str, wire: Wire, send_lock: asyncio.Lock, groups: GroupLink, room: WaitingRoom,
                 admission_wait_s: float):
        self.session_id = session_id
        self.wire = wire
        self.send_lock = send_lock
        self.groups = groups
        self.room = room
        self.admission_wait_s = admission_wait_s
        self.lease = None                        # the last lease call: the session's, once it was admitted
        self.told: Optional[tuple] = None        # the last (position, eta_s) the client was told
        self.stuck_since: Optional[float] = None  # since when no group could be added while it waited
        self.held_until = 0.0                    # a group's refusal said it holds a seat back: wait until then

    async def admit(self, request: SessionRequest, wait_s: float, queue: bool = False):
        """Hold a lease on a group for the session: the Admitted event, or the last refusal (None: no answer)
        within wait_s. A group that is full, failed or gone is tried again until the time is up; with `queue`
        the session waits in the waiting room meanwhile, its client told its place and an estimate."""
        if not queue:
            return await self._lease_within(request, wait_s)
        self.room.join(self.session_id)
        self.stuck_since = None
        answer = None
        try:
            answer = await self._lease_within(request, wait_s, self._queued_tick)
            return answer
        finally:
            self.room.leave(self.session_id, admitted=isinstance(answer, Admitted) and self.told is not None)

    async def admit_while_watching(self, request: SessionRequest, wait_s: float, watch) -> tuple[bool, Any]:
        """admit(queue=True) while `watch()` reads the client: (False, the admission's answer), or (True, what
        the watch returned) when the client left or stopped first (the admission is given up)."""
        admitting = asyncio.ensure_future(self.admit(request, wait_s, queue=True))
        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait({admitting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = not admitting.done()
            for task in (admitting, watcher):            # (again until it ends: on Python 3.11 a wait_for whose
                while not task.done():                   # inner read completed as it was cancelled swallows it)
                    task.cancel()
                    await asyncio.wait({task}, timeout=0.1)
        if not left:
            return False, admitting.result()
        if watcher.exception() is not None:
            raise watcher.exception()
        return True, watcher.result()

    async def _queued_tick(self) -> bool:
        """One tick of waiting in the queue: False once no group can come and admission_wait_s has passed since
        (the refusal is then immediate by default), unless a group said lately that its ladder holds a free seat
        back (SessionFailed.seat_held: it waits for that seat); otherwise the client is told its place and the estimate,
        when they changed since it was last told."""
        growth = await self.groups.growth()
        now = time.monotonic()
        wait, self.stuck_since = may_wait(growth, now, self.stuck_since, self.admission_wait_s)
        if not (wait or now < self.held_until):  # (a seat held back by a group's ladder: groups or not)
            return False
        position = self.room.position(self.session_id)
        told = (position, self.room.eta_s(position, now, growth, self.session_id))
        if position and told != self.told:
            self.told = told
            async with self.send_lock:
                await self.wire.send(self.wire.queued_message(*told))
        return True

    async def _lease_within(self, request: SessionRequest, wait_s: float, waiting=None):
        """The admission loop. A lease call that a full deployment holds back (Serve queues it while every group
        is at its limit) or a group that answers full both mean waiting: `waiting()` is called every
        WAIT_TICK_S of it (the client is told; False ends the wait), and a refused try is made again."""
        deadline = time.monotonic() + wait_s
        answer = None
        while True:
            self.lease = self.groups.lease(request)
            first = asyncio.ensure_future(self.lease.__anext__())
            try:
                while True:
                    done, _ = await asyncio.wait({first}, timeout=min(WAIT_TICK_S, max(deadline - time.monotonic(),
                                                                                      0.01)))
                    if done:
                        break
                    if time.monotonic() >= deadline or (waiting is not None and not await waiting()):
                        first.cancel()
                        return answer
                answer = first.result()
            except Exception as e:                        # the replica died under the call
                answer = SessionFailed(ErrorCode.GROUP_UNAVAILABLE, f"the group's replica is gone ({type(e).__name__})")
            if isinstance(answer, Admitted):
                return answer
            self.lease.cancel()
            if answer.seat_held:                          # (another group may answer full meanwhile)
                self.held_until = time.monotonic() + HELD_S
            if answer.code not in RETRYABLE or time.monotonic() >= deadline:
                return answer
            if waiting is not None and not await waiting():
                return answer
            await asyncio.sleep(min(WAIT_TICK_S, max(deadline - time.monotonic(), 0)))
