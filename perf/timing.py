"""Timing chunks in process: the one loop every benchmark that times chunks runs (perf.ab, perf.sp_time,
perf.cost, perf.rungs, perf.decode_time, perf.serve_overhead's in-process side and the device check).

A benchmark builds its pipeline (lingbot.builder), opens a session on stand-in inputs (`whole_session`: a seeded
random first frame; `dit_session`: random condition latents for the DiT alone), and hands one chunk's call to
`time_chunks`, which runs it N times with the device synchronised around each and returns a `ChunkTimes`: each
chunk's wall time and stage times (its `timings`: condition, prepare, probe_0..3, commit, decode, pixels), and
their medians over the steady chunks. Steady = chunk index >= STEADY_FROM, as the vLLM-Omni benchmark counts
(perf/realtime_metrics.py): the chunks before it fill the K/V window, so each costs less than the one after.

    pipe = build_pipeline("tiny")
    session = whole_session(pipe, seed=0)
    times = time_chunks(lambda: whole_chunk(session), 12, pipe.runner.device)
    times.median()                 # seconds, chunks 6..11
    times.stage_median("decode")   # the decode's share of them

The first frame's conditions: a session encodes them until the encoder's fixed point (about chunk 10 at the
tiny preset), unless the pipeline's condition cache holds them (`prime_conditions`: what a served session of a
first frame seen before does; lingbot/runtime/condition.py).

Imports torch and lingbot only: the device check runs it on a GPU machine without ray or av.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch

from lingbot.camera import Controls
from lingbot.io.images import model_image
from lingbot.runtime.condition import CONDITION_CACHE_CHUNKS, CausalConditionEncoder, LatentCondition

STEADY_FROM = 6
KEYS = Controls(keys=("w", "", "l"))            # forward, no strafe, yaw right: every chunk moves the camera
PROMPT = "a lighthouse on a cliff at dusk"


# ---------------------------------------------------------------------------------------------------
# sessions on stand-in inputs
# ---------------------------------------------------------------------------------------------------
def first_frame(preset, seed: int = 0) -> torch.Tensor:
    """A seeded random first frame [3, H, W] in [-1, 1] at the preset's size."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, preset.height, preset.width, generator=g) * 2 - 1


def whole_session(pipe, seed: int = 0, image: Optional[torch.Tensor] = None, prompt: Optional[str] = PROMPT,
                  **session_kwargs):
    """A WorldSession of `pipe` from `image` (default: `first_frame(seed 0)`, the same for every session, so the
    condition cache can serve it); `session_kwargs` go to `pipe.new_session` (decoder, switch_to, ...)."""
    image = first_frame(pipe.preset) if image is None else image
    return pipe.new_session(image, prompt, seed=seed, **session_kwargs)


