"""The device check's frame-decoder stage: the tiny decoder (TAEHV taew2_1, lingbot/models/tae.py) at the
preset's size on the device, in the dtype it serves in there (config.tae_dtype: bf16 on accelerators), against
fp32 on the same latents; time per steady chunk, its FLOP rate, peak device memory and its cache per session.
The Wan decoder's figures are the eager_whole stage's decode."""
from __future__ import annotations

import dataclasses
import statistics

import torch

from lingbot.config import tae_dtype
from lingbot.io.weights import build_random_tae
from lingbot.models.vae import CausalCache
from lingbot.runtime.budget import tae_cache_entries
from perf.decode_time import steady_step_flops, time_steps

from .check import Check, _sync


def stage_tiny_decoder(c: Check) -> dict:
    preset = dataclasses.replace(c.preset, weights_seed=c.preset.weights_seed or 0)
    frames = preset.transformer.num_frames_per_block
    dtype = tae_dtype(c.device)
    model = build_random_tae(preset.tae, preset.weights_seed, dtype, c.device)
    times, peak = time_steps(model, preset.latent_hw, frames * (c.steady + 1), c.device)
    chunk_s = frames * statistics.median(times)
    flops = frames * steady_step_flops(preset, "tae")
    # the serving dtype against fp32, two latent frames of one stream (the second reads the first's memory)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 2, *preset.latent_hw, generator=g).to(c.device)
    reference = build_random_tae(preset.tae, preset.weights_seed, torch.float32, c.device)
    served, exact = _second_frame(model, latents), _second_frame(reference, latents)
    _sync(c.device)
    diff = (served - exact).abs()
    return {"dtype": str(dtype).replace("torch.", ""), "size": f"{preset.width}x{preset.height}",
            "chunk_s": chunk_s, "gflop_per_chunk": flops / 1e9, "tflops": flops / chunk_s / 1e12,
            "peak_bytes": peak, "cache_bytes": sum(tae_cache_entries(preset, dtype)),
            "vs_fp32_max_abs": float(diff.max()), "vs_fp32_mean_abs": float(diff.mean())}


@torch.no_grad()
def _second_frame(model, latents: torch.Tensor) -> torch.Tensor:
    cache = CausalCache()
    model.decode(latents[:, :, :1], cache)
    return model.decode(latents[:, :, 1:2], cache)
