"""Does a bfloat16 condition encoder hold the condition within tolerance of the float32 one?

    python -m perf.condition_dtype [--preset tiny] [--chunks 14] [--base-dim N] [--dit] [--json PATH]

Per first frame (two of uniform noise, the worst case, and two smooth ones, nearer to a photograph), the
causal encoder runs chunk by chunk, with its fixed-point detection, in float32 (the VAE as the presets
build it) and in bfloat16 (a bf16 copy of the same weights; the latent normalisation kept in float32).
Reported over the chunks up to the later fixed point, for the 16 latent channels of the condition:
- max |bf16 - fp32| and that relative to max |fp32|; rms(bf16 - fp32) / rms(fp32);
- for scale, the rounding a bf16 DiT applies to the float32 condition anyway, at its input
  (`cat(latents, condition).to(bf16)`): max and rms of |bf16(c) - c|;
- the fixed-point chunk in each dtype.
The tolerance: the bf16 encoder holds the condition if its error is within that input rounding (both its
max and its rms): then a bf16 DiT sees the condition as it would from the float32 encoder, up to the
rounding it applies itself. `--dit` also runs the preset's DiT on each condition (same seed, prompt and
controls) and compares the chunks' latents x0 against the float32 condition's, next to the same for the
float32 condition rounded to bf16. `--base-dim 96` gives the VAE the real channel widths (random weights,
the preset's frame size).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os

import torch
import torch.nn.functional as F

from lingbot.config import get_preset
from lingbot.io.weights import build_random_vae
from lingbot.runtime.condition import CausalConditionEncoder


def first_frames(preset, count: int = 4) -> dict[str, torch.Tensor]:
    """Noise (seeds 0, 1) and smooth images (random 4x7 grids upsampled, seeds 2, 3) in [-1, 1]."""
    h, w = preset.height, preset.width
    out = {}
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        if i < 2:
            out[f"noise{i}"] = torch.rand(3, h, w, generator=g) * 2 - 1
        else:
            grid = torch.rand(1, 3, 4, 7, generator=g) * 2 - 1
            out[f"smooth{i}"] = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=True)[0].clamp(-1, 1)
    return out


def bf16_copy(vae):
    """The same weights in bf16; the normalisation buffers stay float32 (a bf16 encoder would keep them so)."""
    half = copy.deepcopy(vae).to(torch.bfloat16)
    half.latents_mean = vae.latents_mean.clone()
    half.latents_inv_std = vae.latents_inv_std.clone()
    return half


def conditions(vae, image, chunks: int) -> tuple[list[torch.Tensor], int | None]:
    """Per chunk the 16 latent channels of the condition [16, 3, h, w] float32, and the fixed-point chunk."""
    encoder = CausalConditionEncoder(vae, image, skip_fixed_point=True)         # encode() casts to the VAE dtype
    out = []
    for k in range(chunks):
        out.append(encoder.chunk_condition(k)[4:].float())
        encoder.commit()
    return out, encoder.fixed_point_chunk


def rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    ref_all, got_all = torch.cat(ref, dim=1), torch.cat(got, dim=1)
    diff = got_all - ref_all
    rounding = ref_all.to(torch.bfloat16).float() - ref_all
    scale = ref_all.abs().max().item()
    return {"max_abs": diff.abs().max().item(), "max_abs_rel": diff.abs().max().item() / scale,
            "rms_rel": rms(diff) / rms(ref_all), "scale_max_abs": scale,
            "input_rounding_max_abs": rounding.abs().max().item(),
            "input_rounding_rms_rel": rms(rounding) / rms(ref_all),
            "per_chunk_max_abs": [(g - r).abs().max().item() for r, g in zip(ref, got)]}


def dit_effect(preset, variants: dict[str, list[torch.Tensor]], chunks: int) -> dict[str, float]:
    """Max |x0 - x0(fp32 condition)| over `chunks` chunks of the preset's DiT, per condition variant."""
    from lingbot.builder import build_dit_runner
    from lingbot.camera import Controls
    from lingbot.runtime.condition import LatentCondition
    runner = build_dit_runner(preset, compile=False)
    outs = {}
    for name, latents in variants.items():
        session = runner.new_session(LatentCondition(torch.cat(latents, dim=1)), prompt="a harbour at dawn", seed=4)
        outs[name] = torch.cat([session.run_chunk(Controls(keys=("w", "", "l"))).latents for _ in range(chunks)], 1)
    ref = outs["fp32"]
    return {name: (x - ref).abs().max().item() / ref.abs().max().item() for name, x in outs.items() if name != "fp32"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--chunks", type=int, default=14)
    ap.add_argument("--base-dim", type=int, default=None, help="the VAE's base channel width (tiny: 8, real: 96)")
    ap.add_argument("--dit", action="store_true", help="also the DiT's chunk latents with each condition")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.set_grad_enabled(False)
    preset = get_preset(args.preset)
    vae_cfg = preset.vae if args.base_dim is None else dataclasses.replace(preset.vae, base_dim=args.base_dim)
    vae32 = build_random_vae(vae_cfg, preset.weights_seed or 0)
    vae16 = bf16_copy(vae32)
    report = {"preset": preset.name, "vae_base_dim": vae_cfg.base_dim, "chunks": args.chunks, "images": {}}
    print(f"condition encoder bf16 vs fp32: {preset.name} {preset.width}x{preset.height}, VAE base_dim "
          f"{vae_cfg.base_dim}, {args.chunks} chunks")
    print(f"{'image':>8} {'fp':>3} {'bf':>3} {'max|d|':>9} {'rel':>9} {'rms rel':>9} {'round max':>9} "
          f"{'round rms':>9}  {'DiT x0 rel: bf16 enc / fp32 rounded':>36}")
    for name, image in first_frames(preset).items():
        ref, fixed32 = conditions(vae32, image, args.chunks)
        got, fixed16 = conditions(vae16, image, args.chunks)
        row = {"fixed_point_fp32": fixed32, "fixed_point_bf16": fixed16, **compare(ref, got)}
        if args.dit:
            row["dit_x0_rel"] = dit_effect(preset, {"fp32": ref, "bf16_encoder": got,
                                                    "fp32_rounded_bf16": [c.to(torch.bfloat16).float() for c in ref]},
                                           args.chunks)
        report["images"][name] = row
        effect = row.get("dit_x0_rel")
        dit = "" if effect is None else f"{effect['bf16_encoder']:.2e} / {effect['fp32_rounded_bf16']:.2e}"
        print(f"{name:>8} {fixed32!s:>3} {fixed16!s:>3} {row['max_abs']:9.2e} {row['max_abs_rel']:9.2e} "
              f"{row['rms_rel']:9.2e} {row['input_rounding_max_abs']:9.2e} {row['input_rounding_rms_rel']:9.2e}  "
              f"{dit:>36}")
    rows = report["images"].values()
    within = all(r["max_abs"] <= r["input_rounding_max_abs"] and r["rms_rel"] <= r["input_rounding_rms_rel"]
                 for r in rows)
    report["bf16_within_input_rounding"] = within
    print(f"bf16 within the DiT's own input rounding (max and rms): {within}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
