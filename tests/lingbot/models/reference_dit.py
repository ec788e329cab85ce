"""An independent float64 reference of the LingBot-World causal camera DiT, written from the formulas with plain
torch ops on a model's parameters (read by name): patch embedding, time / text / camera embeddings, every block,
the head and the unpatchify. It keeps its own K/V history, every committed chunk's keys rotated at absolute time
positions, and concatenates the chunks the window shows explicitly. Nothing of lingbot/models/dit.py's math is
called (tests/lingbot/models/test_block_reference.py runs it beside the runtime)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def silu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def gelu_tanh(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def softmax_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over all keys (no mask), on [B, H, L, D]."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logits = logits - logits.amax(-1, keepdim=True)
    p = logits.exp()
    return (p / p.sum(-1, keepdim=True)) @ v


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of the head dim over (time, height, width): d - 4*(d//6), 2*(d//6), 2*(d//6)."""
    return head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6)


def rope_angles(head_dim: int, first_frame: int, frames: int, height: int, width: int) -> Tensor:
    """Angles [frames*height*width, head_dim/2] (float64) of tokens in (f, h, w) order: for each axis with
    d_a dims, pair i turns by position * 10000^(-2i/d_a); the time position is the absolute latent frame."""
    per_axis = []
    for d_a, n, start in zip(rope_axis_dims(head_dim), (frames, height, width), (first_frame, 0, 0)):
        freqs = 10000.0 ** (-torch.arange(0, d_a, 2, dtype=torch.float64) / d_a)
        per_axis.append((start + torch.arange(n, dtype=torch.float64))[:, None] * freqs[None, :])
    t, h, w = per_axis
    rows = []
    for fi in range(frames):
        for hi in range(height):
            for wi in range(width):
                rows.append(torch.cat([t[fi], h[hi], w[wi]]))
    return torch.stack(rows)


def rotate(x: Tensor, angles: Tensor) -> Tensor:
    """x [B, L, H, D]: pairs (x[2i], x[2i+1]) as complex numbers times exp(i * angle[L, i])."""
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    turned = z * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    return torch.view_as_real(turned).flatten(-2)


