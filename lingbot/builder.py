"""Building a pipeline for a preset, in a fixed order: weights (from a diffusers-format folder, or the
preset's seeded random weights), then parallelism (Ulysses DiT, width-sharded Wan decoder, the tiny decoder
on the root) when a `comm` of more than one rank is given, then the runtime objects that use them.

Frame decoders: "wan" (the Wan VAE's decoder, the reference) and "tae" (the tiny autoencoder for the same
latents, approximate, 25x fewer FLOPs per chunk; lingbot/models/tae.py). A pipeline loads one or both; its
sessions pick among the loaded ones (WorldPipeline.new_session(decoder=...)).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from .config import DECODERS, ConfigError, Preset, get_preset, parse_dtype, tae_dtype, with_dtype
from .io.weights import (
    WeightsError,
    build_random_tae,
    build_random_text_encoder,
    build_random_transformer,
    build_random_vae,
    load_tae,
    load_text_encoder,
    load_transformer,
    load_vae,
    read_flow_shift,
    read_tae_config,
)
from .models.tae import TinyDecoder, TinyFrameDecoder
from .models.vae import FrameDecoder, WanVAE
from .parallel import Comm, apply_sequence_parallel
from .parallel.condition import share_condition_encoder
from .parallel.pixels import DEFAULT_PIXEL_MODE
from .parallel.root_decode import root_decoder
from .parallel.text import share_text_encoder
from .parallel.vae_shard import shard_decoder
from .runtime.compile import compile_blocks, compile_default
from .runtime.condition import ChunkEncoder
from .runtime.dit_runner import DiTRunner
from .runtime.pipeline import ChunkDecoder, WorldPipeline

log = logging.getLogger(__name__)

TAE_WEIGHTS_NEEDED = ("the tiny decoder needs its weights with a real model: give tae_path (--tae-path), taew2_1.pth "
                      "or safetensors/taew2_1.safetensors of github.com/madebyollin/taehv")


def with_checkpoint_shift(preset: Preset, model_path: str | Path) -> Preset:
    """The preset with its flow shift taken from the folder's scheduler config, where it has one (a
    request's flow_shift still wins over both)."""
    shift = read_flow_shift(model_path)
    if shift is None or shift == preset.sampler.shift:
        return preset
    log.info("flow shift %g from %s/scheduler (preset %s has %g)", shift, model_path, preset.name,
             preset.sampler.shift)
    return dataclasses.replace(preset, sampler=dataclasses.replace(preset.sampler, shift=shift))


def with_tae_file(preset: Preset, tae_path: str | Path) -> Preset:
    """The preset with its tiny decoder's widths read from the file at `tae_path` (the published taew2_1's
    or a random preset's, whatever the preset), so the decoder loads strictly at the file's widths and the
    budget counts the decoder that runs."""
    tae = read_tae_config(tae_path)
    if tae.latent_channels != preset.vae.z_dim:
        raise WeightsError(f"tiny decoder file {tae_path} decodes {tae.latent_channels} latent channels; the VAE of "
                           f"preset {preset.name} makes {preset.vae.z_dim} (a taew2_1 file is for Wan 2.1 latents)")
    if tae == preset.tae:
        return preset
    log.info("tiny decoder widths %s from %s (preset %s has %s)", list(tae.channels), tae_path, preset.name,
             list(preset.tae.channels))
    return dataclasses.replace(preset, tae=tae)


