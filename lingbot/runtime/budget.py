"""Per-session memory on one rank, and how many sessions a group admits (docs/architecture.md, "Memory").

Computed before any session is admitted, from the config alone: a session that does not fit is refused,
never half-admitted. The VAE cache sizes come from a decode/encode on the meta device (shapes only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..config import Preset, parse_dtype
from ..models.vae import CausalCache, WanVAE
from .condition import CONDITION_CACHE_CHUNKS, CONDITION_CACHE_IMAGES
from .dit_runner import PROMPT_CACHE_SIZE
from .kv_cache import KVWindow


@dataclass(frozen=True)
class SessionFootprint:
    kv_window: int             # self-attention K/V slab, this rank's heads
    text_kv: int               # cross-attention K/V of one prompt (replicated on every rank)
    camera_modulation: int     # per-chunk camera scale/shift for every layer, this rank's tokens
    decoder_cache: int         # VAE decoder causal-conv cache, this rank's columns
    condition_cache: int       # condition-encoder cache (freed at the fixed point)
    condition_history: int     # the chunk latents kept until the fixed point (for the cross-session cache)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def _vae_cache_bytes(preset: Preset, latent_width: int, dtype: torch.dtype) -> tuple[int, int]:
    lh = preset.latent_hw[0]
    with torch.device("meta"):
        vae = WanVAE(preset.vae).to(dtype)
        decoder, encoder = CausalCache(), CausalCache()
        vae.decode(torch.zeros(1, 16, 1, lh, latent_width), decoder)
        vae.decode(torch.zeros(1, 16, preset.transformer.num_frames_per_block, lh, latent_width), decoder)
        vae.encode(torch.zeros(1, 3, preset.geometry.pixel_frames(0), preset.height, preset.width), encoder)
    return decoder.nbytes(), encoder.nbytes()


def session_footprint(preset: Preset, world_size: int = 1) -> SessionFootprint:
    cfg = preset.transformer
    dtype = preset.torch_dtype
    esize = torch.empty((), dtype=dtype).element_size()
    heads = cfg.num_attention_heads // world_size
    tokens = cfg.num_frames_per_block * preset.tokens_per_frame
    kv = KVWindow.nbytes_for(cfg, preset.tokens_per_frame, heads, dtype)
    text = (2 * cfg.num_layers * cfg.dim + cfg.text_dim) * preset.text.max_length * esize    # K/V + embedding
    camera = 2 * cfg.num_layers * math.ceil(tokens / world_size) * cfg.dim * esize
    decoder, condition = _vae_cache_bytes(preset, math.ceil(preset.latent_hw[1] / world_size),
                                          parse_dtype(preset.vae_dtype))
    history = CONDITION_CACHE_CHUNKS * condition_chunk_bytes(preset)
    return SessionFootprint(kv, text, camera, decoder, condition, history)


@dataclass(frozen=True)
class SnapshotFootprint:
    """What keeping a session resumable costs on one rank, in host memory (the object store): per chunk a
    snapshot of its K/V slot and of the session's state after it; a session keeps `kept` slots (the chunks
    a continuation attends) and the newest state."""
    kv_slot: int               # one chunk's K/V slot, this rank's heads
    state: int                 # decoder cache, text embedding, condition latents, RNG (per snapshot)
    kept: int

    @property
    def per_chunk(self) -> int:
        """Bytes copied off the device after every chunk."""
        return self.kv_slot + self.state

    @property
    def held(self) -> int:
        """Bytes held per session (one more state while the next chunk's snapshot is on its way)."""
        return self.kept * self.kv_slot + self.state


def snapshot_footprint(preset: Preset, world_size: int = 1) -> SnapshotFootprint:
    cfg = preset.transformer
    esize = torch.empty((), dtype=preset.torch_dtype).element_size()
    footprint = session_footprint(preset, world_size)
    slot = footprint.kv_window // cfg.window_chunks
    # the condition: its fixed point, or up to CONDITION_CACHE_CHUNKS replayed chunks of a first frame seen before
    state = footprint.decoder_cache + cfg.text_dim * preset.text.max_length * esize \
        + CONDITION_CACHE_CHUNKS * condition_chunk_bytes(preset)
    return SnapshotFootprint(slot, state, cfg.window_chunks - 1)


def condition_chunk_bytes(preset: Preset) -> int:
    """One chunk's condition latents: [16, F, h, w] float32."""
    lh, lw = preset.latent_hw
    return preset.vae.z_dim * preset.transformer.num_frames_per_block * lh * lw * 4


def prompt_cache_bytes(preset: Preset, prompts: int = PROMPT_CACHE_SIZE) -> int:
    """A runner's prompt LRU at its full size (+2: a prompt transition's start and blend): per prompt the
    K/V of every layer and the encoder output they came from."""
    cfg = preset.transformer
    esize = torch.empty((), dtype=preset.torch_dtype).element_size()
    per_prompt = (2 * cfg.num_layers * cfg.dim + cfg.text_dim) * preset.text.max_length * esize
    return (prompts + 2) * per_prompt


def shared_cache_bytes(preset: Preset) -> int:
    """What the sessions of a rank share, at full size: the prompt LRU and the first-frame condition LRU."""
    return prompt_cache_bytes(preset) + CONDITION_CACHE_IMAGES * CONDITION_CACHE_CHUNKS * condition_chunk_bytes(preset)


def group_capacity(budget_bytes: int, footprint: SessionFootprint, max_sessions: int) -> int:
    """Sessions that fit in `budget_bytes` (what is left on one rank after weights and activations),
    capped at max_sessions."""
    return max(0, min(max_sessions, budget_bytes // footprint.total))


def sessions_that_fit(preset: Preset, world_size: int, budget_bytes: int, max_sessions: int) -> int:
    """Sessions one group admits: what is left of a rank's budget after the shared caches, per session."""
    return group_capacity(budget_bytes - shared_cache_bytes(preset), session_footprint(preset, world_size),
                          max_sessions)
