"""How a chunk's decoded pixels reach the root rank (docs/architecture.md, "Pixel modes").

Each rank holds its width shard of the chunk's pixels [3, F, H, W_r] (float, in [-1, 1]). Modes:
- native: every rank ends with the full uint8 frames (float shards all-gathered, converted everywhere);
- root_float: float shards gathered to rank 0, converted there;
- root_uint8_allgather: every rank converts its shard, the uint8 shards are all-gathered, rank 0 keeps them;
- root_uint8_p2p (default): every rank converts its shard and sends it to rank 0 point to point.
All modes give the same bytes at rank 0 (the conversion is per pixel). Root modes return None elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..models.vae import frames_to_uint8
from .comm import Comm

PIXEL_MODES = ("native", "root_float", "root_uint8_allgather", "root_uint8_p2p")
DEFAULT_PIXEL_MODE = "root_uint8_p2p"


def check_pixel_mode(mode: str) -> str:
    if mode not in PIXEL_MODES:
        raise ValueError(f"pixel mode {mode!r} is not one of {list(PIXEL_MODES)}")
    return mode


def assemble_frames(shard: Tensor, comm: Comm, widths: list[int], mode: str = DEFAULT_PIXEL_MODE) -> Optional[Tensor]:
    """Width shard [3, F, H, W_r] -> uint8 frames [F, H, W, 3] at rank 0 (every rank for 'native')."""
    check_pixel_mode(mode)
    if comm.world_size == 1:
        return frames_to_uint8(shard)
    if mode == "native":
        return frames_to_uint8(comm.all_gather_uneven(shard, dim=3, sizes=widths, kind="pixels"))
    if mode == "root_float":
        full = comm.gather_to_root(shard, dim=3, sizes=widths, kind="pixels")
        return None if full is None else frames_to_uint8(full)
    local = frames_to_uint8(shard)                                                 # [F, H, W_r, 3]
    if mode == "root_uint8_allgather":
        full = comm.all_gather_uneven(local, dim=2, sizes=widths, kind="pixels")
        return full if comm.is_root else None
    f, h, _, c = local.shape
    parts = comm.send_to_root(local, [(f, h, w, c) for w in widths], kind="pixels")
    return None if parts is None else torch.cat(parts, dim=2)
