"""The Wan 2.1 video VAE (causal 3D convolutions), with module names equal to diffusers'
AutoencoderKLWan keys so a diffusers-format `vae/` folder loads strictly by name (lingbot/io/weights.py).

Causality makes decoding streamable: every causal conv keeps the last 2 frames of its input in a
`CausalCache` owned by the session, so decoding chunk after chunk equals decoding the whole clip.
Decoding runs one latent frame per decoder step (the first frame of a clip gives 1 pixel frame,
every later one 4); encoding runs the first pixel frame alone, then 4 frames per step.
Latents outside this module are normalised: (z - latents_mean) * (1 / latents_std).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import VAEConfig

CACHE_FRAMES = 2   # a temporal kernel of 3 needs the 2 frames before the current input


# ---------------------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------------------
class CausalCache:
    """Per-session temporal state of every causal conv: key (module path) -> its last input frames.

    Entries are replaced, never written in place, so `copy()` is a cheap, independent snapshot
    (a pending state that is committed only when its chunk succeeds)."""

    def __init__(self, entries: Optional[dict[str, Tensor]] = None):
        self.entries: dict[str, Tensor] = dict(entries or {})

    def get(self, key: str) -> Optional[Tensor]:
        return self.entries.get(key)

    def put(self, key: str, value: Tensor) -> None:
        self.entries[key] = value

    def copy(self) -> CausalCache:
        return CausalCache(self.entries)

    def reset(self) -> None:
        self.entries.clear()

    @property
    def started(self) -> bool:
        return bool(self.entries)

    def bitwise_equal(self, other: CausalCache) -> bool:
        """Same keys, shapes and values. The values are compared on the device and read back as one flag
        (one host sync, not one per entry)."""
        if self.entries.keys() != other.entries.keys():
            return False
        pairs = [(v, other.entries[k]) for k, v in self.entries.items()]
        if any(a.shape != b.shape or a.dtype != b.dtype for a, b in pairs):
            return False
        if not self.entries:
            return True
        same = torch.stack([(a == b).all() for a, b in pairs])
        return bool(same.all())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.entries.values())

    def state_dict(self, copy: Callable[[Tensor], Tensor] = torch.clone) -> dict[str, Tensor]:
        """The entries (module path -> its last input frames), each through `copy` (a snapshot's copy to
        the host; by default a clone on the device)."""
        return {key: copy(value) for key, value in self.entries.items()}

    def load_state(self, state: dict[str, Tensor], device: torch.device | str | None = None) -> None:
        """Hold `state` (as `state_dict` gives it), moved to `device`, instead of the current entries. The
        entries are replaced, not written into: a copy of the old ones still in flight reads them intact."""
        self.entries = {key: value if device is None else value.to(device) for key, value in state.items()}


# ---------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------
def cpu_fast(x: Tensor, exact: bool) -> bool:
    """Whether the CPU kernels below replace the ones PyTorch picks: float32 on the CPU, unless `exact`."""
    return not exact and x.device.type == "cpu" and x.dtype == torch.float32


def conv3d(x: Tensor, conv: nn.Conv3d, exact: bool = False) -> Tensor:
    """`conv`'s weights over the already padded `x`. On the CPU, float32 runs oneDNN's convolution for every
    shape: PyTorch's own choice sends a 3D input with N*C*T*H <= 20480 (every tiny-preset layer, the VAE's
    narrow ones at small sizes) to its im2col fallback, 2.5-6x slower here. Other devices and `exact` (the
    kernel PyTorch picks, as diffusers runs it) take F.conv3d. The two agree to float rounding, not bitwise."""
    if cpu_fast(x, exact) and torch.backends.mkldnn.is_available():
        return torch.ops.aten.mkldnn_convolution(x.contiguous(), conv.weight, conv.bias, [0, 0, 0],
                                                 list(conv.stride), list(conv.dilation), conv.groups)
    return F.conv3d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


def normalize_channels(x: Tensor, exact: bool = False) -> Tensor:
    """x / max(||x||_2 over dim 1, 1e-12), F.normalize's formula. On the CPU (float32, not `exact`) the norm
    is the square root of a plain sum of squares: linalg's norm reduces a strided channel axis ~20x slower
    here. Equal to F.normalize to float rounding (a few 1e-8), not bitwise."""
    if cpu_fast(x, exact):
        return x / (x * x).sum(dim=1, keepdim=True).sqrt().clamp_min(1e-12)
    return F.normalize(x, dim=1)


class CausalConv3d(nn.Conv3d):
    """Conv3d padded causally in time (2*p frames in front, none behind), zero padded in space.

    With a cache, the 2 frames before the input come from the cache instead of zeros. `exact` takes the
    kernel PyTorch picks on the CPU too (conv3d above; WanVAE.use_exact_kernels)."""

    cache_key: str = ""
    exact: bool = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
        pt, ph, pw = self.padding
        self.time_pad = 2 * pt
        self.space_pad = (pw, pw, ph, ph)
        self.padding = (0, 0, 0)

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        if self.time_pad == 0:
            return conv3d(F.pad(x, (*self.space_pad, 0, 0)), self, self.exact)
        front = self.time_pad
        if cache is not None:
            previous = cache.get(self.cache_key)
            history = x if previous is None else torch.cat([previous, x], dim=2)
            cache.put(self.cache_key, history[:, :, -CACHE_FRAMES:].clone())
            if previous is not None:
                x = history
                front -= previous.shape[2]
        return conv3d(F.pad(x, (*self.space_pad, front, 0)), self, self.exact)


class RMSNorm(nn.Module):
    """Wan's RMS_norm over channels: F.normalize(x, dim=1) * sqrt(dim) * gamma (fp32 for half inputs); the
    norm as normalize_channels computes it (`exact`: F.normalize's own)."""

    exact: bool = False

    def __init__(self, dim: int, images: bool = False):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return normalize_channels(xf, self.exact).to(x.dtype) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: Tensor, cache: Optional[CausalCache]) -> Tensor:
        h = self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)), cache)
        x = self.conv2(F.silu(self.norm2(x)), cache)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)             # [(b t), c, h, w]
        qkv = self.to_qkv(self.norm(frames)).reshape(b * t, 1, 3 * c, h * w)
        q, k, v = qkv.permute(0, 1, 3, 2).contiguous().chunk(3, dim=-1)        # [(b t), 1, hw, c] each
        out = F.scaled_dot_product_attention(q, k, v)
        out = out.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
        out = self.proj(out).view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return x + out


