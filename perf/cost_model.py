"""Analytical FLOPs of one chunk of the causal DiT, from a config alone (multiply-add = 2 FLOPs).

Counted: every matmul, convolution and attention product on the chunk path. A chunk = prepare (camera
tokens and, when cached, the camera modulation) + `steps` probe forwards + 1 commit forward. Text K/V
and the timestep embeddings are computed once per prompt / per engine, so a chunk does not pay them.
Elementwise work (norms, RoPE, modulation) is left out: it is O(L * dim), not O(L * dim^2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lingbot.config import Preset, TransformerConfig, split_sizes
from lingbot.runtime.kv_cache import visible_chunks


@dataclass(frozen=True)
class ChunkFlops:
    prepare: float           # camera tokens (+ camera modulation when cached)
    forward: float           # one DiT forward (probe or commit)
    forwards: int            # probes + commit

    @property
    def total(self) -> float:
        return self.prepare + self.forward * self.forwards


def visible_keys(cfg: TransformerConfig, tokens_per_frame: int, chunk: int,
                 window: Optional[tuple[int, int]] = None) -> int:
    """Keys a forward of `chunk` attends; `window`: a session's own (sink_chunks, window_chunks), None: the model's."""
    sink, size = window or (cfg.sink_chunks, cfg.window_chunks)
    return len(visible_chunks(chunk, sink, size)) * cfg.num_frames_per_block * tokens_per_frame


def dit_chunk_flops(cfg: TransformerConfig, tokens_per_frame: int, chunk: int, steps: int = 4,
                    text_len: int = 512, camera_cached: bool = True,
                    window: Optional[tuple[int, int]] = None) -> ChunkFlops:
    d, ffn = cfg.dim, cfg.ffn_dim
    pixels = cfg.num_frames_per_block * tokens_per_frame * 16 * 16     # 1x2x2 patch of 8x8 unshuffled pixels
    q = cfg.num_frames_per_block * tokens_per_frame            # query tokens of the chunk
    s = visible_keys(cfg, tokens_per_frame, chunk, window)     # keys it attends (incl. itself)
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


def preset_chunk_flops(preset: Preset, chunk: int, camera_cached: bool = True,
                       window: Optional[tuple[int, int]] = None) -> ChunkFlops:
    return dit_chunk_flops(preset.transformer, preset.tokens_per_frame, chunk, len(preset.sampler.timesteps),
                           preset.text.max_length, camera_cached, window)


def sp_dit_bytes_per_chunk(cfg: TransformerConfig, tokens_per_frame: int, world_size: int, rank: int,
                           dtype_bytes: int, steps: int = 4) -> dict[str, int]:
    """Bytes rank `rank` sends per chunk under Ulysses SP-N: per forward and layer one fused q/k/v
    all-to-all (3 * l_r * dim * (N-1)/N) and one back ((L - l_r) * dim / N); per forward one all-gather
    of the head output (the largest share, padded, fp32) to the N-1 others."""
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
    if rank == 0:
        return 0
    shard_w = split_sizes(latent_width, world_size)[rank] * (width // latent_width)
    return frames * height * shard_w * 3


# ---------------------------------------------------------------------------------------------------
# VAE FLOPs (counted by torch's FlopCounterMode on the meta device: shapes only, no weights, exact)
# ---------------------------------------------------------------------------------------------------
def vae_chunk_flops(preset: Preset) -> dict[str, float]:
    """FLOPs of the VAE per chunk: decode (chunk 0 and steady), condition encode (chunk 0 and later)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from lingbot.models.vae import CausalCache, WanVAE
    f = preset.transformer.num_frames_per_block
    lh, lw = preset.latent_hw
    out = {}
    with torch.device("meta"):
        vae = WanVAE(preset.vae)
        for name, fn in [
            ("decode_first", lambda c: vae.decode(torch.zeros(1, 16, f, lh, lw), c)),
            ("decode_steady", lambda c: vae.decode(torch.zeros(1, 16, f, lh, lw), c)),
            ("encode_first", lambda c: vae.encode(torch.zeros(1, 3, 4 * f - 3, preset.height, preset.width), c)),
            ("encode_steady", lambda c: vae.encode(torch.zeros(1, 3, 4 * f, preset.height, preset.width), c)),
        ]:
            if name.endswith("first"):
                cache = CausalCache()
            with FlopCounterMode(display=False) as counter:
                fn(cache)
            out[name] = float(counter.get_total_flops())
    return out


def chunk_flops(preset: Preset, chunk: int, condition_encoded: bool = True) -> dict[str, float]:
    """Every FLOP of one chunk: DiT (prepare + probes + commit), VAE decode, condition encode (0 once the
    encoder's fixed point is reached)."""
    dit = preset_chunk_flops(preset, chunk).total
    vae = vae_chunk_flops(preset)
    decode = vae["decode_first"] if chunk == 0 else vae["decode_steady"]
    encode = 0.0 if not condition_encoded else (vae["encode_first"] if chunk == 0 else vae["encode_steady"])
    return {"dit": dit, "decode": decode, "condition": encode, "total": dit + decode + encode}


def matmul_peak(device: str = "cpu", dtype: str = "float32", n: int = 2048, seconds: float = 2.0) -> float:
    """Measured matmul throughput (FLOP/s) of the device: square n x n matmuls for about `seconds`."""
    import time

    import torch

    from lingbot.config import parse_dtype
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=parse_dtype(dtype))
    b = torch.randn(n, n, device=dev, dtype=parse_dtype(dtype))

    def sync():
        if dev.type != "cpu":
            torch.accelerator.synchronize(dev)
    for _ in range(3):
        a @ b
    sync()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            a @ b
        iters += 4
        sync()
    return 2 * n ** 3 * iters / (time.perf_counter() - start)
