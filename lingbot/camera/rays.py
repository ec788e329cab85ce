"""Intrinsics, per-pixel rays and camera patches: what the DiT's `patch_embedding_wancamctrl` receives.

Rays per pixel centre: d = normalize(R . normalize(((x+.5)-cx)/fx, ((y+.5)-cy)/fy, 1)), o = t; channels
[o, d]. Ray maps are built in float32 on the target device, from the poses and intrinsics (float64 on the
host) copied there asynchronously (lingbot/transfer.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..transfer import to_device
from .poses import CameraError

REFERENCE_SIZE = (832, 480)          # (width, height) the checkpoint's intrinsics are given in
KEYBOARD_FOCAL = 500.0


@dataclass(frozen=True)
class Intrinsics:
    fx: float
    fy: float
    cx: float
    cy: float

    def scaled(self, width: int, height: int, reference: tuple[int, int] = REFERENCE_SIZE) -> Intrinsics:
        """Intrinsics given at the 832x480 reference size, rescaled to width x height (no crop)."""
        sx, sy = width / reference[0], height / reference[1]
        return Intrinsics(self.fx * sx, self.fy * sy, self.cx * sx, self.cy * sy)

    @staticmethod
    def keyboard(width: int, height: int) -> Intrinsics:
        """Keyboard control: focal 500 px at the target size, principal point at the centre."""
        return Intrinsics(KEYBOARD_FOCAL, KEYBOARD_FOCAL, width / 2, height / 2)


def intrinsics_table(intrinsics, frames: int) -> np.ndarray:
    """One Intrinsics for every frame, or per-frame (fx, fy, cx, cy) rows -> [frames, 4] float64."""
    if isinstance(intrinsics, Intrinsics):
        row = [intrinsics.fx, intrinsics.fy, intrinsics.cx, intrinsics.cy]
        return np.tile(np.asarray(row, dtype=np.float64), (frames, 1))
    table = np.asarray(intrinsics, dtype=np.float64)
    if table.shape != (frames, 4):
        raise CameraError(f"intrinsics of shape {list(table.shape)} for {frames} frames; expected [{frames}, 4]")
    return table


def ray_map(rel: np.ndarray, intrinsics, height: int, width: int, device="cpu") -> Tensor:
    """Per pixel centre rays [o, d] of each relative pose: [6, F, H, W] float32. `intrinsics`: one
    Intrinsics for all frames or an [F, 4] table of (fx, fy, cx, cy)."""
    # the host's pose math reaches the device by one asynchronous copy each (lingbot/transfer.py): no host sync
    k = to_device(intrinsics_table(intrinsics, len(rel)), device, torch.float32)                  # [F, 4]
    ys = (torch.arange(height, dtype=torch.float32, device=device)[None] + 0.5 - k[:, 3:4]) / k[:, 1:2]  # [F, H]
    xs = (torch.arange(width, dtype=torch.float32, device=device)[None] + 0.5 - k[:, 2:3]) / k[:, 0:1]   # [F, W]
    f = len(rel)
    cam = torch.stack([xs[:, None, :].expand(f, height, width), ys[:, :, None].expand(f, height, width),
                       torch.ones(f, height, width, device=device)], dim=-1)         # [F, H, W, 3]
    cam = F.normalize(cam, dim=-1)
    rel_t = to_device(rel, device, torch.float32)                                       # [F, 4, 4]
    d = F.normalize(torch.einsum("fij,fhwj->fhwi", rel_t[:, :3, :3], cam), dim=-1)    # [F, H, W, 3]
    o = rel_t[:, None, None, :3, 3].expand_as(d)
    return torch.cat([o, d], dim=-1).permute(3, 0, 1, 2).contiguous()               # [6, F, H, W]


def camera_patches(rays: Tensor, unshuffle: int = 8, patch: tuple[int, int] = (2, 2)) -> Tensor:
    """[6, F, H, W] rays -> [F*h*w, 1536] patches for patch_embedding_wancamctrl.

    pixel_unshuffle(8): channel c*64 + i*8 + j (row i, column j inside the 8x8 block) -> [384, F, H/8, W/8];
    then the 1x2x2 patch flattened in Conv3d weight order (channel, pt, ph, pw); tokens in (f, h, w) order.
    """
    _c, f, _h, _w = rays.shape
    x = F.pixel_unshuffle(rays.permute(1, 0, 2, 3), unshuffle)          # [F, 384, H/8, W/8]
    ph, pw = patch
    hh, ww = x.shape[2] // ph, x.shape[3] // pw
    x = x.view(f, x.shape[1], hh, ph, ww, pw)                           # [F, 384, h, ph, w, pw]
    x = x.permute(0, 2, 4, 1, 3, 5)                                     # [F, h, w, 384, ph, pw]
    return x.reshape(f * hh * ww, -1)                                   # [L, 1536]
