"""One rank of a group: the pipeline on its device (plain Python; the group makes it a Ray actor and calls it
only through RankExecutor, executor.py).

Every chunk is one call to every rank (`run_chunk`); the rank runs all steps of the chunk without
returning, checking between steps whether its session was stopped (`stop` arrives on a second thread:
the actor runs with max_concurrency > 1). Rank 0 sends the chunk's uint8 frames straight to the
muxer and returns the reference to the encoded fragment. The rank only calls the pipeline's API.

All device work (join, open_session, run_chunk, the snapshot copies) runs on one thread of the rank's own,
whatever Ray thread the call came in on: the CUDA current device, grad mode and CUDA graph trees are per thread
(a graph tree recorded at warm-up on one thread would be recorded again, in a pool of its own, on every other
thread).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from lingbot.runtime.journal import apply, open_world
from lingbot.runtime.pipeline import WorldSession
from lingbot.runtime.snapshot import HostCopier, restore_snapshots

from ..memory import Trimmer, held_refs, keep_large_blocks_mapped
from ..session.events import ModelFacts, RankRestore, SnapshotRef
from ..settings import ServeSettings
from .device import DeviceProbe, rank_device
from .ladder import ladder_floor
from .messages import ChunkReply, DeviceStats, OpenSession, RankInfo, RunChunk
from .rank_snapshots import SNAPSHOT_PUT_TIMEOUT_S, RankSnapshots, SessionSnapshots
from .tombstones import Tombstones

log = logging.getLogger(__name__)

RESTORE_TIMEOUT_S = 60.0


@dataclass
class RankSession:
    """One session on this rank: its state on the device, its snapshots (None: it keeps none) and the index of
    a chunk to give up at its next step (the group runs it again with a control that arrived meanwhile)."""
    world: WorldSession
    snapshots: Optional[SessionSnapshots] = None
    abort_index: Optional[int] = None


class RankWorker:
    def __init__(self, settings: dict, rank: int, world_size: int):
        self.settings = ServeSettings(**settings)
        self.rank = rank
        self.world_size = world_size
        self.device = rank_device(self.settings.device)
        self.pipeline = None
        self.comm = None
        self.sessions: dict[str, RankSession] = {}
        self.stopped = Tombstones()         # stopped or closed sessions: a close can overtake its open
        self.lock = threading.Lock()        # sessions, stopped, abort indices
        self.device_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rank{rank}-device")
        self.probe = DeviceProbe(self.device, rank)
        keep_large_blocks_mapped()           # a snapshot's host copy never enters a malloc arena (memory.py)
        self.trim = Trimmer()                # freed host memory back to the system (deployments/memory.py)
        # on CUDA a snapshot's copy overlaps the next chunk (a side stream)
        self.snapshots = RankSnapshots(rank, world_size, HostCopier(self.device), self.device_thread.submit,
                                       self.trim)
        self._on_device(torch.set_grad_enabled, False)

    def _on_device(self, fn, *args):
        """Run fn(*args) on the device thread (one at a time: open_session and run_chunk never overlap)."""
        return self.device_thread.submit(fn, *args).result()

    def alive(self) -> bool:
        """For the group's watcher: answers on any free thread, whatever the device is doing."""
        return True

    # ---- set-up -------------------------------------------------------------------------------
    def address(self) -> str:
        """rank 0 picks the rendezvous address: this node's IP and a free port."""
        from lingbot.parallel.comm import free_port
        ip = socket.gethostbyname(socket.gethostname())
        try:
            import ray
            ip = ray.util.get_node_ip_address()
        except Exception:
            pass
        return f"tcp://{ip}:{free_port('0.0.0.0')}"

    def join(self, init_method: str) -> RankInfo:
        """The rank's lifecycle up to serving (every rank concurrently): connect, load, warm up, measure,
        capacity. The group replica, and so /readyz, is ready only once every rank returned from here."""
        return self._on_device(self._join, init_method)

    def _join(self, init_method: str) -> RankInfo:
        from lingbot.lifecycle import RankLifecycle
        from lingbot.runtime.budget import session_footprint
        from lingbot.runtime.snapshot_budget import snapshot_host
        s = self.settings
        t0 = time.monotonic()
        life = RankLifecycle(self.rank, self.world_size, self.device)
        self.comm = life.connect(init_method, s.collective_timeout_s, start_timeout_s=s.group_start_timeout_s)
        self.pipeline = life.load(s.preset, s.model_path, dtype=s.dtype, pixel_mode=s.pixel_mode,
                                  skip_fixed_point=s.skip_fixed_point, compile=s.compile, cuda_graphs=s.cuda_graphs,
                                  decoder=s.decoder_names, tae_path=s.tae_path)
        warmup = life.warm_up()
        floor = ladder_floor(s, tuple(self.pipeline.decoders))
        # (the ladder may be switched on later by the group's user_config: measured where it starts on, or where
        # the floor is the decoder rung, which only the ladder runs)
        ladder = s.quality_ladder == "auto" or floor.decoder is not None
        rung_s = {"full": warmup.steady_chunk_s, **life.measure_rungs(floor)} if ladder and floor.name != "full" \
            else None
        life.measure()
        capacity = life.capacity(s.max_sessions_per_group, s.budget_bytes)
        preset = self.pipeline.preset                # after any checkpoint config.json: what this rank runs
        log.info("rank %d/%d ready on %s in %.1f s (warm-up %.1f s); %d sessions fit", self.rank, self.world_size,
                 self.device, time.monotonic() - t0, warmup.seconds, capacity)
        decoders = tuple(self.pipeline.decoders)
        # what a session's snapshots cost the group's host: a fact of the model, reported once (by rank 0)
        host = snapshot_host(preset, self.world_size, s.snapshot_interval_chunks, cuda=self.device.type == "cuda",
                             decoders=decoders) if s.snapshots and self.rank == 0 else None
        return RankInfo(capacity, session_footprint(preset, self.world_size, decoders, self.device).total,
                        str(self.device), ModelFacts.of(preset, random_weights=s.model_path is None,
                                                        decoders=decoders), warmup.seconds, host, rung_s)

    def device_stats(self) -> Optional[DeviceStats]:
        """This rank's own device (device.DeviceProbe)."""
        return self.probe.stats()

    # ---- sessions -----------------------------------------------------------------------------
    def open_session(self, call: OpenSession) -> Optional[int]:
        """Build the session; the chunk it continues from (0, or after the chunk of `call.restore`, this rank's
        share of a resumed session's snapshots, when they could all be read); None (nothing kept) when it was
        stopped or closed meanwhile. With a snapshot plan, every due chunk is snapshotted and handed to its
        keeper."""
        restored = self._read_restore(call.session_id, call.restore) if call.restore is not None else None
        return self._on_device(self._open_session, call, restored)

    @staticmethod
    def _read_restore(session_id: str, restore: RankRestore) -> Optional[tuple]:
        """The slots and state of `restore`, lent by the keeper that holds them; None (the session replays
        instead) when that keeper is gone, or no longer holds one of them."""
        try:
            import ray
            if restore.owner is None:
                raise LookupError("no keeper holds them")
            refs = ray.get(restore.owner.keeper.lend.remote([*restore.slots, restore.state]), timeout=RESTORE_TIMEOUT_S)
            got = ray.get(refs, timeout=RESTORE_TIMEOUT_S)
            return got[:-1], got[-1]
        except Exception as e:
            log.warning("session %s: snapshots unavailable (%s); it will be replayed", session_id, type(e).__name__)
            return None

    def _open_session(self, call: OpenSession, restored: Optional[tuple]) -> Optional[int]:
        sid, start = call.session_id, call.start
        if self._is_stopped(sid):
            return None
        world = open_world(self.pipeline, start.image, start.prompt, start.seed, start.trajectory, start.flow_shift,
                           start.decoder, start.window)
        if restored:
            try:
                restore_snapshots(world, *restored, self.rank, self.world_size)
            except ValueError as e:                 # another group size, or a gap: replay instead
                log.warning("session %s: snapshots not restorable (%s); it will be replayed", sid, e)
                world.reset()
        # restored: the keeper holds the slots its continuation attends (the ledger keeps them)
        snaps = None if call.snapshots is None else SessionSnapshots(call.snapshots, world.chunk_index - 1)
        with self.lock:
            if sid in self.stopped:                 # closed while we were building it
                return None
            self.sessions[sid] = RankSession(world, snaps)
        return world.chunk_index

    def reset_session(self, session_id: str) -> None:
        """Back to before its first chunk (a resume whose snapshots only some ranks could restore)."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._on_device(self._reset, session)

    @staticmethod
    def _reset(session: RankSession) -> None:
        session.world.reset()
        if session.snapshots is not None:
            session.snapshots.last_chunk = -1

    def _is_stopped(self, session_id: str) -> bool:
        with self.lock:
            return session_id in self.stopped

    def stop(self, session_id: str) -> None:
        """May run on another thread while run_chunk runs: the chunk ends at its next step."""
        with self.lock:
            self.stopped.add(session_id)

    def close_session(self, session_id: str) -> None:
        """Forget a session (its memory goes with the last reference); it can never be opened again."""
        with self.lock:
            self.stopped.add(session_id)
            self.sessions.pop(session_id, None)
        self.device_thread.submit(self.snapshots.forget, session_id)
        self.trim()

    def holdings(self) -> dict[str, int]:
        """What the rank holds for its sessions (every count 0 once none is open; the tombstones are bounded and
        left out) and the object references it holds."""
        with self.lock:
            sessions = len(self.sessions)
        copier = self.snapshots.copier
        return {"sessions": sessions, "snapshot_copies": len(copier.copies), "copies_pending": len(copier.pending),
                "snapshots_unput": self.snapshots.unput, "object_refs": held_refs()}

    def abort_chunk(self, session_id: str, index: int) -> None:
        """Give up chunk `index` of the session at its next step before the commit (the group runs it again
        with a control that arrived meanwhile). Runs on another thread while run_chunk runs; a chunk past its
        last check finishes as usual."""
        with self.lock:
            session = self.sessions.get(session_id)
            if session is not None:
                session.abort_index = index

    def run_chunk(self, call: RunChunk) -> ChunkReply:
        """Run one chunk of a session: condition, the denoising probes, commit, decode, pixels to the root."""
        return self._on_device(self._run_chunk, call)

    def _run_chunk(self, call: RunChunk) -> ChunkReply:
        sid, index = call.session_id, call.index
        session = self.sessions.get(sid)

        def should_stop() -> bool:
            # the ranks agree (over the CPU control group): a stop, an abort, or a close that reached only
            # some ranks so far ends the chunk at the same step everywhere; a lone rank would hang its collectives
            with self.lock:
                aborted = session is not None and session.abort_index == index
            return self.comm.any_true(session is None or self._is_stopped(sid) or aborted)

        try:
            return self._step(session, call, should_stop)
        finally:
            with self.lock:
                if session is not None and session.abort_index == index:
                    session.abort_index = None

    def _step(self, session: Optional[RankSession], call: RunChunk, should_stop) -> ChunkReply:
        if should_stop():
            return ChunkReply(stopped=True)
        world, controls = session.world, call.controls
        if world.chunk_index != call.index:
            raise RuntimeError(f"session {call.session_id} is at chunk {world.chunk_index}, asked for {call.index}")
        t0 = time.perf_counter()
        self.snapshots.before_chunk(call.session_id, world, call.index)
        chunk, warm = apply(world, controls, call.index, should_stop)
        if chunk is None:
            return ChunkReply(stopped=True)
        reply = ChunkReply(stopped=False, timings=chunk.timings, engine_s=time.perf_counter() - t0, warm=warm)
        if chunk.frames is not None and call.muxer is not None:
            frames = chunk.frames.cpu().numpy()                   # the one device -> host copy, uint8
            reply.fragment = call.muxer.encode.remote(call.session_id, call.index, frames, time.perf_counter())
        if session.snapshots is not None:
            self.snapshots.after_chunk(call.session_id, world, session.snapshots, call.index, reply)
        return reply

    def flush_snapshots(self, session_id: str, timeout_s: float = SNAPSHOT_PUT_TIMEOUT_S) -> tuple[SnapshotRef, ...]:
        """The session's snapshots taken and not reported yet, once stored (RankSnapshots.flush)."""
        session = self.sessions.get(session_id)
        if session is None or session.snapshots is None:
            return ()
        return self.snapshots.flush(session_id, session.world, session.snapshots, timeout_s)
