"""The DiT runner: the causal DiT on one device, and DiT sessions that run it chunk by chunk.

A chunk is: condition -> prepare (camera tokens, RoPE, camera modulation) -> `num_steps` probes -> one
commit forward on the clean x0 at t = 0 (docs/architecture.md, "A chunk"). The `DiTRunner` owns what
sessions share (weights, text encoder, the prompt -> text K/V LRU, the time embeddings of the fixed
timesteps); a `DiTSession` owns its K/V window, camera rig, condition source, RNG and chunk counter, and
gives its state between chunks (besides the window's slots and the condition's) to a snapshot (`state_dict`).
The whole video pipeline (condition encoder, decode to frames) is one floor up, in pipeline.py.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..camera import CameraRig, Controls, camera_patches
from ..config import Preset
from ..models.dit import CausalWanModel, TextKV, TimeConditioning
from ..models.text_encoder import TextEncoder
from ..transfer import to_device
from .condition import ConditionSource
from .kv_cache import KVWindow, LRUCache
from .rungs import kept_steps
from .sampler import DMDSampler

log = logging.getLogger(__name__)

PROMPT_CACHE_SIZE = 8        # prompts whose text K/V a runner keeps (shared by its sessions)


@dataclass
class ChunkResult:
    index: int
    latents: Tensor                                # [16, F, h, w] float32, the chunk's clean x0
    timings: dict[str, float] = field(default_factory=dict)   # stage -> s: condition, prepare, probe_i, commit
    steps: tuple[int, ...] = ()                    # the sampler's probes it ran (a rung may skip some)


def normalize_prompt(prompt: str) -> str:
    """Runs of whitespace become one space, none at the ends."""
    return " ".join(prompt.strip().split())


class StageTimer:
    """Wall time per stage of one chunk. With `sync` (profiling) every stage boundary waits for the device,
    so the times are exact; without it nothing synchronises (a device queue may shift time between stages)."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.sync = sync and device.type != "cpu"
        self.device = device
        self.timings: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, stage: str) -> None:
        """Record `stage` as ending now."""
        if self.sync:
            torch.accelerator.synchronize(self.device)
        now = time.perf_counter()
        self.timings[stage] = now - self.last
        self.last = now


