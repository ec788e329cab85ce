"""The device check's stages about the VAE's precision and the tiny decoder.

tiny_decoder: the tiny decoder (TAEHV taew2_1, lingbot/models/tae.py) at the preset's size on the device,
in the dtype it serves in there (config.tae_dtype: bf16 on accelerators), against IEEE float32 on the same
latents; time per steady chunk, its FLOP rate, what it adds to the device's peak memory and its cache per
session. The Wan decoder's figures are the eager_whole stage's decode.

tf32: what serving's float32 is on CUDA. Serving sets no TF32 flag, so cuDNN runs the VAE's float32
convolutions (the condition encoder's and the Wan decoder's) in TF32. The condition encoder stays float32
because bf16 was about 3x outside the rounding a bf16 DiT applies to the condition at its input (perf/
README.md, "condition encoder's dtype", measured on CPU, where float32 is IEEE): here TF32 against IEEE on
the same first frame, measured the same way, against that rounding; and the Wan decoder's frames, TF32
against IEEE, in 8-bit levels."""
from __future__ import annotations

import dataclasses
import statistics

import torch

from lingbot.config import tae_dtype
from lingbot.io.images import model_image
from lingbot.io.weights import build_random_tae
from lingbot.models.vae import CausalCache
from lingbot.runtime.budget import tae_cache_entries
from lingbot.runtime.condition import CausalConditionEncoder
from perf.decode_time import steady_step_flops, time_steps
from perf.timing import sync

from .check import IEEE_FLOAT32, Check, _allocated, flags_set


def stage_tiny_decoder(c: Check) -> None:
    preset = dataclasses.replace(c.preset, weights_seed=c.preset.weights_seed or 0)
    frames = preset.transformer.num_frames_per_block
    dtype = tae_dtype(c.device)
    before = _allocated(c.device)                   # the pipeline's and the sessions' own: not the decoder's
    model = build_random_tae(preset.tae, preset.weights_seed, dtype, c.device)
    times, peak = time_steps(model, preset.latent_hw, frames * (c.steady + 1), c.device)
    chunk_s = frames * statistics.median(times)
    flops = frames * steady_step_flops(preset, "tae")
    c.keep(dtype=str(dtype).replace("torch.", ""), size=f"{preset.width}x{preset.height}", chunk_s=chunk_s,
           gflop_per_chunk=flops / 1e9, tflops=flops / chunk_s / 1e12,
           peak_growth_bytes=None if before is None else peak - before,     # weights, cache, activations
           cache_bytes=sum(tae_cache_entries(preset, dtype)))
    # the serving dtype against IEEE float32, two latent frames of one stream (the second reads the first's memory)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, 2, *preset.latent_hw, generator=g).to(c.device)
    reference = build_random_tae(preset.tae, preset.weights_seed, torch.float32, c.device)
    served = _second_frame(model, latents)
    with flags_set(IEEE_FLOAT32):
        exact = _second_frame(reference, latents)
    sync(c.device)
    diff = (served - exact).abs()
    c.keep(vs_fp32_max_abs=float(diff.max()), vs_fp32_mean_abs=float(diff.mean()))


@torch.no_grad()
def _second_frame(model, latents: torch.Tensor) -> torch.Tensor:
    cache = CausalCache()
    model.decode(latents[:, :, :1], cache)
    return model.decode(latents[:, :, 1:2], cache)


def _relative(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |diff| / max |ref|, rms diff / rms ref), as the bf16 condition encoder was judged (perf/README.md)."""
    diff = (got - ref).double()
    ref = ref.double()
    return (diff.abs().max() / ref.abs().max()).item(), (diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def _conditions(c: Check, chunks: int) -> torch.Tensor:
    """The condition encoder's first `chunks` chunks of the check's first frame, encoded (no shared cache):
    [chunks, 20, F, h, w] float32."""
    pipe = c.pipe
    encoder = CausalConditionEncoder(pipe.vae, model_image(c.image).to(c.device),
                                     c.preset.transformer.num_frames_per_block, skip_fixed_point=False)
    out = []
    for chunk in range(chunks):
        out.append(encoder.chunk_condition(chunk).float())
        encoder.commit()
    return torch.stack(out)


def stage_tf32(c: Check) -> None:
    applies = c.device.type == "cuda"
    chunks = 2 if applies else 1            # the first frame's chunk and a full one; off CUDA the path alone
    tf32 = _conditions(c, chunks)                                # under the serving flags: cuDNN TF32
    with flags_set(IEEE_FLOAT32):
        ieee = _conditions(c, chunks)
    rounding = ieee.to(c.preset.torch_dtype).float()             # what the DiT does to it at its input
    (tf32_max, tf32_rms), (round_max, round_rms) = _relative(tf32, ieee), _relative(rounding, ieee)
    c.keep(tf32_applies=applies, condition_chunks=chunks, condition_tf32_max=tf32_max, condition_tf32_rms=tf32_rms,
           condition_rounding_max=round_max, condition_rounding_rms=round_rms,
           condition_tf32_within_rounding=tf32_max <= round_max and tf32_rms <= round_rms)
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 16, 2, *c.preset.latent_hw, generator=g).to(c.device, torch.float32)
    frames = _second_frame(c.pipe.vae, latents)
    with flags_set(IEEE_FLOAT32):
        exact = _second_frame(c.pipe.vae, latents)
    c.keep(decoder_tf32_max_levels=float((frames - exact).abs().max()) * 127.5)     # [-1, 1] -> 0..255
