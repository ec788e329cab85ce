"""A session's frame decoding: which decoder the stream is on, that decoder's cache, and a ring of the
session's latest latents from which another decoder is warmed exactly when a chunk switches to it
(docs/architecture.md, "Decoder rungs").

Both frame decoders are causal with a finite reach into the past (`history_frames`: 38 latent frames for the
Wan decoder, 8 for the tiny one), so a fresh cache that decodes a stream's last `history_frames` latent frames
holds, bitwise, the cache that decoding the whole stream gives. A session that may switch decoders keeps the
latents of its last `ring_chunks` chunks (enough to warm the deepest of its decoders: 13 chunks of 3 latent
frames for the Wan decoder), and a chunk that runs on another decoder than the last one first decodes the
ring's chunks with a fresh cache of that decoder, its pixels dropped. Its frames are then those of that
decoder decoding the session's latents from chunk 0, at the cost of `warm_chunks` decodes rather than the
session's whole past.

That cost can be spread over the chunks before the switch (`prewarm`): a few decodes a chunk into a cache of
its own, started far enough back in the ring for the rate asked, and once it holds the stream's cache the
switch decodes nothing more. A warm-up is not part of a snapshot: a restored session that switches warms at
once, with the same frames.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor

from ..models.vae import CausalCache


class ChunkDecoder(Protocol):
    """A chunk's latents -> its uint8 frames in two timed stages (`vae.FrameDecoder`, `tae.TinyFrameDecoder`
    and their sequence-parallel wrappers). `history_frames`: the latent frames of the past its cache depends
    on (a fresh cache decoding that many holds the stream's)."""

    history_frames: int

    def decode(self, latents: Tensor, cache: CausalCache) -> Optional[Tensor]:
        """Normalised latents [16, t, h, w] -> pixels in [-1, 1] (this rank's share; None: none here)."""

    def to_frames(self, video: Optional[Tensor]) -> Optional[Tensor]:
        """Pixels from `decode` -> uint8 frames [T, H, W, 3] (None on ranks that hold no frames)."""


class DecoderNotLoaded(ValueError):
    """A session asked for a decoder its pipeline did not load; the message names the loaded ones."""


def loaded_decoder(decoders: dict[str, ChunkDecoder], name: str) -> str:
    """`name` if it is one of `decoders`; else DecoderNotLoaded."""
    if name not in decoders:
        raise DecoderNotLoaded(f"decoder {name!r} is not loaded here; loaded: {list(decoders)}")
    return name


@dataclass
class Warmup:
    """A cache of `name` being brought up to the stream: the chunks before `next_chunk` are decoded into it,
    from `start` (chunk 0, or far enough back that the cache is exact once it reaches the stream)."""
    name: str
    cache: CausalCache
    start: int
    next_chunk: int


class DecoderStream:
    """The decoding of one session's chunks. `decoders`: the pipeline's by name; `own`: the session's decoder
    (its top rung's); `switch_to`: the other decoders its chunks may run on (a ring is kept only then);
    `latent_frames`: a chunk's latent frames."""

    def __init__(self, decoders: dict[str, ChunkDecoder], own: str, switch_to: Sequence[str] = (),
                 latent_frames: int = 3):
        for name in (own, *switch_to):
            loaded_decoder(decoders, name)
        self.decoders = decoders
        self.own = self.active = own
        self.allowed = frozenset((own, *switch_to))
        self.latent_frames = latent_frames
        self.cache = CausalCache()                       # the active decoder's: the stream's
        self.ring_chunks = max(map(self.warm_chunks, self.allowed)) if switch_to else 0
        self.ring: deque[tuple[int, Tensor]] = deque(maxlen=self.ring_chunks or None)
        self.warming: Optional[Warmup] = None
        self.warm_decodes = 0                            # ring chunks decoded to warm a decoder, in this process

    def warm_chunks(self, name: str) -> int:
        """The chunks a fresh cache of `name` decodes to hold the stream's: its history in whole chunks."""
        return math.ceil(self.decoders[name].history_frames / self.latent_frames)

    def decoder(self, name: Optional[str] = None) -> ChunkDecoder:
        return self.decoders[self.active if name is None else name]

    def decode(self, index: int, latents: Tensor, name: Optional[str] = None) -> Optional[Tensor]:
        """Chunk `index`'s pixels with decoder `name` (None: the session's own), warming it first if the last
        chunk ran on another; the latents go into the ring."""
        name = self.own if name is None else name
        self._check(name)
        if name != self.active:
            warm = self.warming
            if warm is None or warm.name != name or not self._exact_at(warm, index) or not self._reaches(warm, index):
                start = max(0, index - self.warm_chunks(name))
                if start < index and not self._held(start):
                    raise RuntimeError(f"chunk {start} has left the ring ({[i for i, _ in self.ring]}): cannot warm "
                                       f"{name!r}")
                warm = Warmup(name, CausalCache(), start, start)
            self._advance(warm, index)
            self.cache, self.active, self.warming = warm.cache, name, None
        video = self.decoders[name].decode(latents, self.cache)
        if self.ring_chunks:
            self.ring.append((index, latents.detach().clone()))
        return video

    def prewarm(self, name: str, index: int, max_decodes: int = 1) -> bool:
        """Before chunk `index`: decode up to `max_decodes` chunks into a warm-up of `name`; True when a switch to
        `name` at chunk `index` decodes nothing more (it is the active decoder, or its warm-up is exact now).

        A warm-up decodes warm_chunks(name) chunks in all, the last the chunk before the switch. At `max_decodes`
        a chunk it starts far enough back in the ring to be ready after about warm_chunks / max_decodes chunks:
        at 1 (the group's choice) it starts one chunk back and costs one decode a chunk, what the decoder costs
        once switched to, so a group with room to climb has room to warm; at warm_chunks it is ready at once."""
        self._check(name)
        if name == self.active:
            return True
        warm = self.warming
        if warm is None or warm.name != name or not self._reaches(warm, index):
            n = self.warm_chunks(name)           # ready at call n + 1 - back after n decodes: back <= n + 1 - n / max
            start = max(0, index - min(n, n + 1 - math.ceil(n / max(1, max_decodes))))
            if start < index and not self._held(start):
                start = index
            warm = self.warming = Warmup(name, CausalCache(), start, start)
        self._advance(warm, min(index, warm.next_chunk + max(0, max_decodes)))
        return warm.next_chunk == index and self._exact_at(warm, index)

    def _check(self, name: str) -> None:
        if name not in self.allowed:
            raise ValueError(f"this session decodes with {sorted(self.allowed)}, not {name!r}")

    def _exact_at(self, warm: Warmup, index: int) -> bool:
        """Whether `warm`, once it has decoded every chunk before `index`, holds the stream's cache there."""
        return warm.start == 0 or index - warm.start >= self.warm_chunks(warm.name)

    def _reaches(self, warm: Warmup, index: int) -> bool:
        """Whether the chunks `warm` has still to decode before `index` are in the ring."""
        return warm.next_chunk == index or self._held(warm.next_chunk)

    def _held(self, chunk: int) -> bool:
        return bool(self.ring) and self.ring[0][0] <= chunk <= self.ring[-1][0]

    def _advance(self, warm: Warmup, until: int) -> None:
        decoder = self.decoders[warm.name]
        while warm.next_chunk < until:
            decoder.decode(self.ring[warm.next_chunk - self.ring[0][0]][1], warm.cache)    # pixels dropped
            warm.next_chunk += 1
            self.warm_decodes += 1

    def reset(self) -> None:
        self.cache, self.active, self.warming = CausalCache(), self.own, None
        self.ring.clear()

    def state_dict(self, copy: Callable[[Tensor], Tensor] = torch.clone) -> dict:
        """The session's own decoder's name, the active one's and its cache, and the ring (chunk indices and
        latents), tensors through `copy`."""
        return {"decoder_name": self.own, "active_decoder": self.active, "decoder": self.cache.state_dict(copy),
                "ring": {"chunks": [i for i, _ in self.ring], "latents": [copy(t) for _, t in self.ring]}}

    def check_state(self, state: dict) -> None:
        """ValueError unless `state` is of a session with the same own decoder, on one this session may use."""
        if state.get("decoder_name") != self.own:
            raise ValueError(f"a state of a session with the {state.get('decoder_name')!r} decoder cannot continue "
                             f"a session with the {self.own!r} one")
        active = state.get("active_decoder", self.own)
        if active not in self.allowed:
            raise ValueError(f"a state decoding with {active!r} cannot continue a session that decodes with "
                             f"{sorted(self.allowed)}")

    def load_state(self, state: dict, device: torch.device | str | None = None) -> None:
        """Continue from `state` (as `state_dict` gave it; check_state first)."""
        self.check_state(state)
        active = state.get("active_decoder", self.own)
        self.cache = CausalCache()
        self.cache.load_state(state["decoder"], device)
        self.active, self.warming = active, None
        ring = state.get("ring", {"chunks": [], "latents": []})
        kept = list(zip(ring["chunks"], ring["latents"]))[-self.ring_chunks:] if self.ring_chunks else []
        self.ring.clear()
        self.ring.extend((i, t if device is None else t.to(device)) for i, t in kept)
