"""The prompt encoder of a sequence-parallel group: one copy (UMT5-XXL is about 11 GB in bf16), on rank 0.

Rank 0 encodes; every other rank receives the embedding [B, max_length, text_dim] by one broadcast over
the group and computes its text K/V from it with its own DiT weights, exactly as a rank with its own
encoder would. Every rank must call `encode` for the same prompts in the same order (the runtime
resolves prompts inside the chunk calls, which every rank runs in the same order).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..models.text_encoder import TextEncoder
from .comm import Comm


class GroupTextEncoder:
    """Same `encode` call as TextEncoder; `encoder` is the real one on rank 0 and None elsewhere."""

    def __init__(self, encoder: Optional[TextEncoder], comm: Comm, max_length: int, dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        if comm.is_root and encoder is None:
            raise ValueError("rank 0 of a group needs the text encoder")
        self.encoder = encoder
        self.comm = comm
        self.max_length = max_length
        self.dim = dim
        self.dtype = dtype
        self.device = torch.device(device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> Tensor:
        """[B, max_length, dim] on every rank (pad rows zero), in the DiT's dtype."""
        if self.comm.is_root:
            out = self.encoder.encode(prompts).to(device=self.device, dtype=self.dtype)
        else:
            out = torch.empty(len(prompts), self.max_length, self.dim, dtype=self.dtype, device=self.device)
        return self.comm.broadcast(out, src=0, kind="text")


def share_text_encoder(encoder: Optional[TextEncoder], comm: Comm, max_length: int, dim: int, dtype: torch.dtype,
                       device: torch.device | str):
    """The group's encoder: `encoder` itself on a single device, else a GroupTextEncoder."""
    if comm.world_size == 1:
        return encoder
    return GroupTextEncoder(encoder, comm, max_length, dim, dtype, device)
