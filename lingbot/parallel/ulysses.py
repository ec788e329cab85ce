"""Ulysses sequence parallelism for the causal DiT: tokens split across ranks, heads split for attention.

`apply_sequence_parallel(model, comm)` wraps a built model (STYLE.md §3). Per forward, each rank:
- embeds the whole chunk (a cheap conv) and keeps its contiguous token range (uneven counts allowed);
- in every self-attention: one fused all-to-all of q/k/v (scatter heads, gather sequence), attention of
  all tokens over the window for its H/N heads (its K/V slab holds only those heads), one all-to-all
  back (scatter sequence, gather heads);
- cross-attention, the camera injector, the FFN and all modulation are per token: no communication
  (the text K/V is computed on every rank, replicated);
- the head runs on its tokens, and one all-gather assembles the [L, 64] output for unpatchify, so every
  rank ends the forward with the whole chunk's latents (the sampler step is replicated).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..config import ConfigError
from ..model import CausalWanModel, ChunkConditioning, KVWindowLike, TextKV, TimeConditioning, WindowAttention
from .comm import Comm, split_range, split_sizes


class UlyssesWindowAttention(nn.Module):
    """Drop-in for WindowAttention: q, k, v [B, L_r, H, D] in, [B, L_r, H, D] out."""

    def __init__(self, comm: Comm, heads: int):
        super().__init__()
        self.comm = comm
        self.heads = heads
        self.local = WindowAttention()
        self.token_sizes: Optional[list[int]] = None          # set per chunk by the wrapper

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv: KVWindowLike, layer: int) -> Tensor:
        n, r = self.comm.world_size, self.comm.rank
        sizes = self.token_sizes
        b, lr, h, d = q.shape
        hn = h // n
        # 1. fused q/k/v all-to-all: [B, L_r, 3, N, H/N, D] -> rows [N (dest), L_r, B, 3, H/N, D]
        qkv = torch.stack([q, k, v], dim=2).view(b, lr, 3, n, hn, d).permute(3, 1, 0, 2, 4, 5)
        got = self.comm.all_to_all(qkv.reshape(n * lr, -1), [lr] * n, sizes, kind="all_to_all")
        got = got.view(sum(sizes), b, 3, hn, d).permute(1, 0, 2, 3, 4)            # [B, L, 3, H/N, D]
        q_all, k_all, v_all = got.unbind(2)
        # 2. attention of every token over the window, for this rank's heads
        out = self.local(q_all, k_all, v_all, kv, layer)                           # [B, L, H/N, D]
        # 3. all-to-all back: rows by token range -> [N (source head group), L_r, B, H/N, D]
        rows = out.transpose(0, 1).reshape(sum(sizes), -1)
        back = self.comm.all_to_all(rows, sizes, [sizes[r]] * n, kind="all_to_all")
        back = back.view(n, sizes[r], b, hn, d).permute(2, 1, 0, 3, 4)             # [B, L_r, N, H/N, D]
        return back.reshape(b, sizes[r], h, d)


class SequenceParallelModel(nn.Module):
    """The model's interface (as the engine uses it), run over a sequence-parallel group."""

    def __init__(self, model: CausalWanModel, comm: Comm):
        super().__init__()
        cfg = model.config
        if cfg.num_attention_heads % comm.world_size:
            raise ConfigError(f"{cfg.num_attention_heads} attention heads do not divide by the sequence-parallel "
                              f"degree {comm.world_size}; use a degree that divides them (e.g. 2, 4, 8 for 40)")
        self.model = model
        self.comm = comm
        self.config = cfg
        self.attentions = []
        for block in model.blocks:
            attn = UlyssesWindowAttention(comm, cfg.num_attention_heads)
            block.self_attn.attn = attn
            self.attentions.append(attn)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def local_heads(self) -> int:
        return self.config.num_attention_heads // self.comm.world_size

    def time_conditioning(self, timestep: Tensor) -> TimeConditioning:
        return self.model.time_conditioning(timestep)

    def text_kv(self, context: Tensor) -> TextKV:
        return self.model.text_kv(context)            # replicated on every rank: cross-attention needs no comm

    def prepare_chunk(self, camera_patches: Tensor, first_frame: int, grid: tuple[int, int, int],
                      cache_camera_modulation: bool = True) -> ChunkConditioning:
        total = grid[0] * grid[1] * grid[2]
        tokens = split_range(total, self.comm.world_size, self.comm.rank)
        return self.model.prepare_chunk(camera_patches, first_frame, grid, cache_camera_modulation, tokens)

    def forward(self, latents: Tensor, condition: Tensor, time: TimeConditioning, text: TextKV,
                chunk: ChunkConditioning, kv: KVWindowLike, commit: bool = False) -> Tensor:
        total = chunk.grid[0] * chunk.grid[1] * chunk.grid[2]
        sizes = split_sizes(total, self.comm.world_size)
        for attn in self.attentions:
            attn.token_sizes = sizes
        start, end = chunk.tokens
        x = self.model.embed(latents, condition)[:, start:end]                    # [B, L_r, dim]
        x = self.model.run_blocks(x, time, text, chunk, kv)
        out = self.model.head(x, time.temb)                                        # [B, L_r, 64]
        out = self.comm.all_gather_uneven(out.float(), dim=1, sizes=sizes, kind="all_gather")
        if commit:
            kv.commit()
        return self.model.unpatchify(out, chunk.grid)


def apply_sequence_parallel(model: CausalWanModel, comm: Comm) -> nn.Module:
    """Wrap a built model for Ulysses SP over `comm` (world size 1 returns the model unchanged)."""
    if comm.world_size == 1:
        return model
    return SequenceParallelModel(model, comm)
