"""How many model groups the deployment wants: Serve's autoscaler calls `GroupScaling` (a custom policy,
deployments/app.py) and the fleet simulation (perf/fleet_sim.py) calls the same object.

The demand is every session that holds a lease or waits for one: a waiting session keeps one lease call
queued at Serve's handle (deployments/session/life.py), so Serve's `total_num_requests` (running plus
queued at the handles) is the number of sessions that want a group. Groups = the sessions' groups, rounded
up, plus `spare_groups` whose every slot is free, so that a burst or a session resuming after a fault finds
a group running instead of waiting a group start (minutes on accelerators). Serve bounds the answer by
min_replicas / max_replicas and applies upscale_delay_s / downscale_delay_s; scale-down drains as before.

The capacity is each group's at the top rung: a group reports what it holds at real time at full quality
(`WorldGroup.record_autoscaling_stats`, measured once chunks ran with the quality ladder on; else its configured
cap), Serve hands the policy those reports (`aggregated_metrics`), and the policy counts the sessions against the
smallest, never above the configured cap. So with the ladder on, the sessions a group carries on cheaper rungs
beyond its top-rung capacity still ask for groups: when one comes, new sessions go to it, and the sessions
below the top rung climb back where they are as their group's load falls (the ladder decides per chunk; moving
a running session would cost it a drain's pause for quality the ladder restores anyway).

Plain Python: the policy reads only the context's numbers, so a test gives it Ray's own AutoscalingContext.
"""
from __future__ import annotations

import math

TOP_CAPACITY = "top_capacity"          # the custom autoscaling metric each group reports (record_autoscaling_stats)


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
        capacity = self.top_capacity(ctx)
        groups = wanted_groups(sessions, capacity, self.spare_groups)
        return groups, {"sessions": sessions, "capacity": capacity}   # Serve keeps its own delay state beside it

    def top_capacity(self, ctx) -> int:
        """Sessions a group holds at the top rung: the smallest the groups report (at least 1), else configured."""
        reported = (ctx.aggregated_metrics or {}).get(TOP_CAPACITY) or {}
        if not reported:
            return self.capacity
        return max(1, min(self.capacity, math.floor(min(reported.values()))))
