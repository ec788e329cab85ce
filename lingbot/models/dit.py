"""The LingBot-World causal, camera-controlled DiT (Wan architecture): the math only.

Module names equal the raw Wan/LingBot checkpoint keys (docs/architecture.md, "The model"). One
forward runs one chunk of `num_frames_per_block` latent frames. Everything that is fixed for the five
forwards of a chunk (RoPE tables, camera modulation) is prepared once in `prepare_chunk`; everything
fixed for a prompt (text K/V) once in `text_kv`; the time embeddings of the sampler's timesteps once per
runner. Caches are passed in, never created here; no collectives, no sessions.

Parallelism is a plan declared as data: `token_split` (which of a chunk's tokens this device computes,
and how the head's output is reassembled) and each block's `self_attn.attn` (attention over the window).
On one device both are the plain modules below; `lingbot.parallel.apply_sequence_parallel` swaps them
for their sequence-parallel versions after the model is built. The forward is the same either way.

Tensor vocabulary: hidden_states [B, L, dim] (fp32 residual stream), camera tokens [B, L, dim],
temb [B, dim] / timestep_proj [B, 6, dim] (fp32), text K/V [B, heads, text_len, head_dim].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import TransformerConfig


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def sinusoidal_embedding(timestep: Tensor, dim: int) -> Tensor:
    """[B] -> [B, dim] with order [cos, sin], computed in float64 then cast to float32."""
    half = dim // 2
    position = timestep.to(torch.float64)
    inv_freq = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=timestep.device) / half)
    args = position[:, None] * inv_freq[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1).float()


def rope_tables(config: TransformerConfig, first_frame: int, num_frames: int, height: int, width: int,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [num_frames*height*width, head_dim/2] (fp32) for tokens in (f, h, w) order.

    The temporal position is the absolute latent frame index; spatial positions restart every frame.
    Angles are computed in float64 (base 10000, axes split 44/42/42 at head_dim 128).
    """
    angles = []
    for axis_dim, positions in zip(config.rope_axes, (
            torch.arange(first_frame, first_frame + num_frames, dtype=torch.float64, device=device),
            torch.arange(height, dtype=torch.float64, device=device),
            torch.arange(width, dtype=torch.float64, device=device))):
        inv_freq = 1.0 / torch.pow(10000.0, torch.arange(0, axis_dim, 2, dtype=torch.float64, device=device) / axis_dim)
        angles.append(torch.outer(positions, inv_freq))
    t, h, w = angles
    # [F, H, W, head_dim/2] -> [L, head_dim/2]
    grid = torch.cat([
        t[:, None, None, :].expand(num_frames, height, width, -1),
        h[None, :, None, :].expand(num_frames, height, width, -1),
        w[None, None, :, :].expand(num_frames, height, width, -1)], dim=-1).reshape(num_frames * height * width, -1)
    return torch.cos(grid).float(), torch.sin(grid).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, L, H, D] by cos/sin [L, D/2]; math in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))            # [B, L, H, D/2, 2]
    x1, x2 = pairs.unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


def fp32_linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """A Linear evaluated in float32 whatever its storage dtype (time embedding, modulation)."""
    return F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())


# ---------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32, returning float32 (inputs are the fp32 residual stream)."""

    def forward(self, x: Tensor) -> Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)


class KVWindowLike(Protocol):
    """What self-attention needs of a session's K/V store (see lingbot/runtime/kv_cache.py)."""

    chunk_tokens: int          # tokens of one whole chunk (all ranks together)

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store this chunk's key/value [B, heads, L, D]; return all visible [B, heads, S, D]."""

    def commit(self) -> None:
        """Called once after a commit forward: the chunk's K/V become lasting."""


class WindowAttention(nn.Module):
    """Attention of the chunk's queries over the visible window (sequence parallelism swaps this module).
    `attend(q, k, v)` on [B, H, S, D] is the kernel: PyTorch's SDPA unless the runtime picked another
    (lingbot/runtime/attention.py)."""

    def __init__(self):
        super().__init__()
        self.attend = F.scaled_dot_product_attention

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv: KVWindowLike, layer: int) -> Tensor:
        # q, k, v: [B, L, H, D] -> stored / attended as [B, H, S, D]
        keys, values = kv.update(layer, k.transpose(1, 2), v.transpose(1, 2))
        out = self.attend(q.transpose(1, 2), keys, values)                      # no mask inside the window
        return out.transpose(1, 2)                                               # [B, L, H, D]


