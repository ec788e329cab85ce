"""A GPU fleet under the deployment's own scaling and admission decisions, simulated: how many sessions are
refused, how long admitted ones wait, and how many group-hours serve them, for a few arrival rates and
`spare_groups`, so an operator can choose spare_groups and max_groups.

    python -m perf.fleet_sim                       # the table in perf/README.md (about a minute on one core)
    python -m perf.fleet_sim --rates 2 6 --spares 0 1 --hours 2 --json out.json

The decisions are the serving code's, called as the deployment calls them: `GroupScaling` (the policy Serve's
autoscaler runs on running + queued sessions), `Growth.can_grow` / `may_wait` (whether a waiting session waits
on or is refused) and the waiting room's first-come order. What the simulation supplies is the world around
them: Poisson arrivals, exponential session lengths, a fixed group start, Serve's bounds and delays
(min/max_groups, upscale 1 s, downscale 120 s, as deployments/app.py sets them), and scale-down of idle groups
(Serve picks the newest replica; the drain moves its sessions, so the idle ones are what a drain leaves).
One-second steps.

With `--floor-capacity N` the quality ladder is on: a group admits up to N sessions (what it holds at real time
at the floor rung) while the autoscaler counts demand at `--capacity` (the top rung's), as the serving code
does (docs/architecture.md, "Rungs"); the table adds the share of session time spent below the top rung (a
group over its top-rung capacity degrades all its sessions, evenly).

    python -m perf.fleet_sim --floor-capacity 3    # 2 sessions a group at full, 3 at the floor
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from deployments.group.scaling import GroupScaling
from deployments.session.waiting import Growth, WaitingRoom, may_wait

UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 1.0, 120.0        # deployments/app.py


@dataclass
class Fleet:
    capacity: int
    max_groups: int
    min_groups: int
    start_s: float
    groups: list = field(default_factory=list)        # [ready_at, sessions] per group (ready_at > now: starting)


@dataclass
class Scaling:
    """Serve's side: the target and its delays around the policy's answer."""
    policy: GroupScaling
    target: int
    wanting_since: float | None = None

    def decide(self, sessions: float, fleet: Fleet, now: float) -> int:
        desired = min(max(self.policy(_Ctx(sessions))[0], fleet.min_groups), fleet.max_groups)
        if desired == self.target:
            self.wanting_since = None
            return self.target
        self.wanting_since = now if self.wanting_since is None else self.wanting_since
        delay = UPSCALE_DELAY_S if desired > self.target else DOWNSCALE_DELAY_S
        if now - self.wanting_since >= delay:
            self.target, self.wanting_since = desired, None
        return self.target


@dataclass
class _Ctx:
    """The fields of Serve's AutoscalingContext the policy reads (no group reports a measured capacity here: the
    configured one counts)."""
    total_num_requests: float
    policy_state: dict = field(default_factory=dict)
    aggregated_metrics: Optional[dict] = None


def simulate(rate_per_min: float, mean_length_s: float, hours: float, capacity: int, max_groups: int,
             min_groups: int, spare_groups: int, start_s: float, max_queue_wait_s: float, admission_wait_s: float,
             seed: int = 0, floor_capacity: Optional[int] = None) -> dict:
    """One row; `capacity` is a group's at the top rung, `floor_capacity` at the floor (None: the ladder off)."""
    admits = capacity if floor_capacity is None else max(capacity, floor_capacity)
    below_top_s = session_s = 0
    rng = random.Random(seed)
    fleet = Fleet(capacity, max_groups, min_groups, start_s, [[0.0, 0] for _ in range(min_groups)])
    scaling = Scaling(GroupScaling(capacity, spare_groups), min_groups)
    room = WaitingRoom()
    queue: deque = deque()                           # (session id, arrived, length) first come first served
    ends: list = []                                  # (end time, group) of running sessions
    waits, refused, served, group_s, stuck_since = [], 0, 0, 0.0, None
    next_arrival = rng.expovariate(rate_per_min / 60.0)
    steps = int(hours * 3600)
    for now in range(steps):
        while next_arrival <= now:
            sid = f"s{served + refused + len(queue)}-{next_arrival:.3f}"
            queue.append((sid, next_arrival, rng.expovariate(1.0 / mean_length_s)))
            room.join(sid, now=next_arrival)
            next_arrival += rng.expovariate(rate_per_min / 60.0)
        for end in [e for e in ends if e[0] <= now]:
            ends.remove(end)
            end[1][1] -= 1
        running = [g for g in fleet.groups if g[0] <= now]
        # admit in arrival order where a slot is free: at the top rung first, then (the ladder on) at the floor
        for group in [g for cap in dict.fromkeys((capacity, admits)) for g in running if g[1] < cap]:
            cap = capacity if group[1] < capacity else admits
            while queue and group[1] < cap:
                sid, arrived, length = queue.popleft()
                room.leave(sid, admitted=True, now=now)
                group[1] += 1
                ends.append((now + length, group))
                waits.append(now - arrived)
                served += 1
        session_s += sum(g[1] for g in running)
        below_top_s += sum(g[1] for g in running if g[1] > capacity)
        starting = len(fleet.groups) - len(running)
        growth = Growth(len(running), starting, max_groups, start_s)
        wait, stuck_since = may_wait(growth, now, stuck_since, admission_wait_s)   # (a group admits at once here)
        while queue and (not wait or now - queue[0][1] > max_queue_wait_s):
            sid, _, _ = queue.popleft()
            room.leave(sid, admitted=False, now=now)
            refused += 1
        sessions = sum(g[1] for g in fleet.groups) + len(queue)
        target = scaling.decide(sessions, fleet, now)
        while len(fleet.groups) < target:
            fleet.groups.append([now + start_s, 0])
        idle = [g for g in reversed(fleet.groups) if g[1] == 0]
        while len(fleet.groups) > target and idle:
            fleet.groups.remove(idle.pop(0))
        group_s += len(fleet.groups)
    return {"rate_per_min": rate_per_min, "spare_groups": spare_groups, "arrived": served + refused + len(queue),
            "served": served, "refused": refused, "waiting_at_end": len(queue),
            "wait_p50_s": _quantile(waits, 0.5), "wait_p99_s": _quantile(waits, 0.99),
            "group_hours": round(group_s / 3600, 1),
            "group_hours_per_served": round(group_s / 3600 / max(served, 1), 3),
            "below_top_share": round(below_top_s / max(session_s, 1), 3)}