class Upsample2x(nn.Upsample):
    """Nearest-exact 2x in space, computed in fp32."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.float()).type_as(x)


class Resample(nn.Module):
    """Spatial 2x up/down sampling, with a causal temporal 2x for the 3d modes."""

    cache_key: str = ""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = nn.Sequential(Upsample2x(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                          nn.Conv2d(dim, dim // 2, 3, padding=1))
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=(0, 0, 0))

    def _temporal_upsample(self, x: Tensor, cache: CausalCache) -> Tensor:
        # The first frame of a clip is not upsampled in time; it leaves a zero history (Wan's "Rep"
        # state: the next step's time_conv sees zeros before it). From then on every frame is doubled.
        key = self.time_conv.cache_key
        if cache.get(key) is None:
            cache.put(key, torch.zeros_like(x[:, :, :1]).expand(-1, -1, CACHE_FRAMES, -1, -1).contiguous())
            return x
        b, c, t, h, w = x.shape
        x = self.time_conv(x, cache)                                          # [b, 2c, t, h, w]
        return x.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)

    def _temporal_downsample(self, x: Tensor, cache: CausalCache) -> Tensor:
        # The first frame passes alone; later steps convolve [last frame before, new frames] with stride 2.
        previous = cache.get(self.cache_key)
        cache.put(self.cache_key, x[:, :, -1:].clone())
        if previous is None:
            return x
        return self.time_conv(torch.cat([previous, x], dim=2))

    def forward(self, x: Tensor, cache: Optional[CausalCache]) -> Tensor:
        if self.mode == "upsample3d" and cache is not None:
            x = self._temporal_upsample(x, cache)
        b, c, t, h, w = x.shape
        y = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))      # per frame, 2d
        x = y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)
        if self.mode == "downsample3d" and cache is not None:
            x = self._temporal_downsample(x, cache)
        return x


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: Tensor, cache: Optional[CausalCache]) -> Tensor:
        x = self.resnets[0](x, cache)
        return self.resnets[1](self.attentions[0](x), cache)


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample: Optional[str]):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(num_res_blocks + 1))
        self.upsamplers = nn.ModuleList([Resample(out_dim, upsample)]) if upsample else None

    def forward(self, x: Tensor, cache: Optional[CausalCache]) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        return x if self.upsamplers is None else self.upsamplers[0](x, cache)


# ---------------------------------------------------------------------------------------------------
# encoder, decoder, the VAE
# ---------------------------------------------------------------------------------------------------
class Encoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = CausalConv3d(3, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(itertools.pairwise(dims)):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i != len(cfg.dim_mult) - 1:
                blocks.append(Resample(out_dim, "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], cfg.z_dim * 2, 3, padding=1)

    def forward(self, x: Tensor, cache: Optional[CausalCache]) -> Tensor:
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x)), cache)


class Decoder3d(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dims = [cfg.base_dim * cfg.dim_mult[-1]] + [cfg.base_dim * m for m in reversed(cfg.dim_mult)]
        temporal_upsample = tuple(reversed(cfg.temperal_downsample))
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks = []
        for i, (in_dim, out_dim) in enumerate(itertools.pairwise(dims)):
            if i > 0:
                in_dim //= 2            # the previous upsampler halved the channels
            upsample = None
            if i != len(cfg.dim_mult) - 1:
                upsample = "upsample3d" if temporal_upsample[i] else "upsample2d"
            blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks, upsample))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], 3, 3, padding=1)

    def forward(self, x: Tensor, cache: Optional[CausalCache]) -> Tensor:
        x = self.mid_block(self.conv_in(x, cache), cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x)), cache)


class WanVAE(nn.Module):
    """Wan 2.1 VAE. `encode`/`decode` take a `CausalCache` and may be called chunk after chunk."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder3d(cfg)
        self.quant_conv = CausalConv3d(cfg.z_dim * 2, cfg.z_dim * 2, 1)
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder3d(cfg)
        for name, module in self.named_modules():
            if isinstance(module, (CausalConv3d, Resample)):
                module.cache_key = name
        self.register_buffer("latents_mean", torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("latents_inv_std", 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1),
                             persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    def use_exact_kernels(self, exact: bool = True) -> WanVAE:
        """Run PyTorch's own kernel choice on the CPU too (as diffusers' AutoencoderKLWan runs), bitwise its
        output; the default (False) runs the faster CPU kernels of conv3d and normalize_channels, equal to it
        to float rounding. No effect off the CPU."""
        for module in self.modules():
            if isinstance(module, (CausalConv3d, RMSNorm)):
                module.exact = exact
        return self

    def history_frames(self) -> int:
        """How many latent frames of the past the decoder's cache depends on: a fresh cache that decodes the
        last this-many latent frames of a stream holds, bitwise, the cache of the whole stream (a decoder
        switched to mid-session is warmed so: lingbot/runtime/decoding.py). Each causal convolution reaches
        its 2 frames back at its stage's frame rate, which every temporal upsampling doubles: 37.5 latent
        frames for the Wan 2.1 decoder, so 38 (the test checks 37 is not enough)."""
        rate, frames, upsampling = 1, 0.0, set()
        for module in self.decoder.modules():           # in forward order: a stage's blocks, then its upsampler
            if isinstance(module, Resample) and module.mode == "upsample3d":
                frames += module.time_conv.time_pad / rate
                upsampling.add(id(module.time_conv))
                rate *= 2
            elif isinstance(module, CausalConv3d) and id(module) not in upsampling:
                frames += module.time_pad / rate
        return math.ceil(frames)

    def encode(self, video: Tensor, cache: CausalCache) -> Tensor:
        """Pixels [B, 3, T, H, W] in [-1, 1] -> normalised latents (the posterior mode) [B, 16, t, h, w].

        A fresh cache takes the first frame alone, then 4 frames per step; a started cache 4 per step."""
        steps = []
        start = 0
        if not cache.started:
            steps.append((0, 1))
            start = 1
        if (video.shape[2] - start) % 4:
            raise ValueError(f"{video.shape[2]} frames do not split into {'1 + ' if start else ''}4k frames")
        steps += [(s, s + 4) for s in range(start, video.shape[2], 4)]
        out = []
        for a, b in steps:
            h = self.quant_conv(self.encoder(video[:, :, a:b].to(self.dtype), cache))
            mu = h[:, :self.config.z_dim].float()
            out.append((mu - self.latents_mean) * self.latents_inv_std)
        return torch.cat(out, dim=2)

    def decode(self, latents: Tensor, cache: CausalCache) -> Tensor:
        """Normalised latents [B, 16, t, H/8, W/8] -> pixels [B, 3, T, H, W] in [-1, 1] (float32).

        One latent frame per decoder step: the clip's first frame gives 1 pixel frame, later ones 4."""
        out = []
        for i in range(latents.shape[2]):
            z = latents[:, :, i:i + 1].float() / self.latents_inv_std + self.latents_mean
            x = self.post_quant_conv(z.to(self.dtype))
            out.append(self.decoder(x, cache).float())
        return torch.cat(out, dim=2).clamp(-1.0, 1.0)


def frames_to_uint8(video: Tensor) -> Tensor:
    """[3, F, H, W] in [-1, 1] (any float dtype) -> [F, H, W, 3] uint8, on the same device.

    Exactly diffusers' VideoProcessor order: (x / 2 + 0.5).clamp(0, 1) in the input dtype, then float32,
    * 255, round half to even."""
    x = (video / 2 + 0.5).clamp(0, 1).float()
    return (x * 255).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


class FrameDecoder:
    """A chunk's latents -> its uint8 frames, in the two stages the pipeline times apart: `decode`
    (streaming, with the session's cache) and `to_frames` (uint8 on the device). Sequence parallelism
    swaps in a width-sharded decoder with the same two calls (lingbot/parallel/vae_shard.py)."""

    def __init__(self, vae: WanVAE):
        self.vae = vae
        self.history_frames = vae.history_frames()      # before a sequence-parallel wrapper swaps modules

    def decode(self, latents: Tensor, cache: CausalCache) -> Tensor:
        """Normalised latents [16, t, h, w] -> pixels [3, T, H, W] in [-1, 1]."""
        return self.vae.decode(latents[None], cache)[0]

    def to_frames(self, video: Tensor) -> Optional[Tensor]:
        """Pixels from `decode` -> uint8 frames [T, H, W, 3] (None on ranks that hold no frames)."""
        return frames_to_uint8(video)
