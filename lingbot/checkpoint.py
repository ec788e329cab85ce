"""Model folders in the diffusers layout of the real checkpoint, and building an engine from one.

`write_random_checkpoint` writes any preset with seeded random weights in the real on-disk layout
(transformer/, vae/, text_encoder/, tokenizer/, model_index.json), so tests and the embedded default load
the tiny model from disk exactly as real weights are loaded. Nothing here downloads anything.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError, Preset, get_preset, parse_dtype
from .engine import WorldEngine
from .pipeline import WorldPipeline
from .text import TextEncoder, build_random_text_encoder, save_text_encoder
from .vae import build_random_vae, load_vae, save_vae
from .weights import build_random_transformer, load_transformer, save_transformer

log = logging.getLogger(__name__)


def write_random_checkpoint(preset: Preset, folder: str | Path, seed: Optional[int] = None,
                            max_shard_bytes: int = 5 * 2 ** 30) -> Path:
    """Write `preset` with random weights (seed: the preset's weights_seed unless given) to `folder`."""
    seed = preset.weights_seed if seed is None else seed
    if seed is None:
        raise ConfigError(f"preset {preset.name} has real weights; pass a seed to write random ones")
    folder = Path(folder)
    model = build_random_transformer(preset.transformer, seed, preset.torch_dtype)
    save_transformer(model, folder / "transformer", max_shard_bytes)
    save_vae(build_random_vae(preset.vae, seed, parse_dtype(preset.vae_dtype)), folder / "vae")
    save_text_encoder(build_random_text_encoder(preset.text, seed), folder)
    index = {"_class_name": "LingBotWorldPipeline", "lingbot_preset": preset.name,
             "transformer": ["lingbot", "CausalWanModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    log.info("wrote random %s checkpoint (seed %d) to %s", preset.name, seed, folder)
    return folder


def build_engine(preset: str | Preset, model_path: Optional[str | Path] = None, device="cpu",
                 dtype: Optional[torch.dtype] = None, comm=None, **engine_kwargs) -> WorldEngine:
    """An engine for `preset`: weights from `model_path` (a diffusers-format folder), or the preset's
    seeded random weights when it has them (tiny). With `comm` (world size > 1) the DiT is wrapped for
    Ulysses sequence parallelism after it is built."""
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
        text_encoder = TextEncoder.from_folder(root, device=device, max_length=preset.text.max_length)
    else:
        if preset.weights_seed is None:
            raise ConfigError(f"preset {preset.name} has no random weights: give the model folder (--model-path)")
        model = build_random_transformer(preset.transformer, preset.weights_seed, dtype, device)
        text_encoder = build_random_text_encoder(preset.text, preset.weights_seed)
        text_encoder.model.to(device)
    if comm is not None:
        from .parallel import apply_sequence_parallel
        model = apply_sequence_parallel(model, comm)
    return WorldEngine(preset, model, text_encoder, device=device, **engine_kwargs)


def build_pipeline(preset: str | Preset, model_path: Optional[str | Path] = None, device="cpu",
                   skip_fixed_point: bool = True, comm=None, pixel_mode: str = "root_uint8_p2p",
                   **engine_kwargs) -> WorldPipeline:
    """Engine + VAE: from `model_path` (transformer/, vae/, text_encoder/, tokenizer/) or the preset's
    seeded random weights."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    engine = build_engine(preset, model_path, device=device, comm=comm, **engine_kwargs)
    vae_dtype = parse_dtype(preset.vae_dtype)
    if model_path is not None:
        vae = load_vae(Path(model_path) / "vae", dtype=vae_dtype, device=device)
    else:
        vae = build_random_vae(preset.vae, preset.weights_seed, vae_dtype).to(device)
    return WorldPipeline(engine, vae, skip_fixed_point, comm, pixel_mode)