class TokenSplit(nn.Module):
    """Which of a chunk's tokens this device computes: on one device, all of them. Sequence parallelism
    swaps in a split over its ranks (lingbot/parallel/ulysses.py) with the same three calls."""

    parts = 1                  # devices the tokens are split over

    def token_range(self, total: int) -> tuple[int, int]:
        """The [start, end) range of a chunk's `total` tokens that this device computes."""
        return 0, total

    def forward(self, x: Tensor) -> Tensor:
        """The whole chunk [B, L, ...] -> this device's tokens [B, L_r, ...]."""
        start, end = self.token_range(x.shape[1])
        return x if (start, end) == (0, x.shape[1]) else x[:, start:end]

    def gather(self, x: Tensor, total: int) -> Tensor:
        """This device's tokens [B, L_r, C] -> the whole chunk [B, total, C]."""
        return x


class Projections(nn.Module):
    """q, k, v, o (with bias) and RMSNorm over the full dim on q and k: what both attentions of a block have."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)


class SelfAttention(Projections):
    """q/k/v -> `attn` (the window attention: cache write and, under SP, the collectives) -> o. The block
    calls the three parts separately, so the dense math around `attn` can be compiled as regions."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__(dim, heads, eps)
        self.attn = WindowAttention()

    def qkv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, L, dim] -> q, k, v [B, L, H, D], RMSNorm on q and k, RoPE on q and k."""
        b, n, _ = x.shape
        q = self.norm_q(self.q(x)).view(b, n, self.heads, -1)      # [B, L, H, D]
        k = self.norm_k(self.k(x)).view(b, n, self.heads, -1)
        v = self.v(x).view(b, n, self.heads, -1)
        return apply_rope(q, *rope), apply_rope(k, *rope), v


class CrossAttention(Projections):
    def text_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """context [B, T, dim] -> K, V [B, H, T, D], computed once per prompt."""
        b, t, _ = context.shape
        k = self.norm_k(self.k(context)).view(b, t, self.heads, -1).transpose(1, 2)
        v = self.v(context).view(b, t, self.heads, -1).transpose(1, 2)
        return k.contiguous(), v.contiguous()

    def forward(self, x: Tensor, text_k: Tensor, text_v: Tensor) -> Tensor:
        b, n, _ = x.shape
        q = self.norm_q(self.q(x)).view(b, n, self.heads, -1).transpose(1, 2)   # [B, H, L, D]
        out = F.scaled_dot_product_attention(q, text_k, text_v)
        return self.o(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))


# ---------------------------------------------------------------------------------------------------
# block
# ---------------------------------------------------------------------------------------------------
class CausalCameraBlock(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        dim, eps = config.dim, config.eps
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)
        self.norm1 = LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, config.num_attention_heads, eps)
        self.cam_injector_layer1 = nn.Linear(dim, dim)
        self.cam_injector_layer2 = nn.Linear(dim, dim)
        self.cam_scale_layer = nn.Linear(dim, dim)
        self.cam_shift_layer = nn.Linear(dim, dim)
        self.norm3 = LayerNorm(dim, eps, elementwise_affine=True) if config.cross_attn_norm else nn.Identity()
        self.cross_attn = CrossAttention(dim, config.num_attention_heads, eps)
        self.norm2 = LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = FeedForward(dim, config.ffn_dim)

    def camera_modulation(self, camera_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """camera tokens [B, L, dim] -> per-token (scale, shift) [B, L, dim] of the camera injector."""
        f = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(camera_tokens))) + camera_tokens
        return self.cam_scale_layer(f), self.cam_shift_layer(f)

    def forward(self, x: Tensor, timestep_proj: Tensor, text_kv: tuple[Tensor, Tensor],
                camera: tuple[Tensor, Tensor], rope: tuple[Tensor, Tensor], kv: KVWindowLike,
                layer: int) -> Tensor:
        """x [B, L, dim] fp32; timestep_proj [B, 6, dim] fp32; camera = (scale, shift) [B, L, dim].

        Two dense regions around the window attention; lingbot/runtime/compile.py compiles them (one
        compiled graph each, shared by every layer), the attention in between stays as it is."""
        q, k, v = self.attention_inputs(x, timestep_proj, rope)
        y = self.self_attn.attn(q, k, v, kv, layer)                              # [B, L, H, D]
        return self.attention_output(x, y, timestep_proj, text_kv, camera)

    def attention_inputs(self, x: Tensor, timestep_proj: Tensor,
                         rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """1a. modulated LN1 -> q, k, v of the self-attention."""
        shift_msa, scale_msa = (self.modulation[:, :2].float() + timestep_proj[:, :2]).chunk(2, dim=1)
        dtype = self.self_attn.q.weight.dtype
        return self.self_attn.qkv((self.norm1(x) * (1 + scale_msa) + shift_msa).to(dtype), rope)

    def attention_output(self, x: Tensor, y: Tensor, timestep_proj: Tensor, text_kv: tuple[Tensor, Tensor],
                         camera: tuple[Tensor, Tensor]) -> Tensor:
        """1b. gated self-attention output, 2. camera injector, 3. cross-attention, 4. feed-forward."""
        dtype = self.self_attn.q.weight.dtype
        gate_msa, shift_ffn, scale_ffn, gate_ffn = \
            (self.modulation[:, 2:].float() + timestep_proj[:, 2:]).chunk(4, dim=1)   # each [B, 1, dim]
        # 1b. self-attention output, gated
        x = x + self.self_attn.o(y.flatten(2)).float() * gate_msa
        # 2. camera injector (per token)
        cam_scale, cam_shift = camera
        x = (1 + cam_scale.float()) * x + cam_shift.float()
        # 3. cross-attention to the prompt (no gate)
        x = x + self.cross_attn(self.norm3(x).to(dtype), *text_kv).float()
        # 4. feed-forward
        y = self.ffn((self.norm2(x) * (1 + scale_ffn) + shift_ffn).to(dtype))
        return x + y.float() * gate_ffn


class Head(nn.Module):
    def __init__(self, dim: int, out_features: int, eps: float):
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)
        self.norm = LayerNorm(dim, eps, elementwise_affine=False)
        self.head = nn.Linear(dim, out_features)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        shift, scale = (self.modulation.float() + temb[:, None, :]).chunk(2, dim=1)   # [B, 1, dim] each
        return self.head((self.norm(x) * (1 + scale) + shift).to(self.head.weight.dtype))


# ---------------------------------------------------------------------------------------------------
# per-call conditioning objects
# ---------------------------------------------------------------------------------------------------
@dataclass
class TimeConditioning:
    """Time embedding of one timestep: temb [B, dim] and timestep_proj [B, 6, dim], fp32."""
    temb: Tensor
    timestep_proj: Tensor


@dataclass
class TextKV:
    """Cross-attention K/V of one prompt for every layer: lists of [B, H, T, D], and the text encoder output
    they were projected from, [B, T, text_dim] in the model's dtype (prompt transitions blend that)."""
    keys: list[Tensor]
    values: list[Tensor]
    embedding: Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values, self.embedding])