class ReferenceDiT:
    """The LingBot-World causal DiT from its formulas, float64, on the model's parameters (by name).

    `history[j]` holds committed chunk j's per-layer (key after RoPE, value) [B, H, L, D]."""

    def __init__(self, model: torch.nn.Module, context: Tensor):
        self.p = {name: t.detach().to(torch.float64) for name, t in model.named_parameters()}
        cfg = model.config
        self.cfg = cfg
        self.heads, self.head_dim, self.eps = cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps
        # text embedding: Linear -> GELU(tanh) -> Linear, once per prompt
        c = context.to(torch.float64)
        self.text = self.linear("text_embedding.2", gelu_tanh(self.linear("text_embedding.0", c)))
        self.history: dict[int, list[tuple[Tensor, Tensor]]] = {}

    # ---- primitives ----------------------------------------------------------------------------
    def linear(self, name: str, x: Tensor) -> Tensor:
        return x @ self.p[f"{name}.weight"].T + self.p[f"{name}.bias"]

    def layer_norm(self, x: Tensor, affine: str | None = None) -> Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + self.eps)
        return y if affine is None else y * self.p[f"{affine}.weight"] + self.p[f"{affine}.bias"]

    def rms_norm(self, x: Tensor, name: str) -> Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.p[f"{name}.weight"]

    def split_heads(self, x: Tensor) -> Tensor:
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)                       # [B, L, H, D]

    # ---- conditioning --------------------------------------------------------------------------
    def time(self, timestep: float) -> tuple[Tensor, Tensor]:
        """Sinusoid [cos | sin] of t at 10000^(-i/half) -> temb [1, dim] and e0 [1, 6, dim]."""
        half = self.cfg.freq_dim // 2
        arg = timestep * 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
        sinusoid = torch.cat([torch.cos(arg), torch.sin(arg)])[None]
        temb = self.linear("time_embedding.2", silu(self.linear("time_embedding.0", sinusoid)))
        e0 = self.linear("time_projection.1", silu(temb)).reshape(1, 6, self.cfg.dim)
        return temb, e0

    def camera_tokens(self, patches: Tensor) -> Tensor:
        """Ray patches [B, L, 1536] -> c = E(p) + L2(SiLU(L1(E(p)))) [B, L, dim]."""
        c = self.linear("patch_embedding_wancamctrl", patches.to(torch.float64))
        return c + self.linear("c2ws_hidden_states_layer2", silu(self.linear("c2ws_hidden_states_layer1", c)))

    def patch_embed(self, latents: Tensor, condition: Tensor) -> Tensor:
        """[x_t | condition] [B, 36, F, H, W] cut into 1x2x2 patches, flattened (channel, pt, ph, pw) as the
        Conv3d weight is, tokens in (f, h, w) order -> [B, L, dim]."""
        x = torch.cat([latents, condition], dim=1).to(torch.float64)
        b, ch, f, hh, ww = x.shape
        patches = x.reshape(b, ch, f, hh // 2, 2, ww // 2, 2).permute(0, 2, 3, 5, 1, 4, 6)
        patches = patches.reshape(b, f * (hh // 2) * (ww // 2), ch * 4)
        weight = self.p["patch_embedding.weight"].reshape(self.cfg.dim, -1)
        return patches @ weight.T + self.p["patch_embedding.bias"]

    def visible_history(self, chunk: int) -> list[int]:
        """Earlier chunks the window shows to `chunk`: those in the first sink_size latent frames, and those
        in the last (sliding_window_num_frames - sink_size) frames that end with `chunk`'s own frames."""
        n = self.cfg.num_frames_per_block
        recent_start = n * (chunk + 1) - (self.cfg.sliding_window_num_frames - self.cfg.sink_size)
        return [j for j in range(chunk) if n * j < self.cfg.sink_size or n * j >= recent_start]

    # ---- one block -----------------------------------------------------------------------------
    def block(self, i: int, x: Tensor, e0: Tensor, camera: Tensor, angles: Tensor,
              chunk: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Block i on x [B, L, dim]; returns the new x and this chunk's (rotated key, value) [B, H, L, D]."""
        pre = f"blocks.{i}"
        e = self.p[f"{pre}.modulation"] + e0                                             # [1, 6, dim]
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = (e[:, j:j + 1] for j in range(6))
        # self-attention: modulated LN, q/k RMSNorm over the full dim, 3-axis RoPE, window of K/V
        h = self.layer_norm(x) * (1 + scale_msa) + shift_msa
        q = rotate(self.split_heads(self.rms_norm(self.linear(f"{pre}.self_attn.q", h), f"{pre}.self_attn.norm_q")),
                   angles).transpose(1, 2)
        k = rotate(self.split_heads(self.rms_norm(self.linear(f"{pre}.self_attn.k", h), f"{pre}.self_attn.norm_k")),
                   angles).transpose(1, 2)
        v = self.split_heads(self.linear(f"{pre}.self_attn.v", h)).transpose(1, 2)
        earlier = self.visible_history(chunk)
        keys = torch.cat([self.history[j][i][0] for j in earlier] + [k], dim=2)
        values = torch.cat([self.history[j][i][1] for j in earlier] + [v], dim=2)
        y = softmax_attention(q, keys, values).transpose(1, 2).flatten(2)
        x = x + self.linear(f"{pre}.self_attn.o", y) * gate_msa
        # camera injector: f = c + L2(SiLU(L1(c))); x <- (1 + scale(f)) * x + shift(f), per token
        f = camera + self.linear(f"{pre}.cam_injector_layer2", silu(self.linear(f"{pre}.cam_injector_layer1", camera)))
        x = (1 + self.linear(f"{pre}.cam_scale_layer", f)) * x + self.linear(f"{pre}.cam_shift_layer", f)
        # cross-attention to the text (affine LN3, q/k RMSNorm, no gate)
        hq = self.layer_norm(x, affine=f"{pre}.norm3")
        cq = self.split_heads(self.rms_norm(self.linear(f"{pre}.cross_attn.q", hq), f"{pre}.cross_attn.norm_q"))
        ck = self.split_heads(self.rms_norm(self.linear(f"{pre}.cross_attn.k", self.text), f"{pre}.cross_attn.norm_k"))
        cv = self.split_heads(self.linear(f"{pre}.cross_attn.v", self.text))
        z = softmax_attention(cq.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2)).transpose(1, 2).flatten(2)
        x = x + self.linear(f"{pre}.cross_attn.o", z)
        # feed-forward, modulated and gated
        h = self.layer_norm(x) * (1 + scale_ffn) + shift_ffn
        x = x + self.linear(f"{pre}.ffn.2", gelu_tanh(self.linear(f"{pre}.ffn.0", h))) * gate_ffn
        return x, (k, v)

    # ---- the whole forward ---------------------------------------------------------------------
    def conditioning(self, timestep: float, patches: Tensor, chunk: int, grid: tuple[int, int, int]):
        temb, e0 = self.time(timestep)
        angles = rope_angles(self.head_dim, self.cfg.num_frames_per_block * chunk, *grid)
        return temb, e0, self.camera_tokens(patches), angles

    def forward(self, latents: Tensor, condition: Tensor, timestep: float, patches: Tensor, chunk: int,
                commit: bool) -> Tensor:
        """One chunk's flow [B, 16, F, H, W]; a commit stores the chunk's K/V in the history."""
        b, _, f, hh, ww = latents.shape
        grid = (f, hh // 2, ww // 2)
        temb, e0, camera, angles = self.conditioning(timestep, patches, chunk, grid)
        x = self.patch_embed(latents, condition)
        kvs = []
        for i in range(self.cfg.num_layers):
            x, kv = self.block(i, x, e0, camera, angles, chunk)
            kvs.append(kv)
        if commit:
            self.history[chunk] = kvs
        # head: modulated LN (shift, scale from head.modulation + temb) -> Linear to (pt, ph, pw, c)
        mod = self.p["head.modulation"] + temb[:, None, :]
        out = self.linear("head.head", self.layer_norm(x) * (1 + mod[:, 1:2]) + mod[:, 0:1])
        out = out.reshape(b, f, hh // 2, ww // 2, 1, 2, 2, -1)
        out = torch.einsum("bfhwpqrc->bcfphqwr", out).reshape(b, -1, f, hh, ww)
        return out
