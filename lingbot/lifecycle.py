"""A rank's life before its first session, in named steps (the serving actor only calls them, in order). It
sits one floor above the builder, which it loads through, and the runtime, whose warm-up and budget it runs:

    connect  -> the device and the group's process group (NCCL communicators formed here, not mid-session)
    load     -> weights straight to the device in their dtype, parallelism, regional compile; then wait for
                every rank of the group to have loaded, within the group start timeout (rank 0 also loads
                the text encoder, and storage may be slow): the first collective after load (the warm-up's
                prompt broadcast) then waits for no rank's load under the short chunk-collective timeout
    warm_up  -> the attention kernel is chosen at the steady-state shape; then a throwaway session runs
                through every window length a session passes through (chunks 0 to window_chunks), so
                compiles, kernel choices and allocator growth happen here, never in a viewer's time to
                first chunk; then the session is freed. Eager on CPU none of those depend on the window's
                length: one chunk (every code path once) is the warm-up there
    measure  -> device memory after warm-up
    capacity -> sessions this rank can hold

Capacity on an accelerator comes from the measured memory: what is free on the device after warm-up (the
allocator's unused cache handed back first; what the rank holds for good, CUDA graphs and their static
buffers included, is not free), less the transient memory of one chunk (the warm-up's peak beyond what
it held after warm-up and one session: activations, the chunk's camera modulation; once, as a group runs
one chunk at a time), the shared caches at full size and a safety margin, divided by the per-session
footprint, capped by the config. A configured budget overrides the measurement, and is the rule on CPU:
there what the rank holds once is counted from the config (budget.rank_footprint).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .builder import build_pipeline
from .camera import Controls
from .parallel.comm import Comm
from .runtime.attention import choose_for_steady_state
from .runtime.budget import CPU_BUDGET_BYTES, session_footprint, sessions_that_fit, shared_cache_bytes
from .runtime.compile import blocks_compiled
from .runtime.pipeline import WorldPipeline

log = logging.getLogger(__name__)

MEMORY_MARGIN = 0.05            # of the device's memory, kept free for fragmentation and stray buffers


@dataclass(frozen=True)
class WarmupReport:
    chunks: int
    seconds: float
    first_chunk_s: float            # where compiles land
    steady_chunk_s: float           # the last warm-up chunk


@dataclass(frozen=True)
class MemoryReport:
    """Bytes on this rank's device (None on CPU, where the configured budget rules)."""
    total: int
    free: int                       # free on the device (the allocator's unused cache handed back first)
    allocated: int                  # live tensors after warm-up (weights, caches)
    peak: int                       # peak live tensors during warm-up (one session and its activations)
    loaded: int                     # live tensors after load, before warm-up


