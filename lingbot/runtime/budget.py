"""Per-session memory on one rank, and how many sessions a group admits (docs/architecture.md, "Memory").

Computed before any session is admitted, from the config alone: a session that does not fit is refused,
never half-admitted. The VAE cache sizes come from a decode/encode on the meta device (shapes only).

Two kinds of bytes: what each session holds between its chunks (`SessionFootprint`, counted per session)
and what a rank holds once whatever its number of sessions (`RankFootprint`): the shared caches, the
transient memory of the one chunk that runs at a time (chunks of a group run one after another), and
the CUDA graphs' static input buffers (one set of graphs serves every session). What the sessions'
snapshots cost on the host is snapshot_budget.py's.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from ..config import Preset, parse_dtype, split_sizes, tae_dtype
from ..models.tae import TinyDecoder
from ..models.vae import CausalCache, CausalConv3d, WanVAE
from .condition import CONDITION_CACHE_CHUNKS, CONDITION_CACHE_IMAGES
from .dit_runner import PROMPT_CACHE_SIZE
from .kv_cache import KVWindow

CPU_BUDGET_BYTES = 2 ** 30      # the budget rule on CPU when none is configured


@dataclass(frozen=True)
class SessionFootprint:
    """What one session holds on a rank between its chunks."""
    kv_window: int             # self-attention K/V slab, this rank's heads
    text_kv: int               # cross-attention K/V of one prompt (replicated on every rank)
    decoder_cache: int         # frame-decoder cache: the Wan decoder's (this rank's columns) or the tiny one's
    condition_cache: int       # condition-encoder cache (freed at the fixed point)
    condition_history: int     # the chunk latents kept until the fixed point (for the cross-session cache)
    latent_ring: int = 0       # the last chunks' latents a session that may switch decoders keeps (decoding.py)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def vae_cache_entries(preset: Preset, world_size: int = 1, rank: int = 0) -> tuple[list[int], list[int]]:
    """The bytes of each entry of a session's VAE decoder cache on `rank` (its columns of the latent width)
    and of the condition encoder's (whole width: rank 0 runs it), after a chunk: a decode and an encode on
    the meta device (shapes only). Under SP each 3x3 causal conv of the decoder caches its input with the
    halo and the zero rows it was assembled with (lingbot/parallel/vae_shard.py): 2 rows and 2 columns
    more than its share."""
    width = split_sizes(preset.latent_hw[1], world_size)[rank]
    decoded, encoded = _vae_cache_entries(preset, width, world_size > 1)
    return list(decoded), list(encoded)


@functools.lru_cache(maxsize=64)            # a fact of the preset and the columns; a meta run costs ~0.6 s on CPU
def _vae_cache_entries(preset: Preset, width: int, sharded: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lh, _ = preset.latent_hw
    with torch.device("meta"):
        vae = WanVAE(preset.vae).to(parse_dtype(preset.vae_dtype))
        decoder, encoder = CausalCache(), CausalCache()
        vae.decode(torch.zeros(1, 16, 1, lh, width), decoder)
        vae.decode(torch.zeros(1, 16, preset.transformer.num_frames_per_block, lh, width), decoder)
        vae.encode(torch.zeros(1, 3, preset.geometry.pixel_frames(0), preset.height, preset.width), encoder)
    halo = {f"decoder.{name}": m.space_pad for name, m in vae.decoder.named_modules()
            if sharded and isinstance(m, CausalConv3d) and m.space_pad[0] > 0}
    decoded = []
    for key, t in decoder.entries.items():
        shape = list(t.shape)                                     # [1, C, frames, H, W]
        if key in halo:
            pad_w, _, pad_h, _ = halo[key]
            shape[-2:] = shape[-2] + 2 * pad_h, shape[-1] + 2 * pad_w
        decoded.append(math.prod(shape) * t.element_size())
    return tuple(decoded), tuple(t.numel() * t.element_size() for t in encoder.entries.values())


def _vae_cache_bytes(preset: Preset, world_size: int = 1) -> tuple[int, int]:
    decoder, encoder = vae_cache_entries(preset, world_size)
    return sum(decoder), sum(encoder)


def tae_cache_entries(preset: Preset, dtype: torch.dtype) -> list[int]:
    """The bytes of each entry of the tiny decoder's cache: one frame per memory block at its stage's size,
    whole width (it runs on the root alone under SP, lingbot/parallel/root_decode.py); full after the first
    latent frame."""
    lh, lw = preset.latent_hw
    with torch.device("meta"):
        tae = TinyDecoder(preset.tae).to(dtype)
        cache = CausalCache()
        tae.decode(torch.zeros(1, preset.tae.latent_channels, 1, lh, lw), cache)
    return [t.numel() * t.element_size() for t in cache.entries.values()]


def _tae_cache_bytes(preset: Preset, dtype: torch.dtype) -> int:
    return sum(tae_cache_entries(preset, dtype))


@functools.lru_cache(maxsize=16)
def latent_ring_chunks(preset: Preset, decoders: Sequence[str] = ("wan",)) -> int:
    """The chunks of latents a session keeps to warm a decoder it switches to (lingbot/runtime/decoding.py):
    with both decoders loaded (a session may switch between them: the quality ladder's decoder rungs), enough
    for the deeper one's history (13 chunks for the Wan decoder's 38 latent frames); else none."""
    if not {"wan", "tae"} <= set(decoders):
        return 0
    with torch.device("meta"):
        frames = max(WanVAE(preset.vae).history_frames(), TinyDecoder(preset.tae).history_frames())
    return math.ceil(frames / preset.transformer.num_frames_per_block)


def latent_ring_entries(preset: Preset, decoders: Sequence[str] = ("wan",)) -> tuple[int, ...]:
    """The bytes of each entry of that ring: a chunk's latents [16, F, h, w] float32 (a condition chunk's shape)."""
    return (condition_chunk_bytes(preset),) * latent_ring_chunks(preset, tuple(decoders))


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rank_tokens(preset: Preset, world_size: int = 1) -> int:
    """A chunk's tokens on the rank with the most of them (rank 0 under Ulysses' uneven split)."""
    return math.ceil(preset.transformer.num_frames_per_block * preset.tokens_per_frame / world_size)


def session_footprint(preset: Preset, world_size: int = 1, decoders: Sequence[str] = ("wan",),
                      device: torch.device | str = "cpu") -> SessionFootprint:
    """`decoders`: the frame decoders the pipeline loaded; a session may pick any, so the largest cache is
    counted. `device`: where the ranks run (the tiny decoder's dtype depends on it, config.tae_dtype)."""
    cfg = preset.transformer
    dtype = preset.torch_dtype
    esize = _esize(dtype)
    heads = cfg.num_attention_heads // world_size
    kv = KVWindow.nbytes_for(cfg, preset.tokens_per_frame, heads, dtype)
    text = (2 * cfg.num_layers * cfg.dim + cfg.text_dim) * preset.text.max_length * esize    # K/V + embedding
    wan, condition = _vae_cache_bytes(preset, world_size)
    decoder = max(wan if name == "wan" else _tae_cache_bytes(preset, tae_dtype(device)) for name in decoders)
    history = CONDITION_CACHE_CHUNKS * condition_chunk_bytes(preset)
    ring = sum(latent_ring_entries(preset, decoders))
    # the condition encoder's cache is on rank 0 only under SP (lingbot/parallel/condition.py): counted on
    # every rank, since the group admits what its fullest rank holds
    return SessionFootprint(kv, text, decoder, condition, history, ring)


@dataclass(frozen=True)
class RankFootprint:
    """What a rank holds once, whatever its number of sessions."""
    prompt_cache: int          # the runner's prompt LRU at its full size
    condition_cache: int       # the first-frame condition LRU at its full size
    chunk_camera_modulation: int    # the running chunk's camera scale/shift for every layer, this rank's tokens
    graph_static: int          # CUDA graphs' static input buffers (0 without graphs)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def chunk_camera_modulation_bytes(preset: Preset, world_size: int = 1) -> int:
    """The camera modulation a chunk computes once and its five forwards reuse: (scale, shift) [1, L_r, dim]
    per layer in the model's dtype (3.6 GiB at 14B dims on one device). Made when a chunk starts and
    dropped when it ends: the group runs one chunk at a time, so a rank needs it once, not per session."""
    cfg = preset.transformer
    return 2 * cfg.num_layers * rank_tokens(preset, world_size) * cfg.dim * _esize(preset.torch_dtype)


def graph_static_bytes(preset: Preset, world_size: int = 1) -> int:
    """The static input buffers of the DiT's CUDA graphs (lingbot/runtime/compile.py, graphs=True).

    CUDA graph trees record each call of a compiled region as one graph (per forward: 2 regions x layers;
    every forward replays the same ones) and give it its own copy of every tensor input that is neither a
    parameter nor the output of an earlier graph of the tree; each replay copies the inputs into them. Per
    layer and rank (L_r tokens, T text tokens, fp32 where the model keeps the residual stream):
    - attention_inputs: RoPE cos and sin [L_r, D/2] fp32, the time projection [1, 6, dim] fp32;
    - attention_output: the window attention's output y [1, L_r, H, D] (eager, between the regions), the
      time projection again, the prompt's K and V [1, H, T, D] (all heads: text K/V is replicated), the
      camera scale and shift [1, L_r, dim];
    and in the first layer both regions take the residual stream x [1, L_r, dim] fp32 from eager code
    (later layers take the previous graph's output). About 6.0 GiB at 14B dims on one device, mostly the
    camera modulation (a second copy of it) and y."""
    cfg = preset.transformer
    esize = _esize(preset.torch_dtype)
    tokens, dim, text = rank_tokens(preset, world_size), cfg.dim, preset.text.max_length
    rope = 2 * tokens * (cfg.attention_head_dim // 2) * 4
    time = 6 * dim * 4
    per_layer = (rope + time) + (tokens * dim * esize + time + 2 * text * dim * esize + 2 * tokens * dim * esize)
    return cfg.num_layers * per_layer + 2 * tokens * dim * 4


def rank_footprint(preset: Preset, world_size: int = 1, cuda_graphs: bool = False) -> RankFootprint:
    return RankFootprint(prompt_cache_bytes(preset),
                         CONDITION_CACHE_IMAGES * CONDITION_CACHE_CHUNKS * condition_chunk_bytes(preset),
                         chunk_camera_modulation_bytes(preset, world_size),
                         graph_static_bytes(preset, world_size) if cuda_graphs else 0)


def condition_chunk_bytes(preset: Preset) -> int:
    """One chunk's condition latents: [16, F, h, w] float32."""
    lh, lw = preset.latent_hw
    return preset.vae.z_dim * preset.transformer.num_frames_per_block * lh * lw * 4


def prompt_cache_bytes(preset: Preset, prompts: int = PROMPT_CACHE_SIZE) -> int:
    """A runner's prompt LRU at its full size (+2: a prompt transition's start and blend): per prompt the
    K/V of every layer and the encoder output they came from."""
    cfg = preset.transformer
    esize = _esize(preset.torch_dtype)
    per_prompt = (2 * cfg.num_layers * cfg.dim + cfg.text_dim) * preset.text.max_length * esize
    return (prompts + 2) * per_prompt


def shared_cache_bytes(preset: Preset) -> int:
    """What the sessions of a rank share, at full size: the prompt LRU and the first-frame condition LRU."""
    footprint = rank_footprint(preset)
    return footprint.prompt_cache + footprint.condition_cache


def group_capacity(budget_bytes: int, footprint: SessionFootprint, max_sessions: int) -> int:
    """Sessions that fit in `budget_bytes` (what is left on one rank after weights, activations and what
    the rank holds once), capped at max_sessions."""
    return max(0, min(max_sessions, budget_bytes // footprint.total))


def sessions_that_fit(preset: Preset, world_size: int, budget_bytes: int, max_sessions: int,
                      cuda_graphs: bool = False, decoders: Sequence[str] = ("wan",),
                      device: torch.device | str = "cpu") -> int:
    """Sessions one group admits: what is left of a rank's budget after what the rank holds once (shared
    caches, the running chunk's camera modulation, the graphs' static buffers), per session."""
    held_once = rank_footprint(preset, world_size, cuda_graphs).total
    return group_capacity(budget_bytes - held_once, session_footprint(preset, world_size, decoders, device),
                          max_sessions)