@dataclass
class ChunkConditioning:
    """Everything fixed across the five forwards of one chunk.

    rope: cos/sin [L, D/2]; camera_tokens [B, L, dim]; camera_modulation: per layer (scale, shift)
    [B, L, dim], or None to recompute it in every forward (the reference path). L counts this device's
    tokens only (all of the chunk on one device, this rank's share under sequence parallelism).
    """
    first_frame: int
    grid: tuple[int, int, int]           # (frames, height, width) in tokens
    rope: tuple[Tensor, Tensor]
    camera_tokens: Tensor
    camera_modulation: Optional[list[tuple[Tensor, Tensor]]]


# ---------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------
class CausalWanModel(nn.Module):
    """LingBot-World causal DiT. Parameter names equal the checkpoint keys."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.patch_embedding_wancamctrl = nn.Linear(config.camera_in_features, dim)
        self.c2ws_hidden_states_layer1 = nn.Linear(dim, dim)
        self.c2ws_hidden_states_layer2 = nn.Linear(dim, dim)
        self.text_embedding = nn.Sequential(nn.Linear(config.text_dim, dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(CausalCameraBlock(config) for _ in range(config.num_layers))
        self.head = Head(dim, config.out_channels * math.prod(config.patch_size), config.eps)
        self.token_split = TokenSplit()

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    @property
    def local_heads(self) -> int:
        """Heads whose K/V this device stores: all of them on one device, H/N under Ulysses SP-N."""
        return self.config.num_attention_heads // self.token_split.parts

    # ---- once per timestep / prompt / chunk -------------------------------------------------------
    def time_conditioning(self, timestep: Tensor) -> TimeConditioning:
        """timestep [B] (the warped t') -> fp32 embeddings; constant per sampler step, so cache it."""
        sin = sinusoidal_embedding(timestep, self.config.freq_dim)
        lin1, _, lin2 = self.time_embedding
        temb = fp32_linear(lin2, F.silu(fp32_linear(lin1, sin)))                  # [B, dim]
        proj = fp32_linear(self.time_projection[1], F.silu(temb))                 # [B, 6*dim]
        return TimeConditioning(temb, proj.unflatten(1, (6, self.config.dim)))

    def text_kv(self, context: Tensor) -> TextKV:
        """UMT5 output [B, 512, text_dim] (pad rows zero) -> per-layer cross-attention K/V."""
        context = context.to(self.dtype)
        ctx = self.text_embedding(context)                                        # [B, T, dim]
        kvs = [block.cross_attn.text_kv(ctx) for block in self.blocks]
        return TextKV([k for k, _ in kvs], [v for _, v in kvs], context)

    def camera_tokens(self, camera_patches: Tensor) -> Tensor:
        """[B, L, 1536] ray patches -> camera tokens c = c + L2(SiLU(L1(c))), [B, L, dim]."""
        c = self.patch_embedding_wancamctrl(camera_patches.to(self.dtype))
        return c + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(c)))

    def prepare_chunk(self, camera_patches: Tensor, first_frame: int, grid: tuple[int, int, int],
                      cache_camera_modulation: bool = True) -> ChunkConditioning:
        """Everything the five forwards of a chunk share, for this device's tokens. grid = (frames, h, w)
        in tokens; camera_patches [B, L_total, 1536]."""
        start, end = self.token_split.token_range(grid[0] * grid[1] * grid[2])
        camera_tokens = self.camera_tokens(camera_patches[:, start:end])
        cos, sin = rope_tables(self.config, first_frame, *grid, device=camera_tokens.device)
        modulation = None
        if cache_camera_modulation:
            modulation = [block.camera_modulation(camera_tokens) for block in self.blocks]
        return ChunkConditioning(first_frame, grid, (cos[start:end], sin[start:end]), camera_tokens, modulation)

    # ---- the forward ----------------------------------------------------------------------------
    def unpatchify(self, x: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """[B, L, 64] -> [B, 16, F, H, W]; the 64 features are ordered (pt, ph, pw, channel)."""
        f, h, w = grid
        pt, ph, pw = self.config.patch_size
        x = x.view(x.shape[0], f, h, w, pt, ph, pw, -1)                          # [B, f, h, w, pt, ph, pw, C]
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)                                     # [B, C, f, pt, h, ph, w, pw]
        return x.reshape(x.shape[0], x.shape[1], f * pt, h * ph, w * pw)

    def forward(self, latents: Tensor, condition: Tensor, time: TimeConditioning, text: TextKV,
                chunk: ChunkConditioning, kv: KVWindowLike, commit: bool = False) -> Tensor:
        """One chunk. Probe (commit=False): the K/V it writes are overwritten by the next forward of the
        same chunk. Commit: the chunk's K/V become lasting for later chunks. latents x_t [B, 16, F, H, W]
        and condition [B, 20, F, H, W] cover the whole chunk; returns the flow prediction of the whole
        chunk [B, 16, F, H, W] in float32."""
        # 1. patch embedding of the whole chunk (a cheap conv), then this device's tokens
        x = torch.cat([latents, condition], dim=1).to(self.dtype)                 # [B, 36, F, H, W]
        x = self.patch_embedding(x).flatten(2).transpose(1, 2).float()            # [B, L, dim]
        total = x.shape[1]
        x = self.token_split(x).contiguous()                                      # [B, L_r, dim]
        # 2. the blocks
        for i, block in enumerate(self.blocks):
            camera = chunk.camera_modulation[i] if chunk.camera_modulation is not None \
                else block.camera_modulation(chunk.camera_tokens)
            x = block(x, time.timestep_proj, (text.keys[i], text.values[i]), camera, chunk.rope, kv, i)
        # 3. the head on this device's tokens, then the whole chunk again
        out = self.token_split.gather(self.head(x, time.temb).float(), total)    # [B, L, 64]
        if commit:
            kv.commit()
        return self.unpatchify(out, chunk.grid)