def dit_session(runner, chunks: int, seed: int = 0, prompt: Optional[str] = PROMPT, **session_kwargs):
    """A DiT session of `runner` alone (no VAE) on seeded random condition latents [16, F * chunks, h, w]:
    enough for `chunks` chunks."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(16, runner.config.num_frames_per_block * chunks, *runner.latent_hw, generator=g)
    return runner.new_session(LatentCondition(latents.to(runner.device)), prompt=prompt, seed=seed, **session_kwargs)


def whole_chunk(session, controls: Controls = KEYS, **step_kwargs):
    """One whole chunk of a WorldSession (conditions, DiT, decode, uint8 frames), its frames copied to the host:
    what leaves the device, as a rank runs a chunk (under SP only the root holds frames in the root pixel modes)."""
    chunk = session.step(controls, **step_kwargs)
    if chunk.frames is not None:
        chunk.frames.cpu()
    return chunk


def prime_conditions(pipe, image) -> tuple[Optional[int], list[float]]:
    """Runs the condition encoder of `image` (the first frame, uint8 [H, W, 3] or float [3, H, W]) alone to its
    fixed point, into the pipeline's condition cache: every session of `image` after it replays the conditions
    and never encodes. Returns the fixed-point chunk (None: not reached within CONDITION_CACHE_CHUNKS) and the
    encoder's seconds per chunk until then. Under SP every rank calls it (the group's encoder broadcasts)."""
    device = pipe.runner.device
    encoder = CausalConditionEncoder(pipe.vae, model_image(image).to(device), pipe.runner.config.num_frames_per_block,
                                     True, pipe.condition_cache, pipe.condition_encoder)
    times = []
    for chunk in range(CONDITION_CACHE_CHUNKS):
        if encoder.fixed_point_chunk is not None:
            break
        seconds, _ = timed(device, partial(encoder.chunk_condition, chunk))
        encoder.commit()
        times.append(seconds)
    return encoder.fixed_point_chunk, times


# ---------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device is not None and torch.device(device).type != "cpu":
        torch.accelerator.synchronize(torch.device(device))


def timed(device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, fn()): wall time from a synchronised device to a synchronised device."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


@dataclass
class ChunkTimes:
    """Wall seconds and stage seconds of each chunk timed, in chunk order."""
    seconds: list[float] = field(default_factory=list)
    stages: list[dict[str, float]] = field(default_factory=list)     # each chunk's `timings` ({} if it had none)

    def add(self, seconds: float, result: Any) -> None:
        self.seconds.append(seconds)
        self.stages.append(dict(getattr(result, "timings", None) or {}))

    @property
    def first(self) -> float:
        """The first chunk's seconds: where a compile, a text encoding or an allocator's growth lands."""
        return self.seconds[0]

    @property
    def total(self) -> float:
        return sum(self.seconds)

    def steady(self, start: int = STEADY_FROM) -> list[float]:
        if start >= len(self.seconds):
            raise ValueError(f"{len(self.seconds)} chunks timed: none steady from chunk {start}; time more chunks")
        return self.seconds[start:]

    def median(self, start: int = STEADY_FROM) -> float:
        """The median wall seconds of the chunks from index `start`."""
        return statistics.median(self.steady(start))

    def stage_median(self, *stages: str, start: int = STEADY_FROM) -> float:
        """The median, over the chunks from index `start`, of the sum of `stages` (a stage a chunk did not run,
        as a probe a step rung skips, counts 0)."""
        self.steady(start)
        return statistics.median(sum(t.get(s, 0.0) for s in stages) for t in self.stages[start:])

    def dit_median(self, start: int = STEADY_FROM) -> float:
        """The median DiT time of the chunks from `start`: prepare, every probe, commit."""
        return self.stage_median(*self.stage_names(dit_only=True), start=start)

    def stage_names(self, dit_only: bool = False) -> list[str]:
        """The stages the chunks reported, in the order they ran."""
        names = list(dict.fromkeys(name for t in self.stages for name in t))
        return [n for n in names if is_dit_stage(n)] if dit_only else names


def is_dit_stage(name: str) -> bool:
    return name in ("prepare", "commit") or name.startswith("probe_")


def time_chunks(run: Callable[[], Any], chunks: int, device=None, each: Optional[Callable] = None,
                sync_each: bool = True) -> ChunkTimes:
    """Calls `run()` `chunks` times (one chunk each: `whole_chunk(session)`, a DiT session's `run_chunk`, or any
    step), each timed from a synchronised `device` to a synchronised device. `each(index, seconds, result)` is
    called after each chunk, outside its time (progress, figures kept as they come). `sync_each=False`
    synchronises only before the first chunk and after the last: work a chunk queued (an asynchronous copy) may
    then overlap the next, and each chunk's time is its host time."""
    times = ChunkTimes()
    sync(device)
    for index in range(chunks):
        t0 = time.perf_counter()
        result = run()
        if sync_each:
            sync(device)
        seconds = time.perf_counter() - t0
        times.add(seconds, result)
        if each is not None:
            each(index, seconds, result)
    sync(device)
    return times


def time_in_turn(runs: dict[str, Callable[[], Any]], chunks: int, device=None) -> dict[str, ChunkTimes]:
    """One chunk of each run in turn, `chunks` times over, so the machine's load (other work on shared cores, the
    clock) falls on all of them alike; each run's ChunkTimes by its name."""
    out = {name: ChunkTimes() for name in runs}
    for _ in range(chunks):
        for name, run in runs.items():
            out[name].add(*timed(device, run))
    return out
