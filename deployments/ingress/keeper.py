"""The snapshot keeper: the owner of the sessions' snapshots in the object store, one actor per ingress
replica, on the ingress's node (a session's snapshots must outlive any group, and its node). The ingress
makes it with `start_keeper()` and replaces it when it dies (`KeeperSupervisor`)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Optional

from ..memory import Trimmer, held_refs, keep_large_blocks_mapped

log = logging.getLogger("ray.serve")

TOMBSTONE_S = 600.0          # how long an ended session's late puts are still recognised (and refused)


class SnapshotKeeper:
    """Owns the sessions' snapshots in the object store, so they survive the group (and the node) that made
    them: ranks hand each snapshot (the K/V slots it copied and the state after its chunk) to `keep`, which
    puts each slot and the state apart and returns a key for each. The references stay here: the ingress holds
    the keys, lets go of the ones no continuation needs any more (`release`, each independently of the others)
    and of all of a session's at its end; a resume `lend`s the references of the keys it restores from.

    Why keys and not the references themselves: an object whose reference its owner hands to another process
    is tracked as borrowed, and Ray's owner keeps a few hundred bytes per object it ever lent, after the object
    is freed (measured: 370 bytes of malloc in use per object, none when the owner only puts and frees it;
    docs/architecture.md, "Memory over a day"). Snapshots are made every chunk, so that grew the keeper by a
    megabyte a minute under the soak's load; a key is a string, and only a resume lends references.

    What that costs per session: lingbot/runtime/snapshot_budget.py. The ingress creates one per replica (and
    another if it dies); keys are unique across keepers (a key of a dead keeper is unknown to the next)."""

    def __init__(self, tombstone_s: float = TOMBSTONE_S, clock: Callable[[], float] = time.monotonic):
        keep_large_blocks_mapped()                  # an unpickled snapshot never enters a malloc arena (memory.py)
        self.trim = Trimmer()                       # the unpickled snapshots' freed heap back (deployments/memory.py)
        self.prefix = uuid.uuid4().hex[:12]
        self.numbers = itertools.count()
        self.lock = threading.Lock()                # keep/release/lend run on up to 16 threads
        self.held: dict[str, Any] = {}              # key -> ObjectRef
        self.sessions: dict[str, set[str]] = {}     # session -> its keys held
        self.ended: dict[str, float] = {}           # session -> when it ended (its late puts are refused)
        self.tombstone_s, self.clock = tombstone_s, clock

    def ready(self) -> bool:
        return True

    def keep(self, session_id: str, slots: list, state) -> Optional[list[str]]:
        """[a key per slot, in order, then the state's]; None when the session has ended (nothing is kept)."""
        import ray
        if session_id in self.ended:
            return None
        refs = [*(ray.put(slot) for slot in slots), ray.put(state)]
        with self.lock:
            if session_id in self.ended:            # ended while this put ran
                return None
            keys = [f"{self.prefix}.{next(self.numbers)}" for _ in refs]
            self.held.update(zip(keys, refs))
            self.sessions.setdefault(session_id, set()).update(keys)
        del refs
        self.trim()                                 # (this call's arguments are freed after it returns: the next trim)
        return keys

    def release(self, session_id: str, keys: Optional[Iterable[str]] = None) -> int:
        """Let the session's snapshots of `keys` go (None: all of them, and the session has ended: its later
        puts are refused for tombstone_s); how many were held."""
        with self.lock:
            mine = self.sessions.get(session_id, set())
            gone = set(mine) if keys is None else mine.intersection(keys)
            for key in gone:
                del self.held[key]
            mine -= gone
            if keys is None or not mine:
                self.sessions.pop(session_id, None)
            if keys is None:
                now = self.clock()
                self.ended = {s: t for s, t in self.ended.items() if now - t < self.tombstone_s}
                self.ended[session_id] = now
        return len(gone)

    def lend(self, keys: Iterable[str]) -> list:
        """The object references of `keys` (a resume restores from them); KeyError for a key not held here."""
        keys = list(keys)
        with self.lock:
            missing = [k for k in keys if k not in self.held]
            if missing:
                raise KeyError(f"{len(missing)} snapshot(s) not held by this keeper (e.g. {missing[0]})")
            return [self.held[k] for k in keys]

    def census(self) -> dict[str, int]:
        """What it holds: object references (0 once every session it kept for has ended), keys, sessions, and
        the ended sessions it remembers."""
        with self.lock:
            return {"object_refs": held_refs(), "keys": len(self.held), "sessions": len(self.sessions),
                    "tombstones": len(self.ended)}


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
                self._retire(keeper)
                self.keeper = self.start()
        return self.keeper

    @staticmethod
    def _retire(keeper) -> None:
        """A keeper given up on is killed, in case it only seemed gone: the sessions' releases go to its successor,
        so whatever it still held would be held for good."""
        try:
            import ray
            ray.kill(keeper, no_restart=True)
        except Exception:                            # gone already, or not an actor (tests)
            pass
