"""One rank of a group: the pipeline on its device (plain Python; the group makes it a Ray actor).

Every chunk is one call to every rank (`run_chunk`); the rank runs all steps of the chunk without
returning, checking between steps whether its session was stopped (`stop` arrives on a second thread:
the actor runs with max_concurrency > 1). Rank 0 sends the chunk's uint8 frames straight to the
muxer and returns the reference to the encoded fragment. The rank only calls the pipeline's API.

All device work (join, open_session, run_chunk) runs on one thread of the rank's own, whatever Ray thread
the call came in on: the CUDA current device, grad mode and CUDA graph trees are per thread (a graph tree
recorded at warm-up on one thread would be recorded again, in a pool of its own, on every other thread).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional

import numpy as np
import torch

from lingbot.camera import CameraRig, Controls, Trajectory
from lingbot.runtime.kv_cache import slot_for_chunk
from lingbot.runtime.pipeline import WorldSession
from lingbot.runtime.snapshot import SNAPSHOTS_IN_FLIGHT, HostCopier, restore_snapshots, take_snapshot

from ..session.events import ChunkControls, ModelFacts, RankRestore, SnapshotRef
from ..settings import ServeSettings
from .messages import ChunkReply, DeviceStats, RankInfo
from .tombstones import Tombstones

log = logging.getLogger(__name__)

SNAPSHOT_PUT_TIMEOUT_S = 60.0


def assigned_device(kind: str, assigned: dict, env: dict) -> str:
    """The torch device of the accelerator Ray assigned to this actor (`get_accelerator_ids()`: GPU or NPU
    ids as the node numbers them). Ray also narrows CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES to
    the assignment, and torch numbers the visible devices from 0: the index is the id's position there
    (the id itself when the variable is unset, e.g. with Ray's NOSET_*_VISIBLE_DEVICES)."""
    resource, variable = {"cuda": ("GPU", "CUDA_VISIBLE_DEVICES"),
                          "npu": ("NPU", "ASCEND_RT_VISIBLE_DEVICES")}[kind]
    ids = [str(i) for i in assigned.get(resource, [])]
    if not ids:
        raise RuntimeError(f"this rank was assigned no {resource} by Ray (rank_devices must be > 0 for {kind})")
    visible = [v.strip() for v in env.get(variable, "").split(",") if v.strip()]
    if visible:
        if ids[0] not in visible:
            raise RuntimeError(f"assigned {resource} {ids[0]} is not in {variable}={env[variable]}")
        return f"{kind}:{visible.index(ids[0])}"
    return f"{kind}:{int(ids[0])}"


class RankWorker:
    def __init__(self, settings: dict, rank: int, world_size: int):
        self.settings = ServeSettings(**settings)
        self.rank = rank
        self.world_size = world_size
        self.device = self._device()
        self.pipeline = None
        self.comm = None
        self.sessions: dict[str, WorldSession] = {}
        self.stopped = Tombstones()         # stopped or closed sessions: a close can overtake its open
        self.aborts: dict[str, int] = {}    # session -> index of a chunk to give up (it will be run again)
        self._last_cpu: Optional[tuple[float, float]] = None    # CPU device stats: the previous sample
        self.lock = threading.Lock()        # sessions / stopped
        # snapshots (resume): each session's keeper (the owner of its snapshots), the puts not yet reported and
        # the chunk of its last snapshot (-1: none; the next one copies every K/V slot a continuation needs)
        self.keepers: dict[str, object] = {}
        self.puts: dict[str, list] = {}
        self.snapshotted: dict[str, int] = {}
        self.snapshot_s: dict[str, float] = {}      # the last host copy's time, reported with the next chunk
        self.copier = HostCopier(self.device)        # on CUDA the copy overlaps the next chunk (a side stream)
        self.snapshot_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rank{rank}-snapshots")
        self.device_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rank{rank}-device")
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
        s = self.settings
        t0 = time.monotonic()
        life = RankLifecycle(self.rank, self.world_size, self.device)
        self.comm = life.connect(init_method, s.collective_timeout_s, start_timeout_s=s.group_start_timeout_s)
        self.pipeline = life.load(s.preset, s.model_path, dtype=s.dtype, pixel_mode=s.pixel_mode,
                                  skip_fixed_point=s.skip_fixed_point, compile=s.compile, cuda_graphs=s.cuda_graphs,
                                  decoder=s.decoder_names, tae_path=s.tae_path)
        warmup = life.warm_up()
        life.measure()
        capacity = life.capacity(s.max_sessions_per_group, s.budget_bytes)
        preset = self.pipeline.preset                # after any checkpoint config.json: what this rank runs
        log.info("rank %d/%d ready on %s in %.1f s (warm-up %.1f s); %d sessions fit", self.rank, self.world_size,
                 self.device, time.monotonic() - t0, warmup.seconds, capacity)
        decoders = tuple(self.pipeline.decoders)
        return RankInfo(capacity, session_footprint(preset, self.world_size, decoders, self.device).total,
                        str(self.device), ModelFacts.of(preset, random_weights=s.model_path is None,
                                                        decoders=decoders), warmup.seconds,
                        self._snapshot_sessions(preset) if s.snapshots else None)

    def _snapshot_sessions(self, preset) -> int:
        """Sessions whose snapshots this group's node holds (every rank counts the whole group: they share it)."""
        from .snapshots import node_host, snapshot_sessions
        sessions, budget, host = snapshot_sessions(self.settings, preset, *node_host())
        if self.rank == 0:
            log.info("snapshots: %d sessions fit in %.1f GiB of host memory (%.2f GiB per session, %.2f GiB once; "
                     "every %d chunks)", sessions, budget / 2 ** 30, host.per_session / 2 ** 30, host.once / 2 ** 30,
                     self.settings.snapshot_interval_chunks)
        return sessions

    def _device(self) -> torch.device:
        kind = self.settings.device
        if kind == "cpu":
            return torch.device("cpu")
        import ray
        if kind == "npu":
            import torch_npu  # noqa: F401  (registers the npu device type with torch)
        assigned = ray.get_runtime_context().get_accelerator_ids()
        return torch.device(assigned_device(kind, assigned, os.environ))

    def device_stats(self) -> Optional[DeviceStats]:
        """This rank's own device. Accelerators are asked through torch, which numbers devices as this
        process sees them, so the stats are this rank's device whatever index the node gives it. On CPU
        the device is the rank's process: its CPU time per wall second (percent of one core) and its
        resident memory."""
        if self.device.type == "cpu":
            return self._process_stats()
        if self.device.type != "cuda":
            return None
        try:
            free, total = torch.cuda.mem_get_info(self.device)
        except Exception as e:                # a driver hiccup must not take the rank down
            log.warning("rank %d: device memory unavailable: %s", self.rank, e)
            return None
        try:
            utilization = float(torch.cuda.utilization(self.device))      # through NVML (nvidia-ml-py)
        except Exception as e:
            if not getattr(self, "_warned_utilization", False):
                log.warning("rank %d: device utilisation unavailable (NVML): %s", self.rank, e)
                self._warned_utilization = True
            utilization = float("nan")
        return DeviceStats(utilization, total - free)

    def _process_stats(self) -> DeviceStats:
        import psutil
        proc = psutil.Process()
        now, cpu = time.monotonic(), sum(proc.cpu_times()[:2])
        last, self._last_cpu = self._last_cpu, (now, cpu)
        utilization = float("nan") if last is None else 100.0 * (cpu - last[1]) / max(now - last[0], 1e-9)
        return DeviceStats(utilization, proc.memory_info().rss)

    # ---- sessions -----------------------------------------------------------------------------
    def open_session(self, session_id: str, image: np.ndarray, prompt: str, seed: int,
                     flow_shift: Optional[float], trajectory: Optional[Trajectory] = None, keeper=None,
                     restore: Optional[RankRestore] = None, decoder: Optional[str] = None) -> Optional[int]:
        """Build the session; the chunk it continues from (0, or after the chunk of `restore`, this rank's share
        of a resumed session's snapshots, when they could all be read); None (nothing kept) when it was
        stopped or closed meanwhile. With a `keeper`, every committed chunk is snapshotted and handed to it."""
        restored = None
        if restore is not None:
            try:                                    # a snapshot lost with its node: the session replays instead
                import ray
                restored = ray.get(list(restore.slots), timeout=60), ray.get(restore.state, timeout=60)
            except Exception as e:
                log.warning("session %s: snapshots unavailable (%s); it will be replayed", session_id,
                            type(e).__name__)
        return self._on_device(self._open_session, session_id, image, prompt, seed, flow_shift, trajectory, keeper,
                               restored, decoder)

    def _open_session(self, session_id: str, image: np.ndarray, prompt: str, seed: int,
                      flow_shift: Optional[float], trajectory: Optional[Trajectory], keeper,
                      restored: Optional[list], decoder: Optional[str] = None) -> Optional[int]:
        if self._is_stopped(session_id):
            return None
        preset = self.pipeline.runner.preset
        rig = CameraRig.default(preset.width, preset.height, trajectory)
        session = self.pipeline.new_session(image, prompt, seed, rig=rig, flow_shift=flow_shift, decoder=decoder)
        if restored:
            try:
                restore_snapshots(session, *restored, self.rank, self.world_size)
            except ValueError as e:                 # another group size, or a gap: replay instead
                log.warning("session %s: snapshots not restorable (%s); it will be replayed", session_id, e)
                session.reset()
        with self.lock:
            if session_id in self.stopped:              # closed while we were building it
                return None
            self.sessions[session_id] = session
            if keeper is not None:
                self.keepers[session_id] = keeper
                self.puts[session_id] = []
                # restored: the keeper holds the slots its continuation attends (the ledger keeps them)
                self.snapshotted[session_id] = session.chunk_index - 1
        return session.chunk_index

    def reset_session(self, session_id: str) -> None:
        """Back to before its first chunk (a resume whose snapshots only some ranks could restore)."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._on_device(self._reset, session_id, session)

    def _reset(self, session_id: str, session: WorldSession) -> None:
        session.reset()
        if session_id in self.snapshotted:
            self.snapshotted[session_id] = -1

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
            self.aborts.pop(session_id, None)
            self.keepers.pop(session_id, None)
            self.puts.pop(session_id, None)
            self.snapshot_s.pop(session_id, None)
            self.snapshotted.pop(session_id, None)
        self.device_thread.submit(self.copier.forget, session_id)

    def abort_chunk(self, session_id: str, index: int) -> None:
        """Give up chunk `index` of the session at its next step before the commit (the group runs it again
        with a control that arrived meanwhile). Runs on another thread while run_chunk runs; a chunk past its
        last check finishes as usual."""
        with self.lock:
            self.aborts[session_id] = index

    def run_chunk(self, session_id: str, index: int, controls: ChunkControls, muxer=None) -> ChunkReply:
        """Run chunk `index` of a session: condition, 4 probes, commit, decode, pixels to the root."""
        return self._on_device(self._run_chunk, session_id, index, controls, muxer)

    def _run_chunk(self, session_id: str, index: int, controls: ChunkControls, muxer) -> ChunkReply:
        session = self.sessions.get(session_id)

        def should_stop() -> bool:
            # the ranks agree (over the CPU control group): a stop, an abort, or a close that reached only
            # some ranks so far ends the chunk at the same step everywhere; a lone rank would hang its collectives
            with self.lock:
                aborted = self.aborts.get(session_id) == index
            return self.comm.any_true(session is None or self._is_stopped(session_id) or aborted)

        try:
            return self._step(session, session_id, index, controls, muxer, should_stop)
        finally:
            with self.lock:
                if self.aborts.get(session_id) == index:
                    del self.aborts[session_id]

    def _step(self, session, session_id: str, index: int, controls: ChunkControls, muxer, should_stop) -> ChunkReply:
        if should_stop():
            return ChunkReply(stopped=True)
        if session.chunk_index != index:
            raise RuntimeError(f"session {session_id} is at chunk {session.chunk_index}, asked for {index}")
        t0 = time.perf_counter()
        if self.copier.asynchronous:                 # a snapshot copy still reading this chunk's K/V slot
            kv = session.dit.kv
            self.copier.before_chunk(session_id, slot_for_chunk(index, kv.sink_chunks, kv.window_chunks))
        prompt = None if controls.prompt is None else (controls.prompt, controls.prompt_transition_chunks)
        chunk = session.step(Controls(keys=controls.keys, camera=controls.camera), should_stop=should_stop,
                             prompt=prompt, profile=controls.profile)
        if chunk is None:
            return ChunkReply(stopped=True)
        reply = ChunkReply(stopped=False, timings=chunk.timings, engine_s=time.perf_counter() - t0)
        if chunk.frames is not None and muxer is not None:
            frames = chunk.frames.cpu().numpy()                   # the one device -> host copy, uint8
            reply.fragment = muxer.encode.remote(session_id, index, frames, time.perf_counter())
        self._snapshot(session_id, session, index, reply)
        return reply

    def flush_snapshots(self, session_id: str, timeout: float = SNAPSHOT_PUT_TIMEOUT_S) -> tuple[SnapshotRef, ...]:
        """The snapshots taken and not reported yet, once stored, with one of the session's last chunk if the
        interval (snapshot_interval_chunks) skipped it: a group that hands its sessions on (drain) passes them
        along, so the next group restores the last chunk and replays nothing."""
        puts = self.puts.get(session_id)
        if puts is None:
            return ()
        session, keeper = self.sessions.get(session_id), self.keepers.get(session_id)
        if session is not None and keeper is not None:
            self._on_device(self._take, session_id, session, keeper, puts)   # after any take queued before
        wait([f for _, f in puts], timeout)
        return self._stored(session_id, puts)

    def _stored(self, session_id: str, puts: list) -> tuple[SnapshotRef, ...]:
        """Take the finished puts off `puts`: the references of each that succeeded, one per K/V slot (the
        state's with its newest one). A put that failed lost slots later snapshots would not copy again: the
        next one copies every slot its continuation needs."""
        finished = [(i, f, f.done()) for i, f in puts]          # asked once: a put may end meanwhile
        done = [(i, f) for i, f, ended in finished if ended]
        puts[:] = [(i, f) for i, f, ended in finished if not ended]
        refs = []
        for index, put in done:
            if put.exception() is not None:
                if session_id in self.snapshotted:
                    self.snapshotted[session_id] = -1
                continue
            slots, state = put.result()
            refs += [SnapshotRef(chunk, self.rank, slot, state if chunk == index else None) for chunk, slot in slots]
        return tuple(refs)

    def _snapshot(self, session_id: str, session: WorldSession, index: int, reply: ChunkReply) -> None:
        """Snapshot the session's state after this chunk when it is due (every snapshot_interval_chunks-th
        chunk: a resume then replays at most that many chunks less one): the copy to the host is queued on
        the device thread right behind this call, so it runs after the reply has gone (before any next chunk
        of the device); a thread of its own hands it to the session's keeper, which puts it in the object
        store as its owner (so it outlives this process and its node). References of the puts done by now go
        back with the reply, and the previous copy's time as its "snapshot" stage."""
        keeper = self.keepers.get(session_id)
        puts = self.puts.get(session_id)
        if keeper is None or puts is None:
            return
        reply.snapshots = self._stored(session_id, puts)
        if session_id in self.snapshot_s:
            reply.timings["snapshot"] = self.snapshot_s.pop(session_id)
        if index % self.settings.snapshot_interval_chunks == 0:    # due (else the next due one copies its slot)
            self.device_thread.submit(self._take, session_id, session, keeper, puts, False)

    def _take(self, session_id: str, session: WorldSession, keeper, puts: list, force: bool = True) -> None:
        """On the device thread: copy the session as it stands after its last chunk (the K/V slots no earlier
        snapshot copied, and the state) and hand it to the put thread. Skipped (unless `force`) when the keeper
        is behind: SNAPSHOTS_IN_FLIGHT of this session's snapshots not yet reported stored, or as many host
        copies of this rank's sessions not yet put (their memory is counted once per rank: snapshot_budget.py);
        a resume then replays more, and the next snapshot copies the slots this one would have. Best effort:
        never fails a chunk."""
        index, since = session.chunk_index - 1, self.snapshotted.get(session_id, -1)
        if index <= since:                           # taken already (or nothing to take)
            return
        unput = sum(not put.done() for waiting in list(self.puts.values()) for _, put in list(waiting))
        if not force and (len(puts) >= SNAPSHOTS_IN_FLIGHT or unput >= SNAPSHOTS_IN_FLIGHT):
            return
        try:
            t0 = time.perf_counter()
            slots, state = take_snapshot(session, self.rank, self.world_size, self.copier, session_id, since)
            self.snapshot_s[session_id] = time.perf_counter() - t0      # on CUDA: the time to queue it
        except Exception as e:
            log.warning("session %s: no snapshot of chunk %d (%s)", session_id, index, type(e).__name__)
            return
        self.snapshotted[session_id] = index
        puts.append((index, self.snapshot_thread.submit(self._put, keeper, slots, state, self.copier.last)))

    @staticmethod
    def _put(keeper, slots: list, state, copied) -> tuple[list, object]:
        """On the put thread: once the copies have landed (CUDA: the side stream's event), the keeper puts the
        slots and the state; their references, [(chunk, slot ref)] and the state's."""
        import ray
        if copied is not None:
            copied.synchronize()
        refs = ray.get(keeper.keep.remote(slots, state), timeout=SNAPSHOT_PUT_TIMEOUT_S)
        return [(slot.index, ref) for slot, ref in zip(slots, refs)], refs[-1]
