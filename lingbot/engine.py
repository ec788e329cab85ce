"""The in-process engine: a model on one device, and sessions that run chunk by chunk.

A chunk is: prepare (camera tokens, RoPE, camera modulation, condition) -> `num_steps` probes -> one
commit forward on the clean x0 at t = 0 (shared/DESIGN.md §2). The engine owns what sessions share
(weights, text encoder, the prompt -> text K/V LRU, the time embeddings of the fixed timesteps); a
session owns its K/V window, camera rig, condition source, RNG and chunk counter (§3).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch
from torch import Tensor

from .budget import PROMPT_CACHE_SIZE
from .camera import CameraRig, Controls, camera_patches
from .config import Preset
from .kv_cache import KVWindow, LRUCache
from .model import CausalWanModel, TextKV, TimeConditioning
from .sampler import DMDSampler
from .text import TextEncoder

log = logging.getLogger(__name__)


class ConditionSource(Protocol):
    """Gives the 20-channel condition (mask 4 + image latent 16) of each chunk: [20, F, h, w]."""

    def chunk_condition(self, chunk: int) -> Tensor: ...

    def commit(self) -> None:
        """The chunk that asked for the last condition succeeded."""

    def reset(self) -> None: ...


class LatentCondition:
    """Condition from image latents that are already encoded: `latents` [16, F_total, h, w] (normalised),
    covering at least the frames of every chunk asked for. The mask is 1 on latent frame 0 only."""

    def __init__(self, latents: Tensor, frames_per_chunk: int = 3):
        self.latents = latents
        self.frames_per_chunk = frames_per_chunk

    def chunk_condition(self, chunk: int) -> Tensor:
        f0, n = chunk * self.frames_per_chunk, self.frames_per_chunk
        if f0 + n > self.latents.shape[1]:
            raise ValueError(f"condition latents hold {self.latents.shape[1]} frames; chunk {chunk} needs {f0 + n}")
        return make_condition(self.latents[:, f0:f0 + n], first_frame=f0)

    def commit(self) -> None:
        pass

    def reset(self) -> None:
        pass


def make_condition(image_latents: Tensor, first_frame: int) -> Tensor:
    """cat(mask [4], image latents [16]) for latent frames first_frame.. ; mask = 1 on frame 0 only."""
    c, f, h, w = image_latents.shape
    mask = torch.zeros(4, f, h, w, dtype=image_latents.dtype, device=image_latents.device)
    if first_frame == 0:
        mask[:, 0] = 1
    return torch.cat([mask, image_latents], dim=0)


@dataclass
class ChunkResult:
    index: int
    latents: Tensor                                # [16, F, h, w] float32, the chunk's clean x0
    timings: dict[str, float] = field(default_factory=dict)   # stage -> s: condition, prepare, probe_i, commit


class WorldEngine:
    """Weights, text encoder and shared caches on one device."""

    def __init__(self, preset: Preset, model: CausalWanModel, text_encoder: Optional[TextEncoder],
                 device: torch.device | str = "cpu", prompt_cache_size: int = PROMPT_CACHE_SIZE,
                 cache_camera_modulation: bool = True, profile: bool = False):
        self.preset = preset
        self.config = model.config
        self.model = model
        self.text_encoder = text_encoder
        self.device = torch.device(device)
        self.sampler = DMDSampler(preset.sampler)
        self.cache_camera_modulation = cache_camera_modulation
        self.profile = profile
        self.prompt_cache = LRUCache(prompt_cache_size)
        lh, lw = preset.latent_hw
        _, ph, pw = self.config.patch_size
        self.latent_hw = (lh, lw)
        self.token_grid_hw = (lh // ph, lw // pw)
        self._schedules = LRUCache(8)                 # flow shift -> (sampler, time embeddings)
        self.sampler, self.time = self.schedule(None)

    def schedule(self, shift: Optional[float]) -> tuple[DMDSampler, list[TimeConditioning]]:
        """Sampler and the time embeddings of its timesteps (+ the commit's t = 0) for a flow shift
        (None: the preset's). The timesteps are fixed, so they are embedded once per shift and kept
        (static buffers, shared/DESIGN.md §5 item 7)."""
        shift = self.preset.sampler.shift if shift is None else float(shift)
        if not (math.isfinite(shift) and shift > 0):
            raise ValueError(f"flow_shift must be a finite number > 0, got {shift}")

        def build():
            sampler = DMDSampler(dataclasses.replace(self.preset.sampler, shift=shift))
            with torch.no_grad():
                steps = sampler.timesteps + [sampler.commit_timestep]
                return sampler, [self.model.time_conditioning(torch.tensor([t], device=self.device)) for t in steps]
        return self._schedules.get_or_compute(shift, build)

    @property
    def tokens_per_frame(self) -> int:
        return self.token_grid_hw[0] * self.token_grid_hw[1]

    @torch.no_grad()
    def text_kv(self, prompt: str) -> TextKV:
        """Cross-attention K/V of a prompt, computed once and kept in an LRU across sessions."""
        if self.text_encoder is None:
            raise RuntimeError("this engine has no text encoder; pass text embeddings to new_session")

        def compute() -> TextKV:
            return self.model.text_kv(self.text_encoder.encode([prompt]).to(self.device))
        return self.prompt_cache.get_or_compute(prompt, compute)

    def new_session(self, condition: ConditionSource, prompt: Optional[str] = None, seed: int = 0,
                    text_embedding: Optional[Tensor] = None, rig: Optional[CameraRig] = None,
                    shift: Optional[float] = None) -> "Session":
        if (prompt is None) == (text_embedding is None):
            raise ValueError("give exactly one of prompt or text_embedding")
        with torch.no_grad():
            text = self.text_kv(prompt) if prompt is not None else self.model.text_kv(text_embedding.to(self.device))
        return Session(self, text, condition, seed, rig or CameraRig.default(self.preset.width, self.preset.height),
                       shift)


class Session:
    """One user's world: K/V window, camera rig, condition, RNG and chunk counter."""

    def __init__(self, engine: WorldEngine, text: TextKV, condition: ConditionSource, seed: int, rig: CameraRig,
                 shift: Optional[float] = None):
        self.engine = engine
        self.sampler, self.time = engine.schedule(shift)
        self.initial_text = text
        self.text = text
        self.condition = condition
        self.seed = seed
        self.rig = rig
        cfg = engine.config
        self.frames_per_chunk = cfg.num_frames_per_block
        self.kv = KVWindow(cfg, engine.tokens_per_frame, heads=engine.model.local_heads, dtype=engine.model.dtype,
                           device=engine.device)
        self.generator = torch.Generator(device=engine.device)
        self.reset()

    def reset(self) -> None:
        self.text = self.initial_text
        self._transition = None
        self.kv.reset()
        self.generator.manual_seed(self.seed)
        self.rig.reset()
        self.condition.reset()
        self.chunk_index = 0

    def set_prompt(self, prompt: str, transition_chunks: int = 0) -> None:
        """Switch the prompt from the next chunk on: at once (0), or blending the text K/V linearly over
        `transition_chunks` chunks (1/N, 2/N, ..., 1)."""
        if transition_chunks < 0:
            raise ValueError(f"transition_chunks must be >= 0, got {transition_chunks}")
        target = self.engine.text_kv(prompt)
        if transition_chunks == 0:
            self.text, self._transition = target, None
        else:
            self._transition = (self.text, target, transition_chunks, 0)

    def _advance_text(self) -> Optional[tuple]:
        """The text K/V of the chunk about to run; returns the transition state to commit."""
        if self._transition is None:
            return None
        start, target, total, done = self._transition
        done += 1
        self.text = target if done >= total else start.lerp(target, done / total)
        return None if done >= total else (start, target, total, done)

    def mark_stage(self, timings: dict[str, float], name: str, start: float) -> float:
        """Record stage `name` as ending now; device-synchronised only when profiling."""
        if self.engine.profile and self.engine.device.type != "cpu":
            torch.accelerator.synchronize(self.engine.device)
        now = time.perf_counter()
        timings[name] = now - start
        return now

    @torch.no_grad()
    def run_chunk(self, controls: Optional[Controls] = None, should_stop: Callable[[], bool] = lambda: False,
                  prompt: Optional[tuple[str, int]] = None) -> Optional[ChunkResult]:
        """Run the next chunk. Returns None if should_stop() turns true between steps; a stopped or failed
        chunk changes nothing lasting (the RNG and the prompt are rewound; camera and condition are committed
        only at the end), so the same chunk can be run again. `prompt` = (text, transition_chunks) switches
        the prompt from this chunk on."""
        rng_state, text, transition = self.generator.get_state(), self.text, self._transition
        try:
            if prompt is not None:
                self.set_prompt(*prompt)
            self._transition = self._advance_text()
            result = self._run_chunk(controls, should_stop)
        except BaseException:
            self.generator.set_state(rng_state)
            self.text, self._transition = text, transition
            raise
        if result is None:
            self.generator.set_state(rng_state)
            self.text, self._transition = text, transition
        return result

    def _run_chunk(self, controls: Optional[Controls], should_stop: Callable[[], bool]) -> Optional[ChunkResult]:
        engine, model, sampler = self.engine, self.engine.model, self.sampler
        k, f = self.chunk_index, self.frames_per_chunk
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        # condition (the causal image encoder, or its stored fixed point)
        condition = self.condition.chunk_condition(k).to(engine.device)[None]          # [1, 20, F, h, w]
        t = self.mark_stage(timings, "condition", t0)
        # prepare: camera poses -> ray patches -> camera tokens / modulation, RoPE, first noise
        planned = self.rig.plan(controls, f)
        rays = self.rig.rays(planned, engine.preset.height, engine.preset.width, engine.device)  # [6, F, H, W]
        patches = camera_patches(rays)[None]                                            # [1, L, 1536]
        grid = (f, *engine.token_grid_hw)
        chunk = model.prepare_chunk(patches, k * f, grid, engine.cache_camera_modulation)
        self.kv.begin_chunk(k)
        shape = (1, engine.config.out_channels, f, *engine.latent_hw)
        x_t = sampler.initial_noise(shape, self.generator, engine.device)
        t = self.mark_stage(timings, "prepare", t)
        # probes: denoise, re-noise with fresh noise from the session's generator
        for step in range(sampler.num_steps):
            if should_stop():
                return None
            if step > 0:
                x_t = sampler.renoise(x0, step, self.generator)
            flow = model(x_t, condition, self.time[step], self.text, chunk, self.kv, commit=False)
            x0 = sampler.denoise(x_t, flow, step)
            t = self.mark_stage(timings, f"probe_{step}", t)
        if should_stop():
            return None
        # commit: the clean x0 at t = 0 writes the chunk's lasting K/V
        model(x0, condition, self.time[-1], self.text, chunk, self.kv, commit=True)
        self.mark_stage(timings, "commit", t)
        self.rig.commit(planned)
        self.condition.commit()
        self.chunk_index += 1
        return ChunkResult(k, x0[0], timings)

    def generate(self, num_chunks: int, controls: Optional[list[Optional[Controls]]] = None) -> Tensor:
        """Run `num_chunks` chunks; returns latents [16, F * num_chunks, h, w]."""
        out = []
        for i in range(num_chunks):
            result = self.run_chunk(controls[i] if controls is not None else None)
            out.append(result.latents)
        return torch.cat(out, dim=1)
