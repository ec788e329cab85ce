"""The whole in-process pipeline: image + prompt + controls -> uint8 video frames, chunk by chunk.

A `WorldSession` owns a DiT session (its K/V window, camera, RNG), the causal condition encoder and the
VAE decoder cache. One `step()` = condition encode + 4 probes + commit (the DiT session) + streaming
decode to uint8 frames on the device (chunk 0 gives 9 frames, every later chunk 12). The pipeline runs
the same code on one device and on every rank of a sequence-parallel group: parallelism lives in the
modules it is given (the DiT, the frame decoder), never here. A session's state between chunks, all but
its K/V window's slots, is one `state_dict` (what snapshot.py copies to the host) and `load_state`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor

from ..camera import CameraRig, Controls
from ..io.images import model_image
from ..io.transfer import to_device
from ..models.vae import CausalCache, FrameDecoder, WanVAE
from .condition import CausalConditionEncoder, ChunkEncoder, ConditionCache
from .dit_runner import ChunkResult, DiTRunner, StageTimer


@dataclass
class VideoChunk:
    index: int
    frames: Optional[Tensor]                         # [F, H, W, 3] uint8 on the device; None off-root under SP
    timings: dict[str, float] = field(default_factory=dict)


class WorldPipeline:
    """DiT runner + VAE (the condition encoder) + frame decoder. Under sequence parallelism every rank runs
    this with the DiT, the decoder and the condition encoder already wrapped (lingbot/builder.py); other
    ranks than the root get chunks with frames=None in the root pixel modes."""

    def __init__(self, runner: DiTRunner, vae: WanVAE, skip_fixed_point: bool = True,
                 decoder: Optional[FrameDecoder] = None, condition_cache: bool = True,
                 condition_encoder: Optional[ChunkEncoder] = None):
        self.runner = runner
        self.vae = vae
        self.decoder = decoder if decoder is not None else FrameDecoder(vae)
        # one chunk of the condition encoder: on this device, or once per group (lingbot/parallel/condition.py)
        self.condition_encoder = condition_encoder if condition_encoder is not None else ChunkEncoder(vae)
        self.skip_fixed_point = skip_fixed_point
        # first frame -> its conditions up to the fixed point, shared by the sessions (needs the fixed point)
        self.condition_cache = ConditionCache() if condition_cache else None

    @property
    def preset(self):
        return self.runner.preset

    def new_session(self, image: Union[np.ndarray, Tensor], prompt: Optional[str], seed: int = 0,
                    rig: Optional[CameraRig] = None, flow_shift: Optional[float] = None,
                    text_embedding: Optional[Tensor] = None) -> WorldSession:
        """`image`: the first frame at the preset's size, uint8 [H, W, 3] or float [3, H, W] in [-1, 1];
        `flow_shift`: the sampler's shift for this session (None: the preset's); `text_embedding`: a ready
        encoder output [1, T, text_dim] instead of a prompt (a runner built without a text encoder)."""
        image = model_image(image)
        h, w = self.preset.height, self.preset.width
        if tuple(image.shape) != (3, h, w):
            raise ValueError(f"image must be [3, {h}, {w}] for this preset, got {list(image.shape)}")
        return WorldSession(self, to_device(image, self.runner.device), prompt, seed, rig, flow_shift, text_embedding)


class WorldSession:
    """One user's world: the DiT session, the condition encoder and the decoder cache."""

    def __init__(self, pipeline: WorldPipeline, image: Tensor, prompt: Optional[str], seed: int,
                 rig: Optional[CameraRig], flow_shift: Optional[float] = None,
                 text_embedding: Optional[Tensor] = None):
        self.pipeline = pipeline
        self.condition = CausalConditionEncoder(pipeline.vae, image, pipeline.runner.config.num_frames_per_block,
                                                pipeline.skip_fixed_point, pipeline.condition_cache,
                                                pipeline.condition_encoder)
        self.dit = pipeline.runner.new_session(self.condition, prompt=prompt, seed=seed, rig=rig, shift=flow_shift,
                                               text_embedding=text_embedding)
        self.decoder_cache = CausalCache()
        self.failed: Optional[str] = None

    @property
    def chunk_index(self) -> int:
        return self.dit.chunk_index

    def reset(self) -> None:
        self.dit.reset()                      # also resets the condition encoder and the camera
        self.decoder_cache.reset()
        self.failed = None

    def state_dict(self, copy: Callable[[Tensor], Tensor] = torch.clone) -> dict:
        """The session's state after its last chunk, but for its K/V window's slots (`dit.kv.slot_state`):
        the DiT session's, the condition encoder's and the decoder cache's (this rank's share of it), each
        tensor through `copy`."""
        if self.failed:
            raise ValueError(f"session failed ({self.failed}): its DiT and decoder are not at one chunk")
        return {"dit": self.dit.state_dict(copy), "condition": self.condition.state_dict(copy),
                "decoder": self.decoder_cache.state_dict(copy)}

    def load_state(self, state: dict) -> None:
        """Continue from `state` (as `state_dict` gave it, from a session of the same pipeline, image, prompt,
        seed and flow shift, on the same rank of a group of the same size), its tensors on any device. The
        K/V window is put back on its own (`dit.kv.load_slots`, up to the same chunk)."""
        self.dit.load_state(state["dit"])
        self.condition.load_state(state["condition"])
        self.decoder_cache.load_state(state["decoder"], self.pipeline.runner.device)
        self.failed = None

    @torch.no_grad()
    def step(self, controls: Optional[Controls] = None, should_stop: Callable[[], bool] = lambda: False,
             prompt: Optional[tuple[str, int]] = None, profile: bool = False) -> Optional[VideoChunk]:
        """One chunk. A stopped or failed DiT chunk changes nothing lasting; a failure after it (decode,
        pixels) leaves the DiT one chunk ahead of the decoder, so the session is marked failed (reset() clears).
        `profile` synchronises the device at stage boundaries (exact stage times, slower)."""
        if self.failed:
            raise RuntimeError(f"session failed earlier ({self.failed}); reset it")
        result = self.dit.run_chunk(controls, should_stop, prompt, profile)
        if result is None:
            return None
        try:
            return self._decode(result, StageTimer(self.pipeline.runner.device, profile))
        except BaseException as e:
            self.failed = f"{type(e).__name__} while decoding chunk {result.index}"
            raise

    def _decode(self, result: ChunkResult, timer: StageTimer) -> VideoChunk:
        decoder = self.pipeline.decoder
        video = decoder.decode(result.latents, self.decoder_cache)       # pixels in [-1, 1] (this rank's share)
        timer.mark("decode")
        frames = decoder.to_frames(video)                                 # uint8 [F, H, W, 3] (None off-root)
        timer.mark("pixels")
        return VideoChunk(result.index, frames, {**result.timings, **timer.timings})
