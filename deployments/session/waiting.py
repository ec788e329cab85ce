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


@dataclass(frozen=True)
class Growth:
    """The deployment's groups as Serve reports them, and how long a group took to start here."""
    running: int
    starting: int
    max_groups: int
    start_s: Optional[float] = None          # measured (the median of the starts seen); None: none seen yet

    @property
    def can_grow(self) -> bool:
        """A group is on its way, or the autoscaler may still add one: a waiting session has reason to wait."""
        return self.starting > 0 or self.running < self.max_groups


def may_wait(growth: Growth, stuck_for_s: Optional[float], admission_wait_s: float) -> bool:
    """Whether a waiting session waits on: yes while a group may still come; once none can (`stuck_for_s` since
    then), for admission_wait_s more (0: the refusal is immediate)."""
    return growth.can_grow or stuck_for_s is None or stuck_for_s < admission_wait_s


class WaitingRoom:
    def __init__(self, lookback_s: float = LOOKBACK_S):
        self.lookback_s = lookback_s
        self.waiting: dict[str, float] = {}          # session -> when it began to wait (insertion = arrival order)
        self.admissions: deque[float] = deque()      # when sessions that had waited were admitted

    def join(self, session_id: str, now: Optional[float] = None) -> None:
        self.waiting.setdefault(session_id, time.monotonic() if now is None else now)

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
