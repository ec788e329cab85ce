"""How many model groups the deployment wants: Serve's autoscaler calls `GroupScaling` (a custom policy,
deployments/app.py) and the fleet simulation (perf/fleet_sim.py) calls the same object.

The demand is every session that holds a lease or waits for one: a waiting session keeps one lease call
queued at Serve's handle (deployments/session/life.py), so Serve's `total_num_requests` (running plus
queued at the handles) is the number of sessions that want a group. Groups = the sessions' groups, rounded
up, plus `spare_groups` whose every slot is free, so that a burst or a session resuming after a fault finds
a group running instead of waiting a group start (minutes on accelerators). Serve bounds the answer by
min_replicas / max_replicas and applies upscale_delay_s / downscale_delay_s; scale-down drains as before.

Plain Python: the policy reads only the context's numbers, so a test gives it Ray's own AutoscalingContext.
"""
from __future__ import annotations

import math


def wanted_groups(sessions: float, capacity: int, spare_groups: int) -> int:
    """Groups for `sessions` sessions (running or waiting) at `capacity` sessions a group, plus the spare."""
    if capacity < 1 or spare_groups < 0:
        raise ValueError(f"capacity {capacity} must be >= 1 and spare_groups {spare_groups} >= 0")
    return math.ceil(max(sessions, 0.0) / capacity - 1e-6) + spare_groups


class GroupScaling:
    """Serve's custom autoscaling policy of the WorldGroup deployment (a class: Serve makes it once with the
    policy_kwargs, then calls it each control-loop tick with the deployment's AutoscalingContext)."""

    def __init__(self, capacity: int, spare_groups: int = 0):
        wanted_groups(0, capacity, spare_groups)          # the same checks, at deploy time
        self.capacity = capacity
        self.spare_groups = spare_groups

    def __call__(self, ctx) -> tuple[int, dict]:
        sessions = ctx.total_num_requests
        groups = wanted_groups(sessions, self.capacity, self.spare_groups)
        return groups, {"sessions": sessions}           # Serve keeps its own delay state beside it
