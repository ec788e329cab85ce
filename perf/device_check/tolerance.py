"""How far compiled regions drift from eager with depth, in the DiT's dtype: the ground for the device
check's STEP_TOLERANCE (check.py), which was first calibrated at the tiny preset's 2 layers.

    python -m perf.device_check.tolerance [--layers 2,10,20,40] [--dtype bfloat16] [--device cpu] [--seed 0]

The DiT at 14B's per-layer shape narrowed (heads of 128, `--heads` of them, the FFN 2.7x the width as at
14B) at the tiny preset's frame size, with seeded random weights, for each depth: chunk 0's first DiT
forward (one denoising step through every layer) and chunk 0's latents (4 steps and the commit), eager and
with the regions compiled, on the same inputs; each difference relative to the eager output's largest
value (as the check measures it). A wrong kernel is off by O(1); rounding grows with depth.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from lingbot.builder import build_dit_runner
from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.runtime.compile import compile_blocks, uncompile_blocks
from lingbot.runtime.condition import LatentCondition

KEYS = Controls(keys=("w", "l", "i"))


def narrowed(layers: int, heads: int, dtype: str):
    tiny = get_preset("tiny")
    width = heads * 128
    transformer = dataclasses.replace(tiny.transformer, num_attention_heads=heads, attention_head_dim=128,
                                      ffn_dim=int(2.7 * width) // 128 * 128, num_layers=layers)
    return dataclasses.replace(tiny, name=f"narrowed-{layers}", transformer=transformer, dtype=dtype)


def outputs(runner, latents, text) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk 0's first DiT output, chunk 0's latents), float32 on the host."""
    steps = []
    hook = runner.model.register_forward_hook(lambda module, args, out: steps.append(out.float().cpu()))
    try:
        session = runner.new_session(LatentCondition(latents), text_embedding=text, seed=0)
        chunk = session.run_chunk(KEYS).latents.float().cpu()
    finally:
        hook.remove()
    return steps[0], chunk


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def drift(layers: int, heads: int, dtype: str, device: str, seed: int) -> dict:
    preset = narrowed(layers, heads, dtype)
    runner = build_dit_runner(preset, device=device, compile=False, text_encoder=False, seed=seed)
    g = torch.Generator().manual_seed(seed)
    cfg = preset.transformer
    text = (torch.randn(1, preset.text.max_length, cfg.text_dim, generator=g) * 0.1).to(device, preset.torch_dtype)
    latents = torch.randn(16, cfg.num_frames_per_block, *preset.latent_hw, generator=g).to(device)
    eager_step, eager_chunk = outputs(runner, latents, text)
    compile_blocks(runner.model)
    step, chunk = outputs(runner, latents, text)
    uncompile_blocks(runner.model)
    torch._dynamo.reset()
    return {"layers": layers, "step": relative(step, eager_step), "chunk0": relative(chunk, eager_chunk)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,10,20,40")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"compiled vs eager, {args.dtype} on {args.device}, {args.heads} heads of 128, seed {args.seed}")
    print("| layers | one step | chunk 0 |\n|---:|---:|---:|")
    for layers in map(int, args.layers.split(",")):
        r = drift(layers, args.heads, args.dtype, args.device, args.seed)
        print(f"| {r['layers']} | {r['step']:.2e} | {r['chunk0']:.2e} |", flush=True)


if __name__ == "__main__":
    main()
