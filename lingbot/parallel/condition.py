"""The condition encoder of a sequence-parallel group: run once, on rank 0, as the text encoder is.

Until a session's condition reaches its fixed point, every chunk runs the causal VAE encoder over 12
pixel frames (at 480x832 about 24 TFLOP in float32). Every rank needs the result, the same on all of them;
sharding the encoder by width, as the decoder is, would not give the same bits as one device does. So
rank 0 encodes and one broadcast carries the chunk's latents [16, F, h, w] (float32, 1.2 MB at 480x832)
and its fixed-point flag to the other ranks, which hold no encoder state at all (the encoder's causal
cache, about 2 GiB at 480x832, lives on rank 0 only). Every rank then decides the same way: the fixed
point, the stored latents and the first-frame cache see the same values everywhere.

Every rank must ask for the same chunks in the same order: the runtime asks inside the chunk calls, which
every rank of a group runs in the same order (a chunk replayed from the cache or past the fixed point
asks for nothing, on every rank alike, because their states are the same).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..models.vae import CausalCache
from ..runtime.condition import ChunkEncoder
from .comm import Comm


class GroupChunkEncoder(ChunkEncoder):
    """Same `encode` call as ChunkEncoder: rank 0 runs it and broadcasts; `latent_shape` = (16, F, h, w)."""

    def __init__(self, local: ChunkEncoder, comm: Comm, latent_shape: tuple[int, ...]):
        super().__init__(local.vae)
        self.local = local
        self.comm = comm
        self.latent_shape = tuple(latent_shape)

    def encode(self, video: Callable[[], Tensor], state: CausalCache,
               check_fixed_point: bool) -> tuple[Tensor, CausalCache, bool]:
        device = self.vae.latents_mean.device
        numel = math.prod(self.latent_shape)
        # one message: the latents, flattened, then the flag (1.0 when the encoder state came back unchanged)
        if self.comm.is_root:
            latents, pending, reached = self.local.encode(video, state, check_fixed_point)
            message = torch.cat([latents.reshape(-1).float(),
                                 torch.full((1,), float(reached), device=latents.device)])
        else:
            pending = state                       # holds nothing: the encoder's state lives on rank 0
            message = torch.empty(numel + 1, dtype=torch.float32, device=device)
        self.comm.broadcast(message, src=0, kind="condition")
        if self.comm.is_root:
            return latents, pending, reached
        reached = bool(message[numel:].cpu().numpy()[0] == 1.0)     # the host branches on it, as rank 0 did
        return message[:numel].view(self.latent_shape), pending, reached


def share_condition_encoder(local: ChunkEncoder, comm: Comm, latent_shape: tuple[int, ...]) -> ChunkEncoder:
    """The group's chunk encoder: `local` itself on a single device, else a GroupChunkEncoder."""
    if comm.world_size == 1:
        return local
    return GroupChunkEncoder(local, comm, latent_shape)
