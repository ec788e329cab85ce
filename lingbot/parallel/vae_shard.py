"""Width-sharded VAE decode: each rank decodes a contiguous column range of the latents.

`shard_decoder(decoder, comm, latent_width, pixel_mode)` returns a decoder with the same two calls as
`FrameDecoder` (decode, to_frames): `decode` takes the whole chunk's latents and decodes this rank's
columns; `to_frames` brings the uint8 frames to the root by the pixel mode (lingbot/parallel/pixels.py).
To make the VAE decode column shards it swaps, inside `vae.decoder` only:
- every causal 3x3x3 conv for `HaloCausalConv3d` and every 3x3 resample conv for `HaloConv2d`: the
  conv input is assembled in one pass into a preallocated buffer (time history from the cache, the
  shard, zero rows, and (k-1)/2 halo columns from each neighbour; zeros only at the global edges);
- the mid-block attention for `GatheredAttentionBlock`: queries stay local, keys/values are gathered.
Everything else in the decoder (norms, SiLU, nearest upsampling, temporal convs) is per column.
The temporal caches hold only this rank's (haloed) columns.
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import split_range, split_sizes
from ..models.vae import CACHE_FRAMES, AttentionBlock, CausalCache, CausalConv3d, FrameDecoder, WanVAE, conv3d
from .comm import Comm
from .pixels import DEFAULT_PIXEL_MODE, assemble_frames, check_pixel_mode


def assemble_halo_input(x: Tensor, from_left: Optional[Tensor], from_right: Optional[Tensor], pad_h: int,
                        pad_w: int, history: Optional[Tensor] = None, time_front: int = 0) -> Tensor:
    """One-pass conv input: [..., T, H, W] -> [..., time_front + T, H + 2 pad_h, W + 2 pad_w].

    x is 5-D [B, C, T, H, W] when time_front > 0 (history: [B, C, <= time_front, H + 2ph, W + 2pw], already
    haloed, or None = zeros), else 4-D [N, C, H, W]. Missing halos (global edges) are zeros."""
    *lead, h, w = x.shape
    if time_front:
        b, c, t = lead
        buf = x.new_empty((b, c, time_front + t, h + 2 * pad_h, w + 2 * pad_w))
        kept = 0 if history is None else history.shape[2]
        if time_front - kept:
            buf[:, :, :time_front - kept].zero_()
        if kept:
            buf[:, :, time_front - kept:time_front].copy_(history)
        body = buf[:, :, time_front:]
    else:
        buf = x.new_empty((*lead, h + 2 * pad_h, w + 2 * pad_w))
        body = buf
    if pad_h:
        body[..., :pad_h, :].zero_()
        body[..., h + pad_h:, :].zero_()
    body[..., pad_h:pad_h + h, pad_w:pad_w + w].copy_(x)
    for halo, cols in ((from_left, slice(0, pad_w)), (from_right, slice(w + pad_w, w + 2 * pad_w))):
        if halo is None:
            body[..., pad_h:pad_h + h, cols].zero_()
        else:
            body[..., pad_h:pad_h + h, cols].copy_(halo)
    return buf


class HaloCausalConv3d(nn.Module):
    """A decoder CausalConv3d (3x3 in space) over width shards."""

    def __init__(self, conv: CausalConv3d, comm: Comm):
        super().__init__()
        self.conv = conv
        self.comm = comm
        self.cache_key = conv.cache_key
        self.pad_w, _, self.pad_h, _ = conv.space_pad

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        pw = self.pad_w
        from_left, from_right = self.comm.exchange_halo(x[..., :pw], x[..., -pw:])
        history = cache.get(self.cache_key) if cache is not None else None
        buf = assemble_halo_input(x, from_left, from_right, self.pad_h, pw, history, self.conv.time_pad)
        if cache is not None and self.conv.time_pad:
            cache.put(self.cache_key, buf[:, :, -CACHE_FRAMES:].clone())
        return conv3d(buf, self.conv, self.conv.exact)


class HaloConv2d(nn.Module):
    """The 3x3 conv of a decoder Resample (after nearest upsampling), over width shards."""

    def __init__(self, conv: nn.Conv2d, comm: Comm):
        super().__init__()
        self.conv = conv
        self.comm = comm
        self.pad_h, self.pad_w = conv.padding

    def forward(self, x: Tensor) -> Tensor:
        from_left, from_right = self.comm.exchange_halo(x[..., :self.pad_w], x[..., -self.pad_w:])
        buf = assemble_halo_input(x, from_left, from_right, self.pad_h, self.pad_w)
        return F.conv2d(buf, self.conv.weight, self.conv.bias, self.conv.stride)


class GatheredAttentionBlock(nn.Module):
    """Per-frame single-head attention: local queries over the gathered keys/values of all columns."""

    def __init__(self, block: AttentionBlock, comm: Comm, widths: list[int]):
        super().__init__()
        self.block = block
        self.comm = comm
        self.widths = widths

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        qkv = self.block.to_qkv(self.block.norm(frames))                            # [(b t), 3c, h, w]
        q, kv = qkv[:, :c], qkv[:, c:]
        kv = self.comm.all_gather_uneven(kv, dim=3, sizes=self.widths, kind="vae_all_gather")   # [(b t), 2c, h, W]
        q = q.reshape(b * t, 1, c, h * w).transpose(2, 3).contiguous()             # [(b t), 1, hw, c]
        k, v = kv.reshape(b * t, 2, c, -1).transpose(2, 3).unbind(1)               # [(b t), hW, c] each
        # contiguous q/k/v: the fused SDPA kernels need them (strided inputs fall back to the math path)
        out = F.scaled_dot_product_attention(q, k[:, None].contiguous(), v[:, None].contiguous())
        out = out.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        out = self.block.proj(out).view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return x + out


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


class ShardedFrameDecoder(FrameDecoder):
    """Decodes this rank's latent columns; the frames reach the root by `pixel_mode`."""

    def __init__(self, vae: WanVAE, comm: Comm, latent_width: int, pixel_mode: str):
        super().__init__(vae)
        n = comm.world_size
        if latent_width < n:
            raise ValueError(f"latent width {latent_width} cannot be split over {n} ranks")
        self.comm = comm
        self.pixel_mode = pixel_mode
        self.columns = split_range(latent_width, n, comm.rank)
        widths = split_sizes(latent_width, n)
        self.pixel_widths = [vae.config.spatial_stride * w for w in widths]
        for name, module in list(vae.decoder.named_modules()):
            if isinstance(module, CausalConv3d) and module.space_pad[0] > 0:
                _replace(vae.decoder, name, HaloCausalConv3d(module, comm))
            elif isinstance(module, nn.Conv2d) and name.endswith("resample.1"):
                _replace(vae.decoder, name, HaloConv2d(module, comm))
            elif isinstance(module, AttentionBlock):
                _replace(vae.decoder, name, GatheredAttentionBlock(module, comm, widths))

    def decode(self, latents: Tensor, cache: CausalCache) -> Tensor:
        """The whole chunk's latents [16, t, h, w] -> this rank's pixel columns [3, T, H, W_r]."""
        start, end = self.columns
        return self.vae.decode(latents[None, ..., start:end], cache)[0]

    def to_frames(self, video: Tensor) -> Optional[Tensor]:
        return assemble_frames(video, self.comm, self.pixel_widths, self.pixel_mode)


def shard_decoder(decoder: FrameDecoder, comm: Comm, latent_width: int,
                  pixel_mode: str = DEFAULT_PIXEL_MODE) -> FrameDecoder:
    """Decode by width shards over `comm` (changes decoder.vae in place; world size 1 returns `decoder`)."""
    check_pixel_mode(pixel_mode)
    if comm.world_size == 1:
        return decoder
    return ShardedFrameDecoder(decoder.vae, comm, latent_width, pixel_mode)
