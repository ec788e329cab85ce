"""The tiny autoencoder's decoder for Wan 2.1 latents (the TAEHV family's `taew2_1`, madebyollin/taehv, MIT
licence), with module names equal to the published file's `decoder.*` keys so it loads strictly by name
(lingbot/io/weights.py). Only the decoder is built: the engine never encodes with it.

The decoder is a stack of 2-D convolutions applied frame by frame. Time enters in two ways only:
- a memory block sees, beside its input frame, its own input of the previous frame (zeros before the first);
- a 1x1 "grow" convolution turns one frame into `stride` frames (its output channels, split in `stride`
  groups, are consecutive frames); two of stride 2 give 4 frames per latent frame.
So the per-block state is one frame per memory block: kept in the session's `CausalCache` (one entry per
block, its last input frame), decoding chunk after chunk equals decoding the whole clip at once. Decoding
runs one latent frame per step, like the Wan decoder, so every convolution sees the same shapes whatever the
chunking and the equality is bitwise, not just within rounding.

Input: the DiT's normalised latents as they are (the TAE was trained on them: no latents_mean/std step),
NCTHW. Output: RGB, which the TAE makes in [0, 1]; `decode` returns it mapped to [-1, 1], the range of the
Wan decoder's pixels, so both go through the same uint8 conversion (`vae.frames_to_uint8`). The first
`t_upscale - 1` = 3 frames of a stream are dropped (the reference implementation's alignment with the Wan
decoder, whose first latent frame gives 1 frame): a clip of T latent frames gives 4T - 3 frames, chunk 0
9 and every later chunk 12.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import TAEConfig
from .vae import CausalCache, frames_to_uint8


# ---------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------
def conv3x3(in_channels: int, out_channels: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=bias)


class SoftClamp(nn.Module):
    """3 * tanh(x / 3): keeps latents in (-3, 3) smoothly before the first convolution (no weights)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """relu(convs(cat[x, past]) + x), `past` being this block's input of the previous frame. The file's
    decoder blocks keep their width, so the skip is the identity (no weights)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Sequential(conv3x3(2 * channels, channels), nn.ReLU(),
                                  conv3x3(channels, channels), nn.ReLU(),
                                  conv3x3(channels, channels))

    def forward(self, x: Tensor, past: Tensor) -> Tensor:
        return F.relu(self.conv(torch.cat([x, past], dim=1)) + x)


class TGrow(nn.Module):
    """One frame -> `stride` frames: a 1x1 conv to stride * C channels, read as `stride` consecutive frames."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        return self.conv(x).reshape(n * self.stride, c, h, w)       # [(n stride), c, h, w], frames in order


# ---------------------------------------------------------------------------------------------------
# the decoder
# ---------------------------------------------------------------------------------------------------
def decoder_layers(cfg: TAEConfig) -> list[nn.Module]:
    """The layers in the file's order (their index is their key): soft clamp, conv in; then three stages of
    3 memory blocks, nearest 2x upsampling, a grow of stride 1, 2, 2, and a conv to the next width; then
    ReLU and the conv to RGB. Layers without weights keep their index so the keys line up."""
    c0, c1, c2, c3 = cfg.channels
    layers: list[nn.Module] = [SoftClamp(), conv3x3(cfg.latent_channels, c0), nn.ReLU()]
    for width, stride, next_width in ((c0, 1, c1), (c1, 2, c2), (c2, 2, c3)):
        layers += [MemBlock(width), MemBlock(width), MemBlock(width), nn.Upsample(scale_factor=2),
                   TGrow(width, stride), conv3x3(width, next_width, bias=False)]
    layers += [nn.ReLU(), conv3x3(c3, 3)]
    return layers


