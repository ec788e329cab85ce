"""The tiny decoder in a sequence-parallel group: the root rank decodes the whole chunk alone.

After the DiT every rank holds the chunk's whole latents (the head's all-gather), so the root can decode
them without asking anyone: no collective at all, and no pixel gather (the frames are born on the root,
where the muxer reads them). The other ranks skip the decode and go on to the next chunk's DiT work (they
wait at its first collective anyway). Width sharding, as the Wan decoder does it, would add a halo
exchange at each of the 32 3x3 convolutions of a latent frame step (96 per chunk) and a pixel gather, to
split a decode of 25x fewer FLOPs than the Wan decoder's (docs/architecture.md, "The tiny decoder").

Pixel modes: the root modes (root_float, root_uint8_allgather, root_uint8_p2p) are one and the same here,
the root's frames; `native` (every rank ends with the frames) makes every rank decode the same latents
with the same weights, again without a collective. A rank that does not decode keeps an empty decoder
cache, so its snapshots hold none.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..models.tae import TinyFrameDecoder
from ..models.vae import CausalCache
from .comm import Comm
from .pixels import DEFAULT_PIXEL_MODE, check_pixel_mode


class RootFrameDecoder:
    """`TinyFrameDecoder`'s two calls on the root rank (on every rank in the `native` pixel mode)."""

    def __init__(self, decoder: TinyFrameDecoder, comm: Comm, pixel_mode: str = DEFAULT_PIXEL_MODE):
        self.decoder = decoder
        self.history_frames = decoder.history_frames
        self.comm = comm
        self.pixel_mode = check_pixel_mode(pixel_mode)

    @property
    def decodes_here(self) -> bool:
        return self.comm.is_root or self.pixel_mode == "native"

    def decode(self, latents: Tensor, cache: CausalCache) -> Optional[Tensor]:
        """The whole chunk's latents [16, t, h, w] -> pixels [3, T, H, W] in [-1, 1] (None off the root)."""
        return self.decoder.decode(latents, cache) if self.decodes_here else None

    def to_frames(self, video: Optional[Tensor]) -> Optional[Tensor]:
        return self.decoder.to_frames(video)


def root_decoder(decoder: TinyFrameDecoder, comm: Comm,
                 pixel_mode: str = DEFAULT_PIXEL_MODE) -> TinyFrameDecoder | RootFrameDecoder:
    """The tiny decoder for `comm`'s group (world size 1 returns `decoder`)."""
    check_pixel_mode(pixel_mode)
    if comm.world_size == 1:
        return decoder
    return RootFrameDecoder(decoder, comm, pixel_mode)
