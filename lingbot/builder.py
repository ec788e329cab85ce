"""Building a pipeline for a preset, in a fixed order: weights (from a diffusers-format folder, or the
preset's seeded random weights), then parallelism (Ulysses DiT, width-sharded decoder) when a `comm` of
more than one rank is given, then the runtime objects that use them.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError, Preset, get_preset, parse_dtype
from .io.weights import (
    build_random_text_encoder,
    build_random_transformer,
    build_random_vae,
    load_text_encoder,
    load_transformer,
    load_vae,
)
from .models.vae import FrameDecoder
from .parallel import Comm, apply_sequence_parallel
from .parallel.pixels import DEFAULT_PIXEL_MODE
from .parallel.vae_shard import shard_decoder
from .runtime.dit_runner import DiTRunner
from .runtime.pipeline import WorldPipeline

log = logging.getLogger(__name__)


def build_dit_runner(preset: str | Preset, model_path: Optional[str | Path] = None, device="cpu",
                     dtype: Optional[torch.dtype] = None, comm: Optional[Comm] = None, **runner_kwargs) -> DiTRunner:
    """A DiT runner for `preset`: weights from `model_path` (a diffusers-format folder), or the preset's
    seeded random weights when it has them (tiny). With `comm` (world size > 1) the DiT runs Ulysses
    sequence parallelism."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    dtype = dtype or preset.torch_dtype
    if model_path is not None:
        root = Path(model_path)
        if not root.is_dir():
            raise FileNotFoundError(f"model path {root} is not a directory")
        model = load_transformer(root / "transformer", dtype=dtype, device=device)
        if model.config != preset.transformer:
            log.warning("%s/transformer/config.json differs from preset %s; using the folder's config",
                        root, preset.name)
        text_encoder = load_text_encoder(root, device=device, max_length=preset.text.max_length)
    else:
        if preset.weights_seed is None:
            raise ConfigError(f"preset {preset.name} has no random weights: give the model folder (--model-path)")
        model = build_random_transformer(preset.transformer, preset.weights_seed, dtype, device)
        text_encoder = build_random_text_encoder(preset.text, preset.weights_seed)
        text_encoder.model.to(device)
    model = apply_sequence_parallel(model, comm or Comm(device=device))
    return DiTRunner(preset, model, text_encoder, device=device, **runner_kwargs)


def build_pipeline(preset: str | Preset, model_path: Optional[str | Path] = None, device="cpu",
                   skip_fixed_point: bool = True, comm: Optional[Comm] = None, pixel_mode: str = DEFAULT_PIXEL_MODE,
                   **runner_kwargs) -> WorldPipeline:
    """DiT runner + VAE: from `model_path` (transformer/, vae/, text_encoder/, tokenizer/) or the preset's
    seeded random weights. With `comm` (world size > 1) the decoder is sharded by width and its frames
    reach the root by `pixel_mode`."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    runner = build_dit_runner(preset, model_path, device=device, comm=comm, **runner_kwargs)
    vae_dtype = parse_dtype(preset.vae_dtype)
    if model_path is not None:
        vae = load_vae(Path(model_path) / "vae", dtype=vae_dtype, device=device)
    else:
        vae = build_random_vae(preset.vae, preset.weights_seed, vae_dtype).to(device)
    decoder = shard_decoder(FrameDecoder(vae), comm or Comm(device=device), preset.latent_hw[1], pixel_mode)
    return WorldPipeline(runner, vae, skip_fixed_point, decoder)
