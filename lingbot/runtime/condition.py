"""The 20-channel condition of each chunk (mask 4 + image latents 16), and where it comes from.

`ConditionSource` is what a DiT session asks for each chunk's condition. Two sources:
- `LatentCondition`: image latents that are already encoded (benchmarks, DiT-only tests);
- `CausalConditionEncoder`: the first frame's VAE latents, encoded chunk by chunk (the pipeline's).

Chunk 0 encodes [image, 8 zero frames] (1 + 4 + 4 pixel frames -> 3 latent frames); every later chunk
encodes 12 zero frames (4 + 4 + 4 -> 3), continuing the encoder's causal state. Each chunk encodes on a
pending copy of that state, committed only when the chunk succeeds.

Fixed point (switch `skip_fixed_point`): after the opening chunk the encoder sees only zeros, so once the
state a chunk returns is bit-identical to the state it was given, every later chunk would produce the
same latents from the same state. That is detected (never assumed) by a bitwise comparison; from then
on the stored latents are reused. A reset clears it.

Across sessions (`ConditionCache`): the conditions depend only on the first frame, so once a session has
reached the fixed point, its per-chunk latents up to it are kept in a bounded LRU keyed by a hash of the
resized image; a later session from the same image replays them and never runs the encoder.

A snapshot takes the encoder's state between chunks (`state_dict`) and a new encoder continues from it
(`load_state`).

Under sequence parallelism the encoder runs once per group (lingbot/parallel/condition.py): rank 0 encodes
and broadcasts each chunk's latents and its fixed-point flag; the other ranks hold no encoder state. The
step that differs is `ChunkEncoder.encode`; everything else here is the same on every rank.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Optional, Protocol

import torch
from torch import Tensor

from ..models.vae import CausalCache, WanVAE
from .kv_cache import LRUCache

log = logging.getLogger(__name__)


def make_condition(image_latents: Tensor, first_frame: int) -> Tensor:
    """cat(mask [4], image latents [16]) for latent frames first_frame.. ; mask = 1 on frame 0 only."""
    _c, f, h, w = image_latents.shape
    mask = torch.zeros(4, f, h, w, dtype=image_latents.dtype, device=image_latents.device)
    if first_frame == 0:
        mask[:, 0] = 1
    return torch.cat([mask, image_latents], dim=0)


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


CONDITION_CACHE_IMAGES = 8       # first frames whose conditions a pipeline keeps
CONDITION_CACHE_CHUNKS = 16      # a session that has not reached the fixed point by then is not cached


class ConditionCache:
    """First frame -> its chunk latents [16, F, h, w] up to and including the fixed point (an LRU)."""

    def __init__(self, images: int = CONDITION_CACHE_IMAGES, max_chunks: int = CONDITION_CACHE_CHUNKS):
        self.entries = LRUCache(images)
        self.max_chunks = max_chunks

    @staticmethod
    def key(image: Tensor) -> str:
        """A hash of the image as the encoder sees it (resized, in [-1, 1]); read at session start only."""
        data = image.detach().to("cpu", torch.float32).contiguous().numpy()
        return hashlib.sha256(repr(tuple(data.shape)).encode() + data.tobytes()).hexdigest()

    def get(self, key: str) -> Optional[tuple[Tensor, ...]]:
        return self.entries.get(key)

    def put(self, key: str, latents: tuple[Tensor, ...]) -> None:
        if len(latents) <= self.max_chunks:
            self.entries.put(key, latents)


class ChunkEncoder:
    """One chunk of the causal encoder on this device, in the VAE's dtype: float32 in every preset.

    Not bf16, by measurement (perf/README.md, "Condition encoder in bf16?"; tiny preset on CPU, random
    weights, 4 first frames): a bf16 copy of the encoder gives conditions off by max |d| 1.2-1.4e-2 (1.0-
    1.2e-2 of the largest value, rms 4.8e-3 relative), about 3x the rounding a bf16 DiT applies to the
    float32 condition anyway at its input (max 3.6-3.9e-3, rms 1.6e-3), and moves the DiT's chunk latents
    by 1.4-1.7e-3 (relative max) against 4.1-4.4e-4 for that rounding. The tolerance is that rounding:
    within it the DiT could not tell the two apart. The fixed point comes at the same chunk (10) in both."""

    def __init__(self, vae: WanVAE):
        self.vae = vae

    def encode(self, video: Callable[[], Tensor], state: CausalCache,
               check_fixed_point: bool) -> tuple[Tensor, CausalCache, bool]:
        """`video()`: the chunk's pixels [1, 3, T, H, W]; `state`: the committed encoder state (left as it
        is). Returns the chunk's latents [16, F, h, w] float32, the state after it (pending until the chunk
        commits), and with `check_fixed_point` whether that state equals `state` bit for bit."""
        pending = state.copy()
        latents = self.vae.encode(video(), pending)[0]
        return latents, pending, check_fixed_point and pending.bitwise_equal(state)


class CausalConditionEncoder:
    """ConditionSource of a session: image [3, H, W] in [-1, 1] -> per-chunk [20, 3, h, w]. With a
    `shared` ConditionCache (and the fixed-point switch on) it replays a cached first frame's latents.
    `encoder`: the chunk step (default this device's ChunkEncoder of `vae`; a group's under SP)."""

    def __init__(self, vae: WanVAE, image: Tensor, frames_per_chunk: int = 3, skip_fixed_point: bool = True,
                 shared: Optional[ConditionCache] = None, encoder: Optional[ChunkEncoder] = None):
        if image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"image must be [3, H, W], got {list(image.shape)}")
        self.vae = vae
        self.encoder = encoder if encoder is not None else ChunkEncoder(vae)
        self.image = image
        self.frames_per_chunk = frames_per_chunk
        self.skip_fixed_point = skip_fixed_point
        self.stride = vae.config.temporal_stride
        self.pixel_frames = self.stride * frames_per_chunk  # per chunk after the first (the first has 1 fewer)
        self.cache = CausalCache()
        self.shared = shared if skip_fixed_point else None
        self.key = ConditionCache.key(image) if self.shared is not None else None
        self.reset()

    def reset(self) -> None:
        self.cache.reset()
        self.committed_chunks = 0
        self.fixed_latents: Optional[Tensor] = None
        self.fixed_point_chunk: Optional[int] = None
        self.encoded_chunks = 0                              # encoder runs (for reports and tests)
        self._pending = None
        self.history: list[Tensor] = []                      # committed latents, until the fixed point
        self.replay = None
        # the shared cache is read at the first chunk, not here: a read marks its entry recent, and under SP
        # every rank's cache must see the same reads in the same order, or their evictions differ and one
        # rank replays while another waits in the encoder's broadcast. Chunk calls run in the same order on
        # every rank; the opening and reset of a session may not (a stop can reach one rank first).
        self._look_up = self.shared is not None

    def state_dict(self, copy: Callable[[Tensor], Tensor] = torch.clone) -> dict:
        """The encoder's state between chunks: the chunks committed, the fixed point (its chunk and latents
        [16, 3, h, w]), the causal cache, and the replayed latents of a first frame seen before; tensors
        through `copy`. Not kept: the latents gathered for the ConditionCache (a continued session does not
        fill it; the conditions are the same either way) and a pending chunk (there is none between chunks)."""
        return {"committed": self.committed_chunks,
                "fixed_point_chunk": self.fixed_point_chunk,
                "fixed_latents": None if self.fixed_latents is None else copy(self.fixed_latents),
                "cache": self.cache.state_dict(copy),
                "replay": None if self.replay is None else tuple(copy(t) for t in self.replay)}

    def load_state(self, state: dict) -> None:
        """Continue from `state` (as `state_dict` gave it, from an encoder of the same image and settings),
        its tensors on any device."""
        device = self.image.device
        self.committed_chunks = state["committed"]
        self.fixed_point_chunk = state["fixed_point_chunk"]
        self.fixed_latents = None if state["fixed_latents"] is None else state["fixed_latents"].to(device)
        self.cache = CausalCache()
        self.cache.load_state(state["cache"], device)
        self.replay = None if state["replay"] is None else tuple(t.to(device) for t in state["replay"])
        self.history, self._pending = [], None
        self._look_up = self.shared is not None and self.committed_chunks == 0

    def _chunk_video(self, chunk: int) -> Tensor:
        c, h, w = self.image.shape
        like = {"dtype": self.image.dtype, "device": self.image.device}
        if chunk == 0:
            zeros = torch.zeros(c, self.pixel_frames - self.stride, h, w, **like)
            return torch.cat([self.image[:, None], zeros], dim=1)[None]          # [1, 3, 9, H, W]
        return torch.zeros(1, c, self.pixel_frames, h, w, **like)

    @torch.no_grad()
    def chunk_condition(self, chunk: int) -> Tensor:
        if chunk != self.committed_chunks:
            raise ValueError(f"condition for chunk {chunk} asked; the encoder is at chunk {self.committed_chunks}")
        first_frame = chunk * self.frames_per_chunk
        if self._look_up:
            self._look_up = False
            self.replay = self.shared.get(self.key)
            if self.replay is not None:                      # a first frame seen before: no encoder at all
                self.fixed_latents = self.replay[-1]
                self.fixed_point_chunk = len(self.replay) - 1
        if self.replay is not None and chunk < len(self.replay):
            self._pending = None
            return make_condition(self.replay[chunk], first_frame)
        if self.fixed_latents is not None:
            self._pending = None
            return make_condition(self.fixed_latents, first_frame)
        latents, pending, reached = self.encoder.encode(lambda: self._chunk_video(chunk), self.cache,
                                                        self.skip_fixed_point and chunk > 0)   # [16, 3, h, w]
        self.encoded_chunks += 1                             # by this device, or by its group's rank 0
        self._pending = (pending, latents, reached)
        return make_condition(latents, first_frame)

    def commit(self) -> None:
        """The chunk that asked for the last condition succeeded: keep its encoder state."""
        if self._pending is not None:
            pending, latents, reached = self._pending
            self.cache = pending
            if self.shared is not None and len(self.history) < self.shared.max_chunks:
                self.history.append(latents)
            if reached:
                self.fixed_latents = latents
                self.fixed_point_chunk = self.committed_chunks
                self.cache = CausalCache()        # the encoder state is no longer needed: free it
                log.debug("condition encoder fixed point at chunk %d", self.committed_chunks)
                if self.shared is not None and len(self.history) == self.committed_chunks + 1:
                    self.shared.put(self.key, tuple(self.history))
                self.history = []
        self._pending = None
        self.committed_chunks += 1
