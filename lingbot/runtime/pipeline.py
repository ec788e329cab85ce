"""The whole in-process pipeline: image + prompt + controls -> uint8 video frames, chunk by chunk.

A `WorldSession` owns a DiT session (its K/V window, camera, RNG), the causal condition encoder and the
VAE decoder cache. One `step()` = condition encode + 4 probes + commit (the DiT session) + streaming
decode to uint8 frames on the device (chunk 0 gives 9 frames, every later chunk 12). The pipeline runs
the same code on one device and on every rank of a sequence-parallel group: parallelism lives in the
modules it is given (the DiT, the frame decoders), never here. A session's state between chunks, all but
its K/V window's slots, is one `state_dict` (what snapshot.py copies to the host) and `load_state`.

A pipeline holds one or more frame decoders by name ("wan": the Wan VAE; "tae": the tiny autoencoder,
lingbot/models/tae.py); each session picks one when it is made, its own. A session may also name other
loaded decoders its chunks may run on (`switch_to`: the quality ladder's decoder rungs); it then keeps a ring
of its latest latents, from which a decoder switched to is warmed exactly (decoding.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor

from ..camera import CameraRig, Controls
from ..io.images import model_image
from ..models.vae import CausalCache, FrameDecoder, WanVAE
from ..transfer import to_device
from .condition import CausalConditionEncoder, ChunkEncoder, ConditionCache
from .decoding import ChunkDecoder, DecoderStream, loaded_decoder
from .dit_runner import ChunkResult, DiTRunner, StageTimer


@dataclass
class VideoChunk:
    index: int
    frames: Optional[Tensor]                         # [F, H, W, 3] uint8 on the device; None off-root under SP
    timings: dict[str, float] = field(default_factory=dict)
    latents: Optional[Tensor] = None                 # [16, t, h, w] the DiT's normalised output (keep_latents)


class WorldPipeline:
    """DiT runner + VAE (the condition encoder) + frame decoders. Under sequence parallelism every rank runs
    this with the DiT, the decoders and the condition encoder already wrapped (lingbot/builder.py); other
    ranks than the root get chunks with frames=None in the root pixel modes.

    `decoders`: the frame decoders by name, the first the sessions' default (None: `decoder`, or the Wan
    decoder of `vae`, as "wan")."""

    def __init__(self, runner: DiTRunner, vae: WanVAE, skip_fixed_point: bool = True,
                 decoder: Optional[ChunkDecoder] = None, condition_cache: bool = True,
                 condition_encoder: Optional[ChunkEncoder] = None,
                 decoders: Optional[dict[str, ChunkDecoder]] = None):
        self.runner = runner
        self.vae = vae
        if decoders is not None and decoder is not None:
            raise ValueError("give a pipeline `decoder` or `decoders`, not both")
        if decoders is None:
            decoders = {"wan": decoder if decoder is not None else FrameDecoder(vae)}
        if not decoders:
            raise ValueError("a pipeline needs at least one frame decoder")
        self.decoders: dict[str, ChunkDecoder] = dict(decoders)
        self.default_decoder = next(iter(self.decoders))
        # one chunk of the condition encoder: on this device, or once per group (lingbot/parallel/condition.py)
        self.condition_encoder = condition_encoder if condition_encoder is not None else ChunkEncoder(vae)
        self.skip_fixed_point = skip_fixed_point
        # first frame -> its conditions up to the fixed point, shared by the sessions (needs the fixed point)
        self.condition_cache = ConditionCache() if condition_cache else None

    @property
    def preset(self):
        return self.runner.preset

    @property
    def decoder(self) -> ChunkDecoder:
        """The default frame decoder (the first loaded)."""
        return self.decoders[self.default_decoder]

    def decoder_name(self, name: Optional[str] = None) -> str:
        """`name` if this pipeline loaded it (None: the default); else DecoderNotLoaded."""
        return self.default_decoder if name is None else loaded_decoder(self.decoders, name)

    def new_session(self, image: Union[np.ndarray, Tensor], prompt: Optional[str], seed: int = 0,
                    rig: Optional[CameraRig] = None, flow_shift: Optional[float] = None,
                    text_embedding: Optional[Tensor] = None, decoder: Optional[str] = None,
                    window: Optional[tuple[int, int]] = None, switch_to: Sequence[str] = ()) -> WorldSession:
        """`image`: the first frame at the preset's size, uint8 [H, W, 3] or float [3, H, W] in [-1, 1];
        `flow_shift`: the sampler's shift for this session (None: the preset's); `text_embedding`: a ready
        encoder output [1, T, text_dim] instead of a prompt (a runner built without a text encoder);
        `decoder`: the name of a loaded frame decoder (None: the default; else DecoderNotLoaded); `window`: the
        session's own K/V window (sink_chunks, window_chunks; None: the model's: kv_cache.KVWindow);
        `switch_to`: other loaded decoders its chunks may run on (`step(decoder=...)`). Under
        sequence parallelism every rank makes the session with the same arguments."""
        name = self.decoder_name(decoder)
        image = model_image(image)
        h, w = self.preset.height, self.preset.width
        if tuple(image.shape) != (3, h, w):
            raise ValueError(f"image must be [3, {h}, {w}] for this preset, got {list(image.shape)}")
        return WorldSession(self, to_device(image, self.runner.device), prompt, seed, rig, flow_shift, text_embedding,
                            name, window, switch_to)


class WorldSession:
    """One user's world: the DiT session, the condition encoder, and its frame decoding (decoding.py: the
    decoder its chunks run on and that decoder's cache)."""

    def __init__(self, pipeline: WorldPipeline, image: Tensor, prompt: Optional[str], seed: int,
                 rig: Optional[CameraRig], flow_shift: Optional[float] = None,
                 text_embedding: Optional[Tensor] = None, decoder: Optional[str] = None,
                 window: Optional[tuple[int, int]] = None, switch_to: Sequence[str] = ()):
        self.pipeline = pipeline
        self.decoder_name = pipeline.decoder_name(decoder)
        self.decoding = DecoderStream(pipeline.decoders, self.decoder_name,
                                      [n for n in switch_to if n != self.decoder_name],
                                      pipeline.runner.config.num_frames_per_block)
        self.condition = CausalConditionEncoder(pipeline.vae, image, pipeline.runner.config.num_frames_per_block,
                                                pipeline.skip_fixed_point, pipeline.condition_cache,
                                                pipeline.condition_encoder)
        self.dit = pipeline.runner.new_session(self.condition, prompt=prompt, seed=seed, rig=rig, shift=flow_shift,
                                               text_embedding=text_embedding, window=window)
        self.failed: Optional[str] = None

    @property
    def chunk_index(self) -> int:
        return self.dit.chunk_index

    @property
    def decoder(self) -> ChunkDecoder:
        """The decoder the session's last chunk ran on (its own until a chunk ran on another)."""
        return self.decoding.decoder()

    @property
    def decoder_cache(self) -> CausalCache:
        return self.decoding.cache

    def reset(self) -> None:
        self.dit.reset()                      # also resets the condition encoder and the camera
        self.decoding.reset()
        self.failed = None

    def state_dict(self, copy: Callable[[Tensor], Tensor] = torch.clone) -> dict:
        """The session's state after its last chunk, but for its K/V window's slots (`dit.kv.slot_state`):
        the DiT session's, the condition encoder's and the decoder cache's (this rank's share of it), each
        tensor through `copy`, the session's own decoder's name and the one the cache belongs to, and the ring
        of latents a decoder switched to is warmed from (empty unless the session may switch)."""
        if self.failed:
            raise ValueError(f"session failed ({self.failed}): its DiT and decoder are not at one chunk")
        return {"dit": self.dit.state_dict(copy), "condition": self.condition.state_dict(copy),
                **self.decoding.state_dict(copy)}

    def load_state(self, state: dict) -> None:
        """Continue from `state` (as `state_dict` gave it, from a session of the same pipeline, image, prompt,
        seed and flow shift, on the same rank of a group of the same size), its tensors on any device. The
        K/V window is put back on its own (`dit.kv.load_slots`, up to the same chunk). The session must use
        the same own decoder as the state's, and may switch to the decoder its cache belongs to."""
        self.decoding.check_state(state)
        self.dit.load_state(state["dit"])
        self.condition.load_state(state["condition"])
        self.decoding.load_state(state, self.pipeline.runner.device)
        self.failed = None

    @torch.no_grad()
    def step(self, controls: Optional[Controls] = None, should_stop: Callable[[], bool] = lambda: False,
             prompt: Optional[tuple[str, int]] = None, profile: bool = False,
             keep_latents: bool = False, steps: Optional[int] = None,
             decoder: Optional[str] = None) -> Optional[VideoChunk]:
        """One chunk. A stopped or failed DiT chunk changes nothing lasting; a failure after it (decode,
        pixels) leaves the DiT one chunk ahead of the decoder, so the session is marked failed (reset() clears).
        `profile` synchronises the device at stage boundaries (exact stage times, slower); `keep_latents`
        returns the chunk's latents with its frames (to decode them again, `lingbot generate --save-latents`);
        `steps`: a cheaper rung's denoising forwards (lingbot/runtime/rungs.py; None: all); `decoder`: the
        decoder of this chunk (None: the session's own; another of its `switch_to` is warmed first)."""
        if self.failed:
            raise RuntimeError(f"session failed earlier ({self.failed}); reset it")
        result = self.dit.run_chunk(controls, should_stop, prompt, profile, steps)
        if result is None:
            return None
        try:
            chunk = self._decode(result, StageTimer(self.pipeline.runner.device, profile), decoder)
            if keep_latents:
                chunk.latents = result.latents
            return chunk
        except BaseException as e:
            self.failed = f"{type(e).__name__} while decoding chunk {result.index}"
            raise

    def _decode(self, result: ChunkResult, timer: StageTimer, name: Optional[str]) -> VideoChunk:
        video = self.decoding.decode(result.index, result.latents, name)  # pixels in [-1, 1] (this rank's share)
        timer.mark("decode")
        frames = self.decoder.to_frames(video)                            # uint8 [F, H, W, 3] (None off-root)
        timer.mark("pixels")
        return VideoChunk(result.index, frames, {**result.timings, **timer.timings})


@torch.no_grad()
def decode_latents(decoder: ChunkDecoder, latents: Tensor, latent_frames: int) -> Iterator[Tensor]:
    """A session's saved latents [16, T, h, w] -> the uint8 frames [F, H, W, 3] of each chunk in turn, decoded
    chunk by chunk with one fresh cache, as the session decoded them (`lingbot decode`). T must be whole
    chunks of `latent_frames`."""
    total = latents.shape[1]
    if total == 0 or total % latent_frames:
        raise ValueError(f"{total} latent frames are not whole chunks of {latent_frames}")
    cache = CausalCache()
    for start in range(0, total, latent_frames):
        yield decoder.to_frames(decoder.decode(latents[:, start:start + latent_frames], cache))
