"""One rank of a group: the engine on its device (plain Python; the group makes it a Ray actor).

Every chunk is one call to every rank (`run_chunk`); the rank runs all steps of the chunk without
returning, checking between steps whether its session was stopped (`stop` arrives on a second thread:
the actor runs with max_concurrency > 1). Rank 0 sends the chunk's uint8 frames straight to the
muxer and returns the reference to the encoded fragment.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

MAX_TOMBSTONES = 10000

import numpy as np
import torch

log = logging.getLogger(__name__)


class RankWorker:
    def __init__(self, settings: dict, rank: int, world_size: int):
        from .settings import ServeSettings
        self.settings = ServeSettings(**settings)
        self.rank = rank
        self.world_size = world_size
        self.pipeline = None
        self.comm = None
        self.sessions: dict[str, Any] = {}
        # stopped/closed ids are kept (bounded): calls of a threaded actor run in any order, so a close can
        # overtake its open, and a stop can land before, during or after the chunk it is meant for
        self.stopped: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()       # sessions / stopped
        self.work = threading.Lock()       # open_session and run_chunk never overlap
        torch.set_grad_enabled(False)

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

    def join(self, init_method: str) -> dict:
        """Join the group's process group and build the pipeline (every rank concurrently)."""
        from lingbot.budget import session_footprint, sessions_that_fit
        from lingbot.checkpoint import build_pipeline
        from lingbot.config import get_preset
        from lingbot.parallel import Comm
        s = self.settings
        device = self._device()
        t0 = time.monotonic()
        self.comm = Comm.init(self.rank, self.world_size, init_method, device, s.collective_timeout_s) \
            if self.world_size > 1 else Comm(device=device)
        self.pipeline = build_pipeline(s.preset, s.model_path, device=device, comm=self.comm,
                                       pixel_mode=s.pixel_mode, skip_fixed_point=s.skip_fixed_point)
        preset = get_preset(s.preset)
        footprint = session_footprint(preset, self.world_size)
        capacity = sessions_that_fit(preset, self.world_size, int(s.memory_budget_gib * 2 ** 30),
                                     s.max_sessions_per_group)
        log.info("rank %d/%d ready on %s in %.1f s; %d sessions fit", self.rank, self.world_size, device,
                 time.monotonic() - t0, capacity)
        return {"capacity": capacity, "session_bytes": footprint.total, "device": str(device),
                "width": preset.width, "height": preset.height, "frames_per_chunk": preset.transformer.num_frames_per_block}

    def _device(self) -> torch.device:
        kind = self.settings.device
        if kind == "cpu":
            return torch.device("cpu")
        # Ray sets CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES per actor: the bundle's device is index 0
        return torch.device(f"{kind}:0")

    # ---- sessions -----------------------------------------------------------------------------
    def open_session(self, session_id: str, image: np.ndarray, prompt: str, seed: int,
                     flow_shift: Optional[float]) -> bool:
        """Build the session; False (and nothing kept) when it was stopped or closed meanwhile."""
        with self.work:
            if self._is_stopped(session_id):
                return False
            pixels = torch.from_numpy(image).permute(2, 0, 1).float() / 255.0
            session = self.pipeline.new_session((pixels - 0.5) / 0.5, prompt, seed)
            if flow_shift is not None:
                session.dit.sampler, session.dit.time = self.pipeline.engine.schedule(flow_shift)
            with self.lock:
                if session_id in self.stopped:          # closed while we were building it
                    return False
                self.sessions[session_id] = session
        return True

    def _is_stopped(self, session_id: str) -> bool:
        with self.lock:
            return session_id in self.stopped

    def stop(self, session_id: str) -> None:
        """May run on another thread while run_chunk runs: the chunk ends at its next step."""
        with self.lock:
            self.stopped[session_id] = None
            while len(self.stopped) > MAX_TOMBSTONES:
                self.stopped.popitem(last=False)

    def close_session(self, session_id: str) -> None:
        """Forget a session (its memory goes with the last reference); it can never be opened again."""
        self.stop(session_id)
        with self.lock:
            self.sessions.pop(session_id, None)

    def run_chunk(self, session_id: str, index: int, controls, muxer=None) -> dict:
        """Run chunk `index` of a session: condition, 4 probes, commit, decode, pixels to the root."""
        from lingbot.camera import Controls
        with self.work:
            session = self.sessions.get(session_id)

            def should_stop() -> bool:
                # the ranks agree (over the CPU control group): a stop, or a close that reached only some
                # ranks so far, ends the chunk at the same step everywhere; a lone rank would hang its collectives
                return self.comm.any_true(session is None or self._is_stopped(session_id))

            if should_stop():
                return {"stopped": True}
            if session.chunk_index != index:
                raise RuntimeError(f"session {session_id} is at chunk {session.chunk_index}, asked for {index}")
            t0 = time.perf_counter()
            engine = self.pipeline.engine
            engine.profile = controls.profile            # device sync at stage boundaries only while profiling
            prompt = None if controls.prompt is None else (controls.prompt, controls.prompt_transition_chunks)
            try:
                chunk = session.step(Controls(keys=controls.keys, camera=controls.camera), should_stop=should_stop,
                                     prompt=prompt)
            finally:
                engine.profile = False
            if chunk is None:
                return {"stopped": True}
        out = {"stopped": False, "timings": chunk.timings, "engine_s": time.perf_counter() - t0}
        if chunk.frames is not None and muxer is not None:
            frames = chunk.frames.cpu().numpy()                   # the one device -> host copy, uint8
            out["fragment"] = muxer.encode.remote(session_id, index, frames, time.perf_counter())
        return out
