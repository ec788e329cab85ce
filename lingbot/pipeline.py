"""The whole in-process pipeline: image + prompt + controls -> uint8 video frames, chunk by chunk.

A `VideoSession` owns a DiT session (its K/V window, camera, RNG), the causal condition encoder and the
VAE decoder cache. One `step()` = condition encode + 4 probes + commit (the DiT session) + streaming
decode to uint8 frames on the device (chunk 0 gives 9 frames, every later chunk 12).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch
from torch import Tensor

from .camera import CameraRig, Controls
from .condition import CausalConditionEncoder
from .engine import WorldEngine
from .vae import CausalCache, WanVAE, frames_to_uint8


@dataclass
class VideoChunk:
    index: int
    frames: Optional[Tensor]                         # [F, H, W, 3] uint8 on the device; None off-root under SP
    timings: dict[str, float] = field(default_factory=dict)


def load_image(source: Union[str, Path, "PIL.Image.Image", np.ndarray], width: int, height: int) -> Tensor:
    """An RGB image resized (bicubic) to width x height -> [3, H, W] float32 in [-1, 1]."""
    from PIL import Image, UnidentifiedImageError
    if isinstance(source, (str, Path)):
        try:
            image = Image.open(source)
            image.load()
        except FileNotFoundError:
            raise FileNotFoundError(f"image {source} does not exist") from None
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{source} is not a readable image ({e})") from None
    elif isinstance(source, np.ndarray):
        image = Image.fromarray(source)
    else:
        image = source
    image = image.convert("RGB").resize((width, height), Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    return (pixels - 0.5) / 0.5


class WorldPipeline:
    """Engine + VAE. Under sequence parallelism (`comm` of world size N) every rank runs this with the
    DiT wrapped by apply_sequence_parallel and the decoder sharded by width; the frames reach rank 0
    by `pixel_mode` (other ranks get chunks with frames=None in the root modes)."""

    def __init__(self, engine: WorldEngine, vae: WanVAE, skip_fixed_point: bool = True, comm=None,
                 pixel_mode: str = "root_uint8_p2p"):
        self.engine = engine
        self.vae = vae
        self.skip_fixed_point = skip_fixed_point
        self.comm = comm
        from .parallel.pixels import PIXEL_MODES
        if pixel_mode not in PIXEL_MODES:
            raise ValueError(f"pixel mode {pixel_mode!r} is not one of {list(PIXEL_MODES)}")
        self.pixel_mode = pixel_mode
        if comm is not None and comm.world_size > 1:
            from .parallel.comm import split_range, split_sizes
            from .parallel.vae_shard import shard_decoder_width
            latent_w = engine.latent_hw[1]
            shard_decoder_width(vae, comm, latent_w)
            self.latent_columns = split_range(latent_w, comm.world_size, comm.rank)
            self.pixel_widths = [engine.preset.vae_stride[2] * w for w in split_sizes(latent_w, comm.world_size)]

    @property
    def preset(self):
        return self.engine.preset

    def new_session(self, image: Tensor, prompt: str, seed: int = 0,
                    rig: Optional[CameraRig] = None) -> "VideoSession":
        h, w = self.preset.height, self.preset.width
        if tuple(image.shape) != (3, h, w):
            raise ValueError(f"image must be [3, {h}, {w}] for this preset, got {list(image.shape)}")
        return VideoSession(self, image.to(self.engine.device), prompt, seed, rig)


class VideoSession:
    def __init__(self, pipeline: WorldPipeline, image: Tensor, prompt: str, seed: int, rig: Optional[CameraRig]):
        self.pipeline = pipeline
        self.condition = CausalConditionEncoder(pipeline.vae, image, pipeline.engine.config.num_frames_per_block,
                                                pipeline.skip_fixed_point)
        self.dit = pipeline.engine.new_session(self.condition, prompt=prompt, seed=seed, rig=rig)
        self.decoder_cache = CausalCache()
        self.failed: Optional[str] = None

    @property
    def chunk_index(self) -> int:
        return self.dit.chunk_index

    def reset(self) -> None:
        self.dit.reset()                      # also resets the condition encoder and the camera
        self.decoder_cache.reset()
        self.failed = None

    @torch.no_grad()
    def step(self, controls: Optional[Controls] = None, should_stop: Callable[[], bool] = lambda: False,
             prompt: Optional[tuple[str, int]] = None) -> Optional[VideoChunk]:
        """One chunk. A stopped or failed DiT chunk changes nothing lasting; a failure after it (decode,
        pixels) leaves the DiT one chunk ahead of the decoder, so the session is marked failed (reset() clears)."""
        if self.failed:
            raise RuntimeError(f"session failed earlier ({self.failed}); reset it")
        result = self.dit.run_chunk(controls, should_stop, prompt)
        if result is None:
            return None
        try:
            return self._decode(result)
        except BaseException as e:
            self.failed = f"{type(e).__name__} while decoding chunk {result.index}"
            raise

    def _decode(self, result) -> VideoChunk:
        t0 = time.perf_counter()
        pipeline = self.pipeline
        sharded = pipeline.comm is not None and pipeline.comm.world_size > 1
        if sharded:
            from .parallel.pixels import assemble_frames
            a, b = pipeline.latent_columns
            video = pipeline.vae.decode(result.latents[None, ..., a:b], self.decoder_cache)[0]     # [3, F, H, W_r]
        else:
            video = pipeline.vae.decode(result.latents[None], self.decoder_cache)[0]                # [3, F, H, W]
        t1 = self.dit.mark_stage(result.timings, "decode", t0)
        if sharded:
            frames = assemble_frames(video, pipeline.comm, pipeline.pixel_widths, pipeline.pixel_mode)
        else:
            frames = frames_to_uint8(video)
        self.dit.mark_stage(result.timings, "pixels", t1)
        return VideoChunk(result.index, frames, result.timings)