class RankLifecycle:
    def __init__(self, rank: int, world_size: int, device: torch.device | str):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.comm: Optional[Comm] = None
        self.pipeline: Optional[WorldPipeline] = None
        self.loaded_bytes = 0
        self.cuda_graphs = False
        self.waited_for_group_s = 0.0       # after load, for the slowest rank (the group start timeout)
        self.warmup: Optional[WarmupReport] = None
        self.attention_kernel: Optional[str] = None
        self.memory: Optional[MemoryReport] = None

    # ---- 1. connect ---------------------------------------------------------------------------
    def connect(self, init_method: Optional[str], timeout_s: float, start_timeout_s: Optional[float] = None) -> Comm:
        """The device, then the process group (every rank calls this concurrently; world size 1 needs none).
        `timeout_s`: the collectives of chunks; `start_timeout_s` (default the same): the rendezvous and the
        wait for every rank after load."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True          # the VAE's convolutions: fixed shapes, pick once
        self.comm = Comm.init(self.rank, self.world_size, init_method, self.device, timeout_s, start_timeout_s) \
            if self.world_size > 1 else Comm(device=self.device)
        return self.comm

    # ---- 2. load ------------------------------------------------------------------------------
    def load(self, preset: str, model_path: Optional[str] = None, **pipeline_kwargs) -> WorldPipeline:
        torch.set_grad_enabled(False)
        self.pipeline = build_pipeline(preset, model_path, device=self.device, comm=self.comm, **pipeline_kwargs)
        self.cuda_graphs = bool(pipeline_kwargs.get("cuda_graphs")) and self.device.type == "cuda"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.loaded_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        self.comm.wait_for_group(after="load")
        self.waited_for_group_s = time.perf_counter() - t0
        if self.world_size > 1:
            log.info("rank %d loaded; waited %.1f s for the other ranks to load", self.rank, self.waited_for_group_s)
        return self.pipeline

    @property
    def compiled(self) -> bool:
        """Whether the loaded DiT's regions are compiled (the builder's choice: the config, else the device's
        default; CUDA graphs are compiled regions too)."""
        return self.pipeline is not None and blocks_compiled(self.pipeline.runner.model)

    # ---- 3. warm up ---------------------------------------------------------------------------
    def warm_up(self, chunks: Optional[int] = None) -> WarmupReport:
        """Run a throwaway session through every window length (window_chunks + 1 chunks by default; one
        chunk eager on CPU, warm_up_chunks), with keys, then free it. Every rank of the group runs it together
        (it holds the same collectives)."""
        pipeline = self.pipeline
        preset = pipeline.preset
        cfg = preset.transformer
        self.attention_kernel, _ = choose_for_steady_state(pipeline.runner.model, preset, self.device)
        if self.device.type == "cuda":                     # the probe is not a session's: off the peak
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        chunks = chunks or warm_up_chunks(cfg.window_chunks, self.device, self.compiled)
        image = np.zeros((preset.height, preset.width, 3), dtype=np.uint8)
        session = pipeline.new_session(image, "warm-up", seed=0)
        keys = Controls(keys=("w", "l", "i")[:preset.transformer.num_frames_per_block])
        times = []
        t0 = time.perf_counter()
        for _ in range(chunks):
            t = time.perf_counter()
            chunk = session.step(keys, profile=True)
            if chunk.frames is not None:
                chunk.frames.cpu()                          # the frame copy a served chunk makes, too
            times.append(time.perf_counter() - t)
        del session, chunk
        self.warmup = WarmupReport(chunks, time.perf_counter() - t0, times[0], times[-1])
        log.info("rank %d warmed up: %d chunks in %.1f s (first %.2f s, last %.3f s)", self.rank, chunks,
                 self.warmup.seconds, times[0], times[-1])
        return self.warmup

    def measure_rungs(self, floor) -> dict[str, float]:
        """Seconds one chunk takes on this rank as a sink chunk on the `floor` rung's decoder (every step: `tiny`
        where the floor's decoder is the tiny one, `full` on the session's own) and at the floor, for the quality
        ladder's admission before any session ran (deployments/group/ladder.py). A throwaway session: its sink on
        the floor's decoder (the last chunk timed), then two chunks at the floor (the last timed). Every rank of
        the group runs it together."""
        from .runtime.journal import ChunkControls, apply, open_world
        from .runtime.rungs import rung_name
        preset = self.pipeline.preset
        world = open_world(self.pipeline, np.zeros((preset.height, preset.width, 3), dtype=np.uint8), "warm-up", 0)
        sink = ChunkControls(decoder=floor.decoder, profile=True)      # (profile: synchronised, its real time)
        plan = [(rung_name(None, floor.decoder), sink)] * preset.transformer.sink_chunks + \
            [(floor.name, ChunkControls(steps=floor.steps, decoder=floor.decoder, profile=True))] * 2
        times = {}
        for index, (name, controls) in enumerate(plan):
            t = time.perf_counter()
            chunk, _ = apply(world, controls, index)
            if chunk.frames is not None:
                chunk.frames.cpu()
            times[name] = time.perf_counter() - t
        del world, chunk
        log.info("rank %d measured its rungs: %s", self.rank, ", ".join(f"{k} {v:.3f} s" for k, v in times.items()))
        return times

    # ---- 4. measure ---------------------------------------------------------------------------
    def measure(self) -> Optional[MemoryReport]:
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        # hand the allocator's unused cache (the freed warm-up session) back, so the device's free memory is
        # what sessions can have; CUDA graphs keep their private pools, which are in use
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        self.memory = MemoryReport(total, free, torch.cuda.memory_allocated(self.device),
                                   torch.cuda.max_memory_allocated(self.device), self.loaded_bytes)
        return self.memory

    # ---- 5. capacity --------------------------------------------------------------------------
    def capacity(self, max_sessions: int, budget_bytes: Optional[int] = None) -> int:
        """Sessions this rank holds: from `budget_bytes` when given (and on CPU), else from the memory
        measured after warm-up."""
        preset = self.pipeline.preset
        if budget_bytes is None and self.memory is None:
            budget_bytes = CPU_BUDGET_BYTES
        decoders = tuple(self.pipeline.decoders)
        if budget_bytes is not None:
            return sessions_that_fit(preset, self.world_size, budget_bytes, max_sessions, self.cuda_graphs,
                                     decoders, self.device)
        return measured_capacity(self.memory, session_footprint(preset, self.world_size, decoders, self.device).total,
                                 shared_cache_bytes(preset), max_sessions)


def warm_up_chunks(window_chunks: int, device: torch.device, compiled: bool) -> int:
    """Chunks of the warm-up session: every window length (window_chunks + 1) where the shapes matter,
    on an accelerator (kernel choices, allocator growth) or compiled (a graph per shape); one chunk eager on
    CPU, where nothing is chosen or grown per shape (6 chunks more cost a tiny group start ~3 s a rank)."""
    return window_chunks + 1 if compiled or device.type != "cpu" else 1


def measured_capacity(memory: MemoryReport, session_bytes: int, shared_caches: int, max_sessions: int) -> int:
    """Sessions that fit the memory measured after warm-up. The warm-up's peak is what the rank held after
    warm-up (weights, CUDA graphs and their static buffers, what the caches kept) plus one session plus
    the transient memory of its chunk (activations, the chunk's camera modulation); chunks of a group run
    one at a time, so the transient part is needed once, not per session. What the rank still holds is
    already out of the free memory: subtracting it again (from the peak less what was loaded) would count
    the graphs twice."""
    transient = max(0, memory.peak - max(memory.allocated, memory.loaded) - session_bytes)
    usable = memory.free - transient - shared_caches - int(MEMORY_MARGIN * memory.total)
    return max(0, min(max_sessions, usable // session_bytes))