def build_dit_runner(preset: str | Preset, model_path: Optional[str | Path] = None, device="cpu",
                     dtype: Optional[str | torch.dtype] = None, comm: Optional[Comm] = None,
                     compile: Optional[bool] = None, cuda_graphs: bool = False, text_encoder: bool = True,
                     seed: Optional[int] = None, **runner_kwargs) -> DiTRunner:
    """A DiT runner for `preset`: weights from `model_path` (a diffusers-format folder), or seeded random
    weights (`seed`, default the preset's own; presets of real checkpoints need one). With `comm` (world
    size > 1) the DiT runs Ulysses sequence parallelism and only rank 0 holds the text encoder.
    `compile`: regional torch.compile of the blocks (None: on accelerators only); `cuda_graphs`: the
    compiled regions as CUDA graphs (implies compile). `text_encoder=False` builds none: sessions then take
    ready text embeddings. `dtype` overrides the preset's DiT dtype (config.with_dtype: the DiT and the text
    encoder; the runner's preset says it, so the budget counts it)."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    if model_path is not None:
        preset = with_checkpoint_shift(preset, model_path)
    preset = with_dtype(preset, dtype)
    dtype = preset.torch_dtype
    comm = comm or Comm(device=device)
    load_encoder = text_encoder and comm.is_root
    encoder = None
    if model_path is not None:
        root = Path(model_path)
        if not root.is_dir():
            raise FileNotFoundError(f"model path {root} is not a directory")
        model = load_transformer(root / "transformer", dtype=dtype, device=device)
        if model.config != preset.transformer:
            log.warning("%s/transformer/config.json differs from preset %s; using the folder's config",
                        root, preset.name)
        if load_encoder:
            encoder = load_text_encoder(root, device=device, dtype=dtype, max_length=preset.text.max_length)
    else:
        seed = preset.weights_seed if seed is None else seed
        if seed is None:
            raise ConfigError(f"preset {preset.name} has no random weights: give the model folder (--model-path)")
        model = build_random_transformer(preset.transformer, seed, dtype, device)
        if load_encoder:                               # on the device in the DiT's dtype, as a loaded one
            encoder = build_random_text_encoder(preset.text, seed, dtype, device)
    if text_encoder:
        encoder = share_text_encoder(encoder, comm, preset.text.max_length, model.config.text_dim, model.dtype,
                                     device)
    model = apply_sequence_parallel(model, comm)
    if compile is None:
        compile = compile_default(device)
    if compile or cuda_graphs:
        compile_blocks(model, graphs=cuda_graphs)
    return DiTRunner(preset, model, encoder, device=device, **runner_kwargs)


def decoder_names(decoder: str | Sequence[str]) -> tuple[str, ...]:
    """A decoder setting ("wan", "tae", or several names, the first the default) as a tuple of names."""
    names = (decoder,) if isinstance(decoder, str) else tuple(decoder)
    unknown = [n for n in names if n not in DECODERS]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(f"decoder {decoder!r}: give one or more distinct names of {list(DECODERS)}")
    return names


def build_tiny_decoder(preset: Preset, tae_path: Optional[str | Path], device="cpu", seed: Optional[int] = None,
                       random_weights: bool = True) -> TinyDecoder:
    """The tiny decoder of `preset` in its dtype for `device` (config.tae_dtype): from `tae_path` (the
    published taew2_1.pth or taew2_1.safetensors), held strictly to the preset's widths (with_tae_file gives
    the preset the file's), or with seeded random weights where the rest of the model is random too
    (`random_weights`; `seed` default the preset's)."""
    dtype = tae_dtype(device)
    if tae_path is not None:
        return load_tae(tae_path, preset.tae, dtype, device)
    seed = preset.weights_seed if seed is None else seed
    if not random_weights or seed is None:
        raise ConfigError(TAE_WEIGHTS_NEEDED)
    return build_random_tae(preset.tae, seed, dtype, device)


def build_decoders(preset: Preset, names: Sequence[str], vae: WanVAE, comm: Comm, pixel_mode: str,
                   tae_path: Optional[str | Path] = None, device="cpu", seed: Optional[int] = None,
                   random_weights: bool = True) -> dict[str, ChunkDecoder]:
    """The frame decoders `names` for this rank of `comm`'s group: the Wan decoder width-sharded (pixels to
    the root by `pixel_mode`), the tiny decoder on the root alone (lingbot/parallel/root_decode.py)."""
    decoders: dict[str, ChunkDecoder] = {}
    for name in names:
        if name == "wan":
            decoders[name] = shard_decoder(FrameDecoder(vae), comm, preset.latent_hw[1], pixel_mode)
        else:
            tae = build_tiny_decoder(preset, tae_path, device, seed, random_weights)
            decoders[name] = root_decoder(TinyFrameDecoder(tae), comm, pixel_mode)
    return decoders


def build_frame_decoder(preset: str | Preset, decoder: str = "wan", model_path: Optional[str | Path] = None,
                        tae_path: Optional[str | Path] = None, device="cpu",
                        seed: Optional[int] = None) -> ChunkDecoder:
    """One frame decoder alone, on one device, without the DiT (`lingbot decode`): the Wan decoder of
    `model_path`/vae or of the preset's random VAE; the tiny decoder from `tae_path` or, for a random-weight
    preset (or an explicit `seed`), random."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    (name,) = decoder_names(decoder)
    if name == "tae":
        if tae_path is not None:
            preset = with_tae_file(preset, tae_path)
        return TinyFrameDecoder(build_tiny_decoder(preset, tae_path, device, seed,
                                                   preset.weights_seed is not None or seed is not None))
    vae_dtype = parse_dtype(preset.vae_dtype)
    if model_path is not None:
        return FrameDecoder(load_vae(Path(model_path) / "vae", dtype=vae_dtype, device=device))
    seed = preset.weights_seed if seed is None else seed
    if seed is None:
        raise ConfigError(f"preset {preset.name} has no random weights: give the model folder (--model-path)")
    return FrameDecoder(build_random_vae(preset.vae, seed, vae_dtype).to(device))


def build_pipeline(preset: str | Preset, model_path: Optional[str | Path] = None, device="cpu",
                   skip_fixed_point: bool = True, comm: Optional[Comm] = None, pixel_mode: str = DEFAULT_PIXEL_MODE,
                   compile: Optional[bool] = None, cuda_graphs: bool = False, seed: Optional[int] = None,
                   dtype: Optional[str | torch.dtype] = None, decoder: str | Sequence[str] = "wan",
                   tae_path: Optional[str | Path] = None, **runner_kwargs) -> WorldPipeline:
    """DiT runner + VAE: from `model_path` (transformer/, vae/, text_encoder/, tokenizer/) or seeded random
    weights (see build_dit_runner). With `comm` (world size > 1) the Wan decoder is sharded by width and its
    frames reach the root by `pixel_mode`, the tiny decoder runs on the root, and the condition encoder runs
    on rank 0 only (broadcast). `dtype` overrides the preset's DiT dtype (DiT and text encoder); the VAE
    keeps the preset's `vae_dtype` (config.with_dtype). `decoder`: "wan", "tae" or both (a sequence, the
    first the sessions' default); `tae_path`: the tiny decoder's weights file, needed with a real model
    (random-weight presets get seeded random ones without it)."""
    preset = with_dtype(get_preset(preset) if isinstance(preset, str) else preset, dtype)
    names = decoder_names(decoder)
    random_weights = model_path is None or preset.weights_seed is not None
    if "tae" in names:                                                       # before loading GiBs
        if tae_path is None and not random_weights:
            raise ConfigError(TAE_WEIGHTS_NEEDED)
        if tae_path is not None and not Path(tae_path).is_file():
            raise FileNotFoundError(f"tiny decoder weights {tae_path} do not exist")
        if tae_path is not None:
            preset = with_tae_file(preset, tae_path)
    comm = comm or Comm(device=device)
    runner = build_dit_runner(preset, model_path, device=device, comm=comm, compile=compile,
                              cuda_graphs=cuda_graphs, seed=seed, **runner_kwargs)
    vae_dtype = parse_dtype(preset.vae_dtype)
    if model_path is not None:
        vae = load_vae(Path(model_path) / "vae", dtype=vae_dtype, device=device)
    else:
        seed = preset.weights_seed if seed is None else seed
        vae = build_random_vae(preset.vae, seed, vae_dtype).to(device)
    decoders = build_decoders(preset, names, vae, comm, pixel_mode, tae_path, device, seed, random_weights)
    condition = share_condition_encoder(ChunkEncoder(vae), comm,
                                        (preset.vae.z_dim, preset.transformer.num_frames_per_block, *preset.latent_hw))
    return WorldPipeline(runner, vae, skip_fixed_point, condition_encoder=condition, decoders=decoders)
