"""Ulysses sequence parallelism for the causal DiT: tokens split across ranks, heads split for attention.

`apply_sequence_parallel(model, comm)` changes a built model in place; the model's own forward runs
unchanged. It swaps the two modules the model declares for parallelism:
- `model.token_split` for `SequenceSplit`: each rank keeps its contiguous token range of the chunk
  (uneven counts allowed) after the patch embedding (a cheap conv over the whole chunk), and one
  all-gather reassembles the head's [L, 64] output for unpatchify, so every rank ends the forward with
  the whole chunk's latents (the sampler step is replicated);
- every block's `self_attn.attn` for `UlyssesWindowAttention`: one fused all-to-all of q/k/v (scatter
  heads, gather sequence), attention of all tokens over the window for this rank's H/N heads (its K/V
  slab holds only those heads), one all-to-all back (scatter sequence, gather heads).
Cross-attention, the camera injector, the FFN and all modulation are per token: no communication
(the text K/V is computed on every rank, replicated).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..config import ConfigError, split_range, split_sizes
from ..models.dit import CausalWanModel, KVWindowLike, TokenSplit, WindowAttention
from .comm import Comm


class SequenceSplit(TokenSplit):
    """This rank's contiguous share of a chunk's tokens; the head output is all-gathered."""

    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm
        self.parts = comm.world_size

    def token_range(self, total: int) -> tuple[int, int]:
        return split_range(total, self.comm.world_size, self.comm.rank)

    def gather(self, x: Tensor, total: int) -> Tensor:
        return self.comm.all_gather_uneven(x, dim=1, sizes=split_sizes(total, self.comm.world_size),
                                           kind="all_gather")


class UlyssesWindowAttention(nn.Module):
    """In place of WindowAttention: q, k, v [B, L_r, H, D] in, [B, L_r, H, D] out."""

    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm
        self.local = WindowAttention()

    @staticmethod
    def received_qkv(rows: Tensor, tokens: int, b: int, hn: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
        """The fused all-to-all's received rows [L, B*3*H/N*D] -> q, k, v [B, L, H/N, D]: views into the rows,
        so q's strides are (3*H/N*D, B*3*H/N*D, D, 1), not those of a [B, L, H/N, D] tensor. The attention
        kernel is chosen on exactly this view (lingbot/runtime/attention.py, `kernel_inputs`)."""
        return rows.view(tokens, b, 3, hn, d).permute(1, 0, 2, 3, 4).unbind(2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv: KVWindowLike, layer: int) -> Tensor:
        n, r = self.comm.world_size, self.comm.rank
        sizes = split_sizes(kv.chunk_tokens, n)                                  # every rank's token count
        b, lr, h, d = q.shape
        hn = h // n
        # 1. fused q/k/v all-to-all: [B, L_r, 3, N, H/N, D] -> rows [N (dest), L_r, B, 3, H/N, D]
        qkv = torch.stack([q, k, v], dim=2).view(b, lr, 3, n, hn, d).permute(3, 1, 0, 2, 4, 5)
        got = self.comm.all_to_all(qkv.reshape(n * lr, -1), [lr] * n, sizes, kind="all_to_all")
        q_all, k_all, v_all = self.received_qkv(got, sum(sizes), b, hn, d)        # [B, L, H/N, D] each
        # 2. attention of every token over the window, for this rank's heads
        out = self.local(q_all, k_all, v_all, kv, layer)                           # [B, L, H/N, D]
        # 3. all-to-all back: rows by token range -> [N (source head group), L_r, B, H/N, D]
        rows = out.transpose(0, 1).reshape(sum(sizes), -1)
        back = self.comm.all_to_all(rows, sizes, [sizes[r]] * n, kind="all_to_all")
        back = back.view(n, sizes[r], b, hn, d).permute(2, 1, 0, 3, 4)             # [B, L_r, N, H/N, D]
        return back.reshape(b, sizes[r], h, d)


def apply_sequence_parallel(model: CausalWanModel, comm: Comm) -> CausalWanModel:
    """Make `model` run Ulysses SP over `comm` (in place; world size 1 leaves it unchanged)."""
    heads = model.config.num_attention_heads
    if heads % comm.world_size:
        raise ConfigError(f"{heads} attention heads do not divide by the sequence-parallel degree "
                          f"{comm.world_size}; use a degree that divides them (e.g. 2, 4, 8 for 40)")
    if comm.world_size == 1:
        return model
    model.token_split = SequenceSplit(comm)
    for block in model.blocks:
        block.self_attn.attn = UlyssesWindowAttention(comm)
    return model
