"""The groups as Serve reports them: how many run, how many start, and how long a start takes here, for the
admission loop (may a waiting session keep waiting?) and the estimate its client is told
(deployments/session/waiting.py `Growth`).

Serve's status has no start times, so the census measures them: from the moment it first sees a group
starting to the moment the running count grows. It asks the controller at most once per `ttl_s` (every
waiting session's tick shares the answer), and follows the first start from the ingress's own start so that
the first burst already has an estimate (a lower bound: the ingress itself starts a little after its groups).
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Optional

from ..session.waiting import STARTING_STATES, Growth

log = logging.getLogger("ray.serve")

SAMPLES = 20


def serve_counts(deployment: str = "WorldGroup") -> tuple[int, int]:
    """(running, starting) replicas of `deployment`, from Serve's controller (a blocking call)."""
    from ray import serve
    status = serve.status()
    running = starting = 0
    for app in status.applications.values():
        d = app.deployments.get(deployment)
        if d is not None:
            running += d.replica_states.get("RUNNING", 0)
            starting += sum(d.replica_states.get(state, 0) for state in STARTING_STATES)
    return running, starting


class GroupCensus:
    def __init__(self, max_groups: int, counts: Callable[[], tuple[int, int]] = serve_counts, ttl_s: float = 1.0):
        self.max_groups = max_groups
        self.counts = counts
        self.ttl_s = ttl_s
        self.starts: deque[float] = deque(maxlen=SAMPLES)   # measured group starts (s)
        self.last: Optional[Growth] = None
        self.asked_at = float("-inf")
        self.running = 0
        self.starting_since: Optional[float] = None
        self.grew_at: Optional[float] = None        # when the running count last rose
        self.lock = asyncio.Lock()

    async def growth(self) -> Growth:
        async with self.lock:
            now = time.monotonic()
            if self.last is None or now - self.asked_at >= self.ttl_s:
                try:
                    running, starting = await asyncio.to_thread(self.counts)
                except Exception as e:            # the controller busy or restarting: assume it may still grow
                    log.warning("group census: Serve's status unavailable (%s)", type(e).__name__)
                    running, starting = self.running, 1
                self.observe(running, starting, now)
                self.asked_at = now
            return self.last

    def observe(self, running: int, starting: int, now: float) -> None:
        """One count: a start is measured when the running count grows after starts were seen."""
        if starting > 0 and self.starting_since is None:
            self.starting_since = now
        if running > self.running:
            self.grew_at = now
            if self.starting_since is not None:
                self.starts.append(now - self.starting_since)
        if starting == 0:
            self.starting_since = None
        self.running = running
        start_s = statistics.median(self.starts) if self.starts else None
        self.last = Growth(running, starting, self.max_groups, start_s, self.grew_at)

    async def follow_first_start(self, timeout_s: float = 900.0) -> None:
        """From the ingress's start until a group runs: the first start's measure (run as a task)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            growth = await self.growth()
            if growth.running > 0:
                return
            await asyncio.sleep(self.ttl_s)
