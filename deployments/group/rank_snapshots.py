"""A rank's snapshots of its sessions (docs/architecture.md, "Sessions that survive faults"): the copy of a
session's state to the host after a chunk, its put into the object store by the session's keeper, and the
report of the puts done to the group.

After every `every_chunks`-th chunk (the group's snapshot_interval_chunks, in the session's SnapshotSchedule) the
copy is queued on the rank's device thread right behind the chunk's reply, so it runs after the reply has gone
and before the device's next chunk; a thread of its own hands it to the keeper, which puts it in the object
store as its owner (so it outlives this process and its node). The keys of the puts done by then go back
with the next chunk's reply, and the copy's time as its "snapshot" stage; a group that hands its sessions on
flushes them all at once. Best effort: a snapshot never fails a chunk (a resume replays more instead).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Optional

from lingbot.runtime.kv_cache import slot_for_chunk
from lingbot.runtime.pipeline import WorldSession
from lingbot.runtime.snapshot import SNAPSHOTS_IN_FLIGHT, HostCopier, take_snapshot

from ..session.events import SnapshotRef
from .messages import ChunkReply, SnapshotSchedule
from .tombstones import Tombstones

log = logging.getLogger(__name__)

SNAPSHOT_PUT_TIMEOUT_S = 60.0


class SessionSnapshots:
    """One session's snapshots on this rank: its plan, the puts not reported yet [(chunk, future)], the chunk of
    its last snapshot (-1: none; the next one copies every K/V slot a continuation needs) and the last copy's
    time, reported with the next chunk."""

    def __init__(self, plan: SnapshotSchedule, last_chunk: int):
        self.plan = plan
        self.puts: list[tuple[int, Future]] = []
        self.last_chunk = last_chunk
        self.copy_s: Optional[float] = None


class RankSnapshots:
    """The rank's copier (on CUDA the copy overlaps the next chunk on a side stream) and put thread, shared by
    its sessions. `on_device(fn, *args)` queues work on the rank's device thread, behind what is queued;
    `trim()` is called after each put (the rank's Trimmer, deployments/memory.py)."""

    def __init__(self, rank: int, world_size: int, copier: HostCopier, on_device: Callable,
                 trim: Callable[[], object] = lambda: None):
        self.rank = rank
        self.trim = trim                               # after a put: its host copy's memory back (memory.py)
        self.world_size = world_size
        self.copier = copier
        self.on_device = on_device
        self.put_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rank{rank}-snapshots")
        self.lock = threading.Lock()
        self.unput = 0                                 # host copies of this rank's sessions not yet put
        self.closed = Tombstones()                     # sessions forgotten: a copy queued behind that is not taken

    def before_chunk(self, session_id: str, session: WorldSession, index: int) -> None:
        """The device waits for a copy still reading the K/V slot chunk `index` is about to write (CUDA)."""
        if self.copier.asynchronous:
            kv = session.dit.kv
            self.copier.before_chunk(session_id, slot_for_chunk(index, kv.sink_chunks, kv.window_chunks))

    def after_chunk(self, session_id: str, session: WorldSession, snaps: SessionSnapshots, index: int,
                    reply: ChunkReply) -> None:
        """On the device thread, after chunk `index`: report the puts done by now and the previous copy's time
        with the reply, and queue this chunk's copy when it is due (else the next due one copies its slot)."""
        reply.snapshots = self.stored(snaps)
        if snaps.copy_s is not None:
            reply.timings["snapshot"], snaps.copy_s = snaps.copy_s, None
        if index % snaps.plan.every_chunks == 0:
            self.on_device(self.take, session_id, session, snaps, False)

    def flush(self, session_id: str, session: Optional[WorldSession], snaps: SessionSnapshots,
              timeout: float = SNAPSHOT_PUT_TIMEOUT_S) -> tuple[SnapshotRef, ...]:
        """The snapshots taken and not reported yet, once stored, with one of the session's last chunk if the
        interval skipped it: a group that hands its sessions on passes them along, so the next group restores
        the last chunk and replays nothing."""
        if session is not None:
            self.on_device(self.take, session_id, session, snaps).result()   # after any copy queued before
        wait([f for _, f in snaps.puts], timeout)
        return self.stored(snaps)

    def stored(self, snaps: SessionSnapshots) -> tuple[SnapshotRef, ...]:
        """Take the finished puts off the session's list: the keys of each that succeeded, one per K/V slot
        (the state's with its newest one). A put that failed lost slots later snapshots would not copy
        again: the next one copies every slot its continuation needs."""
        finished = [(i, f, f.done()) for i, f in snaps.puts]          # asked once: a put may end meanwhile
        snaps.puts[:] = [(i, f) for i, f, ended in finished if not ended]
        refs = []
        for index, put in [(i, f) for i, f, ended in finished if ended]:
            if put.exception() is not None:
                snaps.last_chunk = -1
                continue
            slots, state = put.result()
            refs += [SnapshotRef(chunk, self.rank, key, state if chunk == index else None) for chunk, key in slots]
        return tuple(refs)

    def forget(self, session_id: str) -> None:
        """On the device thread: the session is closed; its host copies go, and a copy queued after this (a chunk's,
        queued as it ended) is not taken."""
        self.closed.add(session_id)
        self.copier.forget(session_id)

    def take(self, session_id: str, session: WorldSession, snaps: SessionSnapshots, force: bool = True) -> None:
        """On the device thread: copy the session as it stands after its last chunk (the K/V slots no earlier
        snapshot copied, and the state) and hand it to the put thread. Skipped (unless `force`) when the keeper
        is behind: SNAPSHOTS_IN_FLIGHT of this session's snapshots not yet reported stored, or as many host
        copies of this rank's sessions not yet put (their memory is counted once per rank: snapshot_budget.py);
        a resume then replays more, and the next snapshot copies the slots this one would have."""
        index, since = session.chunk_index - 1, snaps.last_chunk
        if index <= since or session_id in self.closed:   # taken already (or nothing to take), or closed
            return
        if not force and (len(snaps.puts) >= SNAPSHOTS_IN_FLIGHT or self.unput >= SNAPSHOTS_IN_FLIGHT):
            return
        try:
            t0 = time.perf_counter()
            slots, state = take_snapshot(session, self.rank, self.world_size, self.copier, session_id, since)
            snaps.copy_s = time.perf_counter() - t0      # on CUDA: the time to queue it
        except Exception as e:
            log.warning("session %s: no snapshot of chunk %d (%s)", session_id, index, type(e).__name__)
            return
        snaps.last_chunk = index
        with self.lock:
            self.unput += 1
        put = self.put_thread.submit(self._put, snaps.plan.owner, slots, state, self.copier.last)
        put.add_done_callback(self._one_put)
        snaps.puts.append((index, put))

    def _one_put(self, _: Future) -> None:
        with self.lock:
            self.unput -= 1
        self.trim()

    @staticmethod
    def _put(owner, slots: list, state, copied) -> tuple[list, str]:
        """On the put thread: once the copies have landed (CUDA: the side stream's event), the session's keeper
        (`owner`, a SnapshotOwner) puts the slots and the state; their keys, [(chunk, slot key)] and the state's."""
        import ray
        if copied is not None:
            copied.synchronize()
        # (a put that outlasts the timeout still lands at the keeper, unreported: held until the session ends)
        keys = ray.get(owner.keeper.keep.remote(owner.session_id, slots, state), timeout=SNAPSHOT_PUT_TIMEOUT_S)
        if keys is None:
            raise RuntimeError("the session has ended at its keeper")
        return [(slot.index, key) for slot, key in zip(slots, keys)], keys[-1]
