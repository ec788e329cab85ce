"""The snapshot keeper: the owner of the sessions' snapshots in the object store, one actor per ingress
replica, on the ingress's node (a session's snapshots must outlive any group, and its node). The ingress
makes it with `start_keeper()` and replaces it when it dies (`KeeperSupervisor`)."""
from __future__ import annotations

import asyncio
import logging

from ..memory import Trimmer, held_refs

log = logging.getLogger("ray.serve")


class SnapshotKeeper:
    """Owns the sessions' snapshots in the object store, so they survive the group (and the node) that made
    them: ranks hand each snapshot (the K/V slots it copied and the state after its chunk) to `keep`, which
    puts each slot and the state apart (the ingress lets a slot go when no continuation attends it any more,
    independently of the others) and returns their references (in a list, so that they travel as references).
    An object lives while someone holds its reference: the ingress holds the ones a resume would need and
    lets the rest go. What that costs per session: lingbot/runtime/snapshot_budget.py. The ingress creates
    one per replica (and another if it dies)."""

    def __init__(self):
        self.trim = Trimmer()                       # the unpickled snapshots' freed heap back (deployments/memory.py)

    def ready(self) -> bool:
        return True

    def keep(self, slots: list, state) -> list:
        """[a reference per slot, in order, then the state's]."""
        import ray
        refs = [*(ray.put(slot) for slot in slots), ray.put(state)]
        self.trim()                                 # (this call's arguments are freed after it returns: the next trim)
        return refs

    def census(self) -> dict[str, int]:
        """The snapshots it owns that someone still holds (0 once every session it kept for has ended)."""
        return {"object_refs": held_refs()}


def start_keeper():
    """A new keeper on this process's node, not on a group's: its snapshots must outlive any group's node (this
    node's loss ends the sessions anyway: their WebSockets are here). A soft affinity was measured to land on
    another node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(SnapshotKeeper).options(num_cpus=0, max_concurrency=16, scheduling_strategy=here).remote()


class KeeperSupervisor:
    """Hands out the live keeper, starting another when the one it had died (its snapshots are gone: those
    sessions replay their journals instead). `start` makes a keeper (start_keeper; tests pass their own)."""

    def __init__(self, start=start_keeper, ping_s: float = 1.0):
        self.start = start
        self.ping_s = ping_s
        self.keeper = start()
        self.lock = asyncio.Lock()

    async def current(self):
        async with self.lock:                        # one restart, however many sessions notice at once
            keeper = self.keeper
            try:
                await asyncio.wait_for(keeper.ready.remote(), self.ping_s)
            except asyncio.TimeoutError:
                pass                                 # busy, not dead
            except Exception as e:
                log.warning("the snapshot keeper is gone (%s); starting another", type(e).__name__)
                self.keeper = self.start()
        return self.keeper