def config_from_shapes(shapes: Mapping[str, Sequence[int]]) -> Optional[TAEConfig]:
    """The TAEConfig of a decoder whose `decoder.*` weights have these shapes (a file's): the latent channels
    and the first width from the conv in [c0, latent, 3, 3], each later width from the conv that ends a stage
    [c_next, c, 3, 3]. None where one of those weights is absent or not a 2-D convolution's (the strict load
    then names the key)."""
    with torch.device("meta"):
        layers = decoder_layers(TAEConfig())
    # the plain convolutions in the file's order: conv in, the three width convs, the RGB conv
    convs = [f"decoder.{i}.weight" for i, layer in enumerate(layers) if type(layer) is nn.Conv2d][:4]
    if not all(key in shapes and len(shapes[key]) == 4 for key in convs):
        return None
    return TAEConfig(latent_channels=int(shapes[convs[0]][1]), channels=tuple(int(shapes[k][0]) for k in convs))


class TinyDecoder(nn.Module):
    """The TAE decoder. `decode` takes a `CausalCache` and may be called chunk after chunk."""

    def __init__(self, cfg: TAEConfig):
        super().__init__()
        self.config = cfg
        self.decoder = nn.Sequential(*decoder_layers(cfg))
        self.t_upscale = 1
        for module in self.decoder:
            if isinstance(module, TGrow):
                self.t_upscale *= module.stride
        self.frames_to_trim = self.t_upscale - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder[1].weight.dtype

    def history_frames(self) -> int:
        """How many latent frames of the past the cache depends on (see vae.WanVAE.history_frames): each memory
        block reaches one frame back at its stage's frame rate, which each grow multiplies: 3 + 3 + 3/2 = 7.5
        latent frames for taew2_1, so 8."""
        rate, frames = 1, 0.0
        for layer in self.decoder:
            if isinstance(layer, MemBlock):
                frames += 1 / rate
            elif isinstance(layer, TGrow):
                rate *= layer.stride
        return math.ceil(frames)

    def _step(self, latent: Tensor, cache: CausalCache) -> Tensor:
        """One latent frame [B, C, h, w] -> t_upscale frames [B, t_upscale, 3, 8h, 8w] in [0, 1]."""
        b = latent.shape[0]
        x, frames = latent.to(self.dtype), 1                         # x: [(B frames), C, H, W]
        for index, layer in enumerate(self.decoder):
            if isinstance(layer, MemBlock):
                key = f"decoder.{index}"
                seq = x.view(b, frames, *x.shape[1:])                # [B, frames, C, H, W]
                previous = cache.get(key)
                if previous is None:
                    previous = torch.zeros_like(seq[:, 0])
                past = torch.cat([previous[:, None], seq[:, :-1]], dim=1).view_as(x)
                cache.put(key, seq[:, -1].clone())                   # [B, C, H, W]: a copy, not a view of x
                x = layer(x, past)
            else:
                x = layer(x)
                if isinstance(layer, TGrow):
                    frames *= layer.stride
        return x.view(b, frames, *x.shape[1:]).clamp(0, 1)

    def decode(self, latents: Tensor, cache: CausalCache) -> Tensor:
        """Normalised latents [B, C, t, h, w] -> pixels [B, 3, T, 8h, 8w] in [-1, 1] (float32), T = 4t, less
        the first 3 frames of a stream (a cache not started yet)."""
        trim = 0 if cache.started else self.frames_to_trim
        out = [self._step(latents[:, :, i], cache) for i in range(latents.shape[2])]
        video = torch.cat(out, dim=1)[:, trim:]                      # [B, T, 3, H, W] in [0, 1]
        return video.permute(0, 2, 1, 3, 4).float() * 2 - 1


class TinyFrameDecoder:
    """A chunk's latents -> its uint8 frames with the tiny decoder: the two calls of `vae.FrameDecoder`
    (decode with the session's cache, then uint8 on the device), so the pipeline takes either."""

    def __init__(self, tae: TinyDecoder):
        self.tae = tae
        self.history_frames = tae.history_frames()

    def decode(self, latents: Tensor, cache: CausalCache) -> Tensor:
        """Normalised latents [C, t, h, w] -> pixels [3, T, H, W] in [-1, 1]."""
        return self.tae.decode(latents[None], cache)[0]

    def to_frames(self, video: Optional[Tensor]) -> Optional[Tensor]:
        """Pixels from `decode` -> uint8 frames [T, H, W, 3] (None where `decode` gave none)."""
        return None if video is None else frames_to_uint8(video)
