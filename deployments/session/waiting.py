"""The ingress's waiting room: the sessions waiting for a group to admit them, in arrival order, and an estimate
of each one's wait (docs/architecture.md, "A session's life").

Plain Python, one per ingress replica. The estimate: while groups are being added (or may be), what is left of
a measured group start since the session began to wait; otherwise the mean interval between recent admissions
of sessions that had waited, times the place in the queue. None (unknown) until there is a measure."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

LOOKBACK_S = 300.0
MIN_ETA_S = 1.0
# Serve's replica states of a group on its way (Growth.starting counts them; a stopping group's drain looks for
# them too, deployments/group/drain.py)
STARTING_STATES = ("STARTING", "UPDATING", "RECOVERING")


ROUTING_SETTLE_S = 5.0   # a group that came up this recently may still have room no lease was routed to yet


@dataclass(frozen=True)
class Growth:
    """The deployment's groups as Serve reports them, and how long a group took to start here."""
    running: int
    starting: int
    max_groups: int
    start_s: Optional[float] = None          # measured (the median of the starts seen); None: none seen yet
    grew_at: Optional[float] = None          # when the running count last rose (monotonic); None: not seen

    @property
    def can_grow(self) -> bool:
        """A group is on its way, or the autoscaler may still add one: a waiting session has reason to wait."""
        return self.starting > 0 or self.running < self.max_groups

    def may_bring_room(self, now: float) -> bool:
        """A group may still bring room: one can grow, or one came up less than ROUTING_SETTLE_S ago. Serve
        says a new group runs a moment before its handles route to it, so a lease queued for its free places
        is still on its way to them; at max_groups that moment is not "no room"."""
        return self.can_grow or (self.grew_at is not None and now - self.grew_at < ROUTING_SETTLE_S)


def may_wait(growth: Growth, now: float, stuck_since: Optional[float],
             admission_wait_s: float) -> tuple[bool, Optional[float]]:
    """Whether a waiting session waits on, and since when no group could bring room (the `stuck_since` of its
    next tick; None while one may). It waits while a group may bring room (Growth.may_bring_room); once none
    can, for admission_wait_s more (0: refused at once). A session is refused only when every running group
    is full and none can be added."""
    if growth.may_bring_room(now):
        return True, None
    stuck_since = now if stuck_since is None else stuck_since
    return now - stuck_since < admission_wait_s, stuck_since


class WaitingRoom:
    def __init__(self, lookback_s: float = LOOKBACK_S):
        self.lookback_s = lookback_s
        self.waiting: dict[str, float] = {}          # session -> when it began to wait (insertion = arrival order)
        self.admissions: deque[float] = deque()      # when sessions that had waited were admitted

    def join(self, session_id: str, now: Optional[float] = None) -> None:
        self.waiting.setdefault(session_id, time.monotonic() if now is None else now)

    def try_join(self, session_id: str, bound: int, now: Optional[float] = None) -> bool:
        """Join unless `bound` sessions wait already (checked and taken at once: starts that come together cannot
        all pass the bound before any joins)."""
        if session_id not in self.waiting and len(self.waiting) >= bound:
            return False
        self.join(session_id, now)
        return True

    def leave(self, session_id: str, admitted: bool, now: Optional[float] = None) -> None:
        """The session was admitted (it counts for the estimate), refused, or went away."""
        if self.waiting.pop(session_id, None) is not None and admitted:
            self.admissions.append(time.monotonic() if now is None else now)

    def position(self, session_id: str) -> int:
        """1 for the longest waiting; 0 when not waiting."""
        for place, sid in enumerate(self.waiting, 1):
            if sid == session_id:
                return place
        return 0

    def eta_s(self, position: int, now: Optional[float] = None, growth: Optional[Growth] = None,
              session_id: Optional[str] = None) -> Optional[float]:
        """Seconds until the session at `position` is likely admitted (whole seconds while a group starts)."""
        now = time.monotonic() if now is None else now
        if growth is not None and growth.can_grow and growth.start_s is not None:
            waited = now - self.waiting.get(session_id, now)
            return float(round(max(growth.start_s - waited, MIN_ETA_S)))
        while self.admissions and now - self.admissions[0] > self.lookback_s:
            self.admissions.popleft()
        if len(self.admissions) < 2:
            return None
        interval = (self.admissions[-1] - self.admissions[0]) / (len(self.admissions) - 1)
        return round(position * max(interval, 0.1), 1)
