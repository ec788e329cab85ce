"""Analytical FLOPs of one chunk of the causal DiT, from a config alone (multiply-add = 2 FLOPs).

Counted: every matmul, convolution and attention product on the chunk path. A chunk = prepare (camera
tokens and, when cached, the camera modulation) + `steps` probe forwards + 1 commit forward. Text K/V
and the timestep embeddings are computed once per prompt / per engine, so a chunk does not pay them.
Elementwise work (norms, RoPE, modulation) is left out: it is O(L * dim), not O(L * dim^2).
"""
from __future__ import annotations

from dataclasses import dataclass

from lingbot.config import Preset, TransformerConfig
from lingbot.kv_cache import visible_chunks


@dataclass(frozen=True)
class ChunkFlops:
    prepare: float           # camera tokens (+ camera modulation when cached)
    forward: float           # one DiT forward (probe or commit)
    forwards: int            # probes + commit

    @property
    def total(self) -> float:
        return self.prepare + self.forward * self.forwards


def visible_keys(cfg: TransformerConfig, tokens_per_frame: int, chunk: int) -> int:
    return len(visible_chunks(chunk, cfg.sink_chunks, cfg.window_chunks)) * cfg.num_frames_per_block * tokens_per_frame


def dit_chunk_flops(cfg: TransformerConfig, tokens_per_frame: int, chunk: int, steps: int = 4,
                    text_len: int = 512, camera_cached: bool = True) -> ChunkFlops:
    d, ffn = cfg.dim, cfg.ffn_dim
    pixels = cfg.num_frames_per_block * tokens_per_frame * 16 * 16     # 1x2x2 patch of 8x8 unshuffled pixels
    q = cfg.num_frames_per_block * tokens_per_frame            # query tokens of the chunk
    s = visible_keys(cfg, tokens_per_frame, chunk)             # keys it attends (incl. itself)
    patch = cfg.in_channels * 4                                # Conv3d 36 -> dim over a 1x2x2 patch
    out = cfg.out_channels * 4
    rays = 2 * 9 * pixels                                      # a 3x3 rotation of every pixel's direction
    camera_tokens = rays + 2 * q * cfg.camera_in_features * d + 2 * (2 * q * d * d)
    camera_modulation = cfg.num_layers * 4 * (2 * q * d * d)   # injector L1, L2, scale, shift
    per_layer = (
        4 * (2 * q * d * d)          # self-attention q, k, v, o
        + 2 * (2 * q * s * d)        # scores and weighted values over the window
        + 2 * (2 * q * d * d)        # cross-attention q, o (text K/V cached per prompt)
        + 2 * (2 * q * text_len * d)  # cross-attention scores and values
        + 2 * (2 * q * d * ffn))     # feed-forward
    forward = 2 * q * patch * d + cfg.num_layers * per_layer + 2 * q * d * out
    if camera_cached:
        return ChunkFlops(camera_tokens + camera_modulation, forward, steps + 1)
    return ChunkFlops(camera_tokens, forward + camera_modulation, steps + 1)


def preset_chunk_flops(preset: Preset, chunk: int, camera_cached: bool = True) -> ChunkFlops:
    return dit_chunk_flops(preset.transformer, preset.tokens_per_frame, chunk, len(preset.sampler.timesteps),
                           preset.text.max_length, camera_cached)


def sp_dit_bytes_per_chunk(cfg: TransformerConfig, tokens_per_frame: int, world_size: int, rank: int,
                           dtype_bytes: int, steps: int = 4) -> dict[str, int]:
    """Bytes rank `rank` sends per chunk under Ulysses SP-N: per forward and layer one fused q/k/v
    all-to-all (3 * l_r * dim * (N-1)/N) and one back ((L - l_r) * dim / N); per forward one all-gather
    of the head output (the largest share, padded, fp32) to the N-1 others."""
    from lingbot.parallel.comm import split_sizes
    total = cfg.num_frames_per_block * tokens_per_frame
    sizes = split_sizes(total, world_size)
    local, n = sizes[rank], world_size
    head_dim_share = cfg.dim // n
    forwards = steps + 1
    qkv = 3 * local * head_dim_share * (n - 1) * dtype_bytes
    back = (total - local) * head_dim_share * dtype_bytes
    head = max(sizes) * cfg.out_channels * 4 * 4 * (n - 1)            # [L_r, 64] fp32 to every other rank
    return {"all_to_all": forwards * cfg.num_layers * (qkv + back), "all_gather": forwards * head}


def sp_pixel_bytes_per_chunk(height: int, width: int, frames: int, latent_width: int, world_size: int,
                             rank: int) -> int:
    """root_uint8_p2p: every non-root rank sends its uint8 width shard [F, H, W_r, 3] to rank 0."""
    from lingbot.parallel.comm import split_sizes
    if rank == 0:
        return 0
    shard_w = split_sizes(latent_width, world_size)[rank] * (width // latent_width)
    return frames * height * shard_w * 3
