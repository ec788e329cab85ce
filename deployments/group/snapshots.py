"""How many of a group's sessions keep snapshots: as many as the host memory their snapshots may use holds.

A session's snapshots live in host memory, not on the device: what the ingress's keeper holds for it in the
object store (the K/V slots a continuation attends and the newest state, with the snapshots on their way)
and, once per rank, the rank's copies waiting to be put and the put in progress (lingbot/runtime/
snapshot_budget.py counts them; at 14B about 42 GiB per session and group, whatever the SP degree, and 46
GiB once). They are counted when the group starts, against `snapshot_host_budget_gib`, or by default
SNAPSHOT_HOST_SHARE of the node's memory (psutil) shared among the groups the node holds, by their part of
its accelerators. All of it is counted on the group's node, the keeper's part included (on one node it is
there; on a cluster the keeper's node holds the sum for the sessions of its ingress).

A group admits as many sessions as its devices hold, as before; those beyond what the host budget holds
run without snapshots (their ranks get no keeper; a resume replays them from the journal), with a warning.
Refusing them instead would leave a device idle to protect a fault's recovery time, and a session without
snapshots still resumes bitwise, only slower; taking them would spill the object store to disk (or let
the OS kill the node's processes) in the sessions' steady state, not in a fault.
"""
from __future__ import annotations

import logging
from typing import Optional

from lingbot.runtime.snapshot_budget import GIB, SnapshotHost, default_host_budget, plan_snapshots

from ..settings import ACCELERATOR_RESOURCE, ServeSettings

log = logging.getLogger(__name__)

def group_share(settings: ServeSettings, node_resources: dict) -> float:
    """This group's part of its node: its ranks' accelerators over the node's (CPUs on cpu); 1 when the node's
    resources are unknown (no Ray)."""
    resource = ACCELERATOR_RESOURCE.get(settings.device, "CPU")
    per_rank = settings.rank_devices if settings.device != "cpu" else settings.rank_cpus
    total = float(node_resources.get(resource, 0))
    return 1.0 if total <= 0 else min(1.0, settings.sp * per_rank / total)


def snapshot_host_budget(settings: ServeSettings, node_memory: int, node_resources: dict) -> int:
    """The host bytes this group's snapshots may use: snapshot_host_budget_gib, or its share of the node's."""
    if settings.snapshot_host_budget_gib is not None:
        return int(settings.snapshot_host_budget_gib * GIB)
    return default_host_budget(node_memory, group_share(settings, node_resources))


def node_host() -> tuple[int, dict]:
    """This process's node: its memory (psutil) and its Ray resources ({} without Ray)."""
    import psutil
    memory = psutil.virtual_memory().total
    try:
        import ray
        if ray.is_initialized():
            here = ray.get_runtime_context().get_node_id()
            for node in ray.nodes():
                if node.get("NodeID") == here:
                    return memory, dict(node.get("Resources", {}))
    except Exception as e:                   # the share falls back to the whole node: said, not fatal
        log.warning("the node's resources are unknown (%s: %s); its whole memory share is this group's",
                    type(e).__name__, e)
    return memory, {}


def snapshot_sessions(settings: ServeSettings, host: SnapshotHost, node_memory: int,
                      node_resources: dict) -> tuple[int, int]:
    """Sessions of this group whose snapshots fit the host budget, and the budget. `host`: what one session's
    snapshots cost (the ranks report it: RankInfo.snapshot_host)."""
    budget = snapshot_host_budget(settings, node_memory, node_resources)
    return host.sessions_within(budget), budget


class SnapshotSeats:
    """The sessions of a group that keep snapshots: the first `seats` to open, a seat freed when its session
    ends. A session that finds none runs without (it gets no keeper), and a warning says so."""

    def __init__(self, group_id: str, seats: int):
        self.group_id = group_id
        self.seats = seats
        self.holders: set[str] = set()

    def take(self, session_id: str, keeper):
        """The keeper the session's ranks get: `keeper` if a seat is free (or it holds one), else None."""
        if keeper is None or session_id in self.holders:
            return keeper
        if len(self.holders) >= self.seats:
            if self.seats == 0:                      # no session's fit: the group said so once, when it started
                return None
            log.warning("group %s: session %s runs without snapshots: the host memory for snapshots holds %d "
                        "sessions (snapshot_host_budget_gib; `lingbot snapshot-budget`); a resume replays it",
                        self.group_id, session_id, self.seats)
            return None
        self.holders.add(session_id)
        return keeper

    def give(self, session_id: str) -> None:
        self.holders.discard(session_id)

    @staticmethod
    def of(group_id: str, settings: ServeSettings, host: Optional[SnapshotHost]) -> Optional[SnapshotSeats]:
        """The group's seats on its node (this process's: the replica shares its ranks' node), counted once by
        the group from what rank 0 reported a session's snapshots cost, and said once in its log (with the
        budget that would keep one, where none fits); None when snapshots are off."""
        if host is None:
            return None
        node_memory, node_resources = node_host()
        plan = plan_snapshots(host, snapshot_host_budget(settings, node_memory, node_resources), node_memory)
        (log.info if plan.enabled else log.warning)("group %s: %s (every %d chunks)", group_id, plan.summary(),
                                                    settings.snapshot_interval_chunks)
        return SnapshotSeats(group_id, plan.sessions)