class DiTRunner:
    """Weights, text encoder and shared caches on one device."""

    def __init__(self, preset: Preset, model: CausalWanModel, text_encoder: Optional[TextEncoder],
                 device: torch.device | str = "cpu", prompt_cache_size: int = PROMPT_CACHE_SIZE,
                 cache_camera_modulation: bool = True):
        self.preset = preset
        self.config = model.config
        self.model = model
        self.text_encoder = text_encoder
        self.device = torch.device(device)
        self.cache_camera_modulation = cache_camera_modulation
        self.prompt_cache = LRUCache(prompt_cache_size)
        lh, lw = preset.latent_hw
        _, ph, pw = self.config.patch_size
        self.latent_hw = (lh, lw)
        self.token_grid_hw = (lh // ph, lw // pw)
        self._schedules = LRUCache(8)                 # flow shift -> (sampler, time embeddings)

    def schedule(self, shift: Optional[float]) -> tuple[DMDSampler, list[TimeConditioning]]:
        """Sampler and the time embeddings of its timesteps (+ the commit's t = 0) for a flow shift
        (None: the preset's). The timesteps are fixed, so they are embedded once per shift and kept
        (static buffers: graph capture needs stable addresses)."""
        shift = self.preset.sampler.shift if shift is None else float(shift)
        if not (math.isfinite(shift) and shift > 0):
            raise ValueError(f"flow_shift must be a finite number > 0, got {shift}")

        def build():
            sampler = DMDSampler(dataclasses.replace(self.preset.sampler, shift=shift))
            with torch.no_grad():
                steps = sampler.timesteps + [sampler.commit_timestep]
                # [1] float32 each, as torch.tensor([t]) makes it (the embedding is computed in float64 from it)
                return sampler, [self.model.time_conditioning(to_device([t], self.device, torch.float32))
                                 for t in steps]
        return self._schedules.get_or_compute(shift, build)

    @property
    def tokens_per_frame(self) -> int:
        return self.token_grid_hw[0] * self.token_grid_hw[1]

    @torch.no_grad()
    def text_kv(self, prompt: str) -> TextKV:
        """Cross-attention K/V of a prompt, computed once and kept in an LRU across sessions. Whitespace is
        collapsed first, as the reference runtime does before tokenising."""
        self._require_text_encoder()
        prompt = normalize_prompt(prompt)

        def compute() -> TextKV:
            return self.model.text_kv(self.text_encoder.encode([prompt]).to(self.device))
        return self.prompt_cache.get_or_compute(prompt, compute)

    def _require_text_encoder(self) -> None:
        if self.text_encoder is None:
            raise RuntimeError("this runner has no text encoder; pass text embeddings to new_session")

    def new_session(self, condition: ConditionSource, prompt: Optional[str] = None, seed: int = 0,
                    text_embedding: Optional[Tensor] = None, rig: Optional[CameraRig] = None,
                    shift: Optional[float] = None, window: Optional[tuple[int, int]] = None) -> DiTSession:
        """A session; `shift` is its flow shift (None: the preset's); `window` its own K/V window (sink_chunks,
        window_chunks; None: the model's: KVWindow). A prompt is encoded at the session's first chunk, not
        here: under sequence parallelism encoding is a collective, and chunk calls are what every rank of a
        group runs in the same order."""
        if (prompt is None) == (text_embedding is None):
            raise ValueError("give exactly one of prompt or text_embedding")
        if prompt is not None:
            self._require_text_encoder()
        text = None
        if text_embedding is not None:
            with torch.no_grad():
                text = self.model.text_kv(to_device(text_embedding, self.device))
        return DiTSession(self, text, prompt, condition, seed,
                          rig or CameraRig.default(self.preset.width, self.preset.height), shift, window)


class DiTSession:
    """One user's world in the DiT: K/V window, camera rig, condition, text, RNG and chunk counter."""

    def __init__(self, runner: DiTRunner, text: Optional[TextKV], prompt: Optional[str], condition: ConditionSource,
                 seed: int, rig: CameraRig, shift: Optional[float] = None,
                 window: Optional[tuple[int, int]] = None):
        self.runner = runner
        self.sampler, self.time = runner.schedule(shift)
        self.initial_text = text              # from a text embedding; None: from `prompt`, at the first chunk
        self.prompt = prompt
        self.text = text
        self.condition = condition
        self.seed = seed
        self.rig = rig
        cfg = runner.config
        self.frames_per_chunk = cfg.num_frames_per_block
        self.kv = KVWindow(cfg, runner.tokens_per_frame, heads=runner.model.local_heads, dtype=runner.model.dtype,
                           device=runner.device, window=window)
        self.generator = torch.Generator(device=runner.device)
        self.reset()

    def reset(self) -> None:
        self.text = self.initial_text
        self._transition = None
        self.kv.reset()
        self.generator.manual_seed(self.seed)
        self.rig.reset()
        self.condition.reset()
        self.chunk_index = 0

    def state_dict(self, copy: Callable[[Tensor], Tensor] = torch.clone) -> dict:
        """What the session carries from its last chunk to the next, besides its K/V window
        (`KVWindow.slot_state`) and its condition source: the chunk counter, the RNG state, the text encoder
        output [1, T, text_dim] of the current prompt (None before the first chunk of a session from a
        prompt), a running prompt transition (from, to, chunks, done; the outputs the K/V are projected
        from) and the camera rig's state (immutable, kept as is). Tensors go through `copy`. The text K/V
        are not kept: `load_state` projects them again from the outputs, bitwise as they were made."""
        if self.kv.next_chunk != self.chunk_index:
            raise ValueError(f"the K/V window is at chunk {self.kv.next_chunk}, the session at {self.chunk_index}")
        transition = None
        if self._transition is not None:
            start, target, total, done = self._transition
            transition = (copy(start.embedding), copy(target.embedding), total, done)
        return {"chunk_index": self.chunk_index,
                "rng": self.generator.get_state().clone(),          # always a CPU byte tensor
                "text": None if self.text is None else copy(self.text.embedding),
                "transition": transition,
                "rig": self.rig.state}

    @torch.no_grad()
    def load_state(self, state: dict) -> None:
        """Continue from `state` (as `state_dict` gave it, from a session of the same runner, prompt, seed and
        flow shift), its tensors on any device. The K/V window is put back on its own (`KVWindow.load_slots`,
        up to the same chunk), and the condition source by its owner."""
        device, model = self.runner.device, self.runner.model
        self.chunk_index = state["chunk_index"]
        self.generator.set_state(state["rng"])
        self.text = None if state["text"] is None else model.text_kv(state["text"].to(device))
        self._transition = None
        if state["transition"] is not None:
            start, target, total, done = state["transition"]
            self._transition = (model.text_kv(start.to(device)), model.text_kv(target.to(device)), total, done)
        self.rig.state = state["rig"]

    def set_prompt(self, prompt: str, transition_chunks: int = 0) -> None:
        """Switch the prompt from the next chunk on: at once (0), or over `transition_chunks` chunks, where
        chunk i of N runs on the text encoder outputs blended linearly (i/N), projected to K/V (the
        reference blends the embeddings, not the K/V: k goes through an RMSNorm)."""
        if transition_chunks < 0:
            raise ValueError(f"transition_chunks must be >= 0, got {transition_chunks}")
        target = self.runner.text_kv(prompt)
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
        alpha = done / total
        self.text = target if done >= total else \
            self.runner.model.text_kv((1 - alpha) * start.embedding + alpha * target.embedding)
        return None if done >= total else (start, target, total, done)

    @torch.no_grad()
    def run_chunk(self, controls: Optional[Controls] = None, should_stop: Callable[[], bool] = lambda: False,
                  prompt: Optional[tuple[str, int]] = None, profile: bool = False,
                  steps: Optional[int] = None) -> Optional[ChunkResult]:
        """Run the next chunk. Returns None if should_stop() turns true between steps; a stopped or failed
        chunk changes nothing lasting (the RNG and the prompt are rewound; camera and condition are committed
        only at the end), so the same chunk can be run again. `prompt` = (text, transition_chunks) switches
        the prompt from this chunk on. `profile` synchronises the device at stage boundaries. `steps`: the
        denoising forwards of a cheaper rung (lingbot/runtime/rungs.py; None: all; the sink runs all)."""
        rng_state, text, transition = self.generator.get_state(), self.text, self._transition
        result = None
        try:
            if self.text is None:                    # the session's prompt, encoded at its first chunk
                self.text = self.runner.text_kv(self.prompt)
            if prompt is not None:
                self.set_prompt(*prompt)
            self._transition = self._advance_text()
            result = self._run_chunk(controls, should_stop, StageTimer(self.runner.device, profile), steps)
        finally:
            if result is None:                       # stopped or raised: rewind
                self.generator.set_state(rng_state)
                self.text, self._transition = text, transition
        return result

    def _run_chunk(self, controls: Optional[Controls], should_stop: Callable[[], bool],
                   timer: StageTimer, steps: Optional[int] = None) -> Optional[ChunkResult]:
        runner, model, sampler = self.runner, self.runner.model, self.sampler
        k, f = self.chunk_index, self.frames_per_chunk
        kept = kept_steps(sampler.num_steps, None if steps is None or k < self.kv.sink_chunks else steps)  # sink: all
        # condition (the causal image encoder, or its stored fixed point)
        condition = self.condition.chunk_condition(k).to(runner.device)[None]          # [1, 20, F, h, w]
        timer.mark("condition")
        # prepare: camera poses -> ray patches -> camera tokens / modulation, RoPE, first noise
        planned = self.rig.plan(controls, f)
        rays = self.rig.rays(planned, runner.preset.height, runner.preset.width, runner.device)  # [6, F, H, W]
        patches = camera_patches(rays)[None]                                            # [1, L, 1536]
        grid = (f, *runner.token_grid_hw)
        chunk = model.prepare_chunk(patches, k * f, grid, runner.cache_camera_modulation)
        self.kv.begin_chunk(k)
        shape = (1, runner.config.out_channels, f, *runner.latent_hw)
        x_t = sampler.initial_noise(shape, self.generator, runner.device)
        timer.mark("prepare")
        # probes: denoise, re-noise with fresh noise from the session's generator (drawn for a skipped probe
        # too: the session's noise stream is the same on every rung)
        x0 = x_t
        for step in range(sampler.num_steps):
            if should_stop():
                return None
            if step > 0:
                renoised = sampler.renoise(x0, step, self.generator)
                if step not in kept:
                    continue
                x_t = renoised
            flow = model(x_t, condition, self.time[step], self.text, chunk, self.kv, commit=False)
            x0 = sampler.denoise(x_t, flow, step)
            timer.mark(f"probe_{step}")
        if should_stop():
            return None
        # commit: the clean x0 at t = 0 writes the chunk's lasting K/V
        model(x0, condition, self.time[-1], self.text, chunk, self.kv, commit=True)
        timer.mark("commit")
        self.rig.commit(planned)
        self.condition.commit()
        self.chunk_index += 1
        return ChunkResult(k, x0[0], timer.timings, kept)

    def generate(self, num_chunks: int, controls: Optional[list[Optional[Controls]]] = None) -> Tensor:
        """Run `num_chunks` chunks; returns latents [16, F * num_chunks, h, w]."""
        out = []
        for i in range(num_chunks):
            result = self.run_chunk(controls[i] if controls is not None else None)
            out.append(result.latents)
        return torch.cat(out, dim=1)
