"""Limits at the door, per tenant (an API key, or the client's address when no keys are configured): how
many sessions it may hold at once and how many it may start per minute. Plain Python, one per ingress
replica: the app runs one; with several (or an old one draining through a redeploy) each enforces the limits
on its own connections."""
from __future__ import annotations

from collections import deque
from typing import Optional

from .protocol import CLOSE_TRY_AGAIN, ProtocolError

WINDOW_S = 60.0


class TenantLimits:
    def __init__(self, max_sessions: int = 0, max_starts_per_minute: int = 0):
        self.max_sessions = max_sessions                    # 0: no limit
        self.max_starts = max_starts_per_minute             # 0: no limit (no start times kept)
        self.active: dict[str, int] = {}
        self.starts: dict[str, deque] = {}

    def admit(self, tenant: str, now: float) -> Optional[ProtocolError]:
        """Take a session slot for `tenant`, or the refusal (the slot is not taken)."""
        active = self.active.get(tenant, 0)
        if self.max_sessions and active >= self.max_sessions:
            return ProtocolError("too_many_sessions", f"this key already holds {active} sessions (the "
                                 f"limit is {self.max_sessions}); end one first", close=CLOSE_TRY_AGAIN,
                                 retry_after_s=5)
        if self.max_starts:
            starts = self.starts.setdefault(tenant, deque())
            while starts and now - starts[0] >= WINDOW_S:
                starts.popleft()
            if len(starts) >= self.max_starts:
                wait = WINDOW_S - (now - starts[0])
                return ProtocolError("rate_limited", f"this key started {len(starts)} sessions in the last minute "
                                     f"(the limit is {self.max_starts})", close=CLOSE_TRY_AGAIN,
                                     retry_after_s=round(max(wait, 0.0), 1))
            starts.append(now)
        self.active[tenant] = active + 1
        return None

    def release(self, tenant: str) -> None:
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]


class SnapshotKeeper:
    """Owns the sessions' snapshots in the object store, so they survive the group (and the node) that made
    them: ranks hand each chunk's snapshot (its K/V slot and the state after it) to `keep`, which puts them
    and returns their references (in a list, so that they travel as references). An object lives while
    someone holds its reference: the ingress holds the ones a resume would need and lets the rest go. The
    ingress creates one per replica (and another if it dies)."""

    def ready(self) -> bool:
        return True

    def keep(self, slot, state) -> list:
        import ray
        return [ray.put(slot), ray.put(state)]