def _quantile(values: list, q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return round(statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, math.ceil(q * 100) - 1))], 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.fleet_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 6.0, 12.0, 24.0], help="arrivals per minute")
    p.add_argument("--spares", type=int, nargs="+", default=[0, 1, 2, 4], help="spare_groups values")
    p.add_argument("--mean-length-s", type=float, default=300.0, help="mean session length (exponential)")
    p.add_argument("--hours", type=float, default=4.0, help="simulated time per row")
    p.add_argument("--capacity", type=int, default=2, help="sessions per group (at the top rung)")
    p.add_argument("--floor-capacity", type=int, default=None,
                   help="sessions per group at the quality floor (the ladder on; default: off)")
    p.add_argument("--max-groups", type=int, default=64)
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--start-s", type=float, default=180.0, help="group start (load, warm-up, compile)")
    p.add_argument("--max-queue-wait-s", type=float, default=600.0)
    p.add_argument("--admission-wait-s", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    rows = []
    ladder = "" if a.floor_capacity is None else f" at the top rung, {a.floor_capacity} at the floor"
    print(f"fleet: capacity {a.capacity}/group{ladder}, groups {a.min_groups}..{a.max_groups}, group start "
          f"{a.start_s:g} s, sessions {a.mean_length_s:g} s on average, {a.hours:g} h per row", flush=True)
    print("| arrivals/min | spare_groups | arrived | served | refused | wait p50 (s) | wait p99 (s) | group-hours "
          "| group-hours per session | below top rung |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate in a.rates:
        for spare in a.spares:
            r = simulate(rate, a.mean_length_s, a.hours, a.capacity, a.max_groups, a.min_groups, spare, a.start_s,
                         a.max_queue_wait_s, a.admission_wait_s, a.seed, a.floor_capacity)
            rows.append(r)
            print(f"| {rate:g} | {spare} | {r['arrived']} | {r['served']} | {r['refused']} | {r['wait_p50_s']} | "
                  f"{r['wait_p99_s']} | {r['group_hours']} | {r['group_hours_per_served']} | "
                  f"{r['below_top_share']:.1%} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
