"""bf16, the dtype of every GPU run, on the CPU (`tiny` with the dtype override): a whole session in
process - the DiT's matmuls in bf16 around the float32 residual stream, the VAE as configured (float32) -
against the same weights in float32, and SP-2 over gloo in bf16 against SP-1 in bf16. Compiled against
eager in bf16: tests/lingbot/runtime/test_compile.py.

Tolerances, measured on this CPU (2 cores, torch 2.13) by the same runs with their differences printed:
- bf16 against float32, same weights (the written float32 checkpoint loaded both ways), 8 chunks, seeds 2
  and 3: latents max |diff| 0.011 (0.007-0.011 in every chunk: the error does not grow along the window;
  latents up to 3.8 in magnitude, 0.69 on average), frames mean |diff| 0.13 uint8 levels (max 3); another
  seed's video is 25.8 levels away. That is bf16's rounding: the flow is the bf16 head's output, whose last
  bit is 2^-7..2^-6 at |v| in [1, 4), scaled by sigma <= 1. We allow 0.03 (about 3x, two such bits at the
  largest magnitudes) and a mean of 0.5 levels.
- SP-2 against SP-1, both bf16, 7 chunks: bitwise equal, latents and frames (oneDNN's bf16 GEMM sums each
  output in float32 in an order that does not depend on how the rows are split, unlike the float32 GEMM
  behind the 6e-7 of test_sequence_parallel.py; attention is per head, whole under Ulysses). A CPU whose
  bf16 kernels block by shape would flip last bits of bf16 outputs as inductor does, so the bound is
  compile's (test_compile.py): 0.03, and 0.5 levels for frames.
"""
import numpy as np
import pytest
import torch
from torch import nn

from lingbot.builder import build_pipeline
from lingbot.camera import Controls
from lingbot.config import get_preset, with_dtype
from lingbot.io.weights import write_random_checkpoint
from lingbot.parallel import Comm
from lingbot.parallel.launch import run_local

TINY = get_preset("tiny")
BF16 = with_dtype(TINY, "bfloat16")
KEYS = (("w", "", "l"), ("i", "a", ""), ("", "d", "j"), ("s", "", "k"))
CHUNKS = 7                  # the window fills in 6 chunks; the 7th is the first to evict (steady state)
BF16_VS_FP32_LATENTS = 0.03
BF16_VS_FP32_PIXELS = 0.5   # mean |diff| in uint8 levels
BF16_SP_LATENTS = 0.03
BF16_SP_PIXELS = 0.5


def _image(seed: int = 5) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (TINY.height, TINY.width, 3), dtype=np.uint8)


def _run(pipeline, seed: int, chunks: int = CHUNKS, prompt: str = "a harbour at dawn"):
    """A session's latents [16, 3 * chunks, h, w] (float32, the sampler's) and frames (uint8, None off the
    root under SP)."""
    session = pipeline.new_session(_image(), prompt, seed=seed)
    latents, frames = [], []
    run_chunk = session.dit.run_chunk

    def keep(*args, **kwargs):
        result = run_chunk(*args, **kwargs)
        latents.append(result.latents.clone())
        return result
    session.dit.run_chunk = keep
    for k in range(chunks):
        frames.append(session.step(Controls(keys=KEYS[k % len(KEYS)])).frames)
    return torch.cat(latents, dim=1), None if frames[0] is None else torch.cat(frames)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny's random weights written once (float32): loaded in bf16 they are the float32 weights rounded,
    as a real checkpoint is loaded on a GPU (the random bf16 builder draws other numbers)."""
    return write_random_checkpoint(TINY, tmp_path_factory.mktemp("tiny") / "ckpt")


def test_a_bf16_session_runs_bf16_matmuls_on_a_float32_residual_stream(checkpoint):
    pipeline = build_pipeline("tiny", model_path=checkpoint, dtype="bfloat16")
    model = pipeline.runner.model
    assert pipeline.preset.dtype == "bfloat16" and pipeline.preset.vae_dtype == "float32"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert pipeline.runner.text_encoder.model.dtype == torch.bfloat16
    assert {p.dtype for p in pipeline.vae.parameters()} == {torch.float32}            # as configured
    # every Linear of the blocks and the head: bf16 in, bf16 out; every block: float32 in and out
    linears, blocks = set(), set()
    hooks = [m.register_forward_hook(lambda m, args, out: linears.add((args[0].dtype, out.dtype)))
             for m in [*model.blocks.modules(), *model.head.modules()] if isinstance(m, nn.Linear)]
    hooks += [b.register_forward_hook(lambda m, args, out: blocks.add((args[0].dtype, out.dtype)))
              for b in model.blocks]
    try:
        latents, frames = _run(pipeline, seed=2)
    finally:
        for h in hooks:
            h.remove()
    assert linears == {(torch.bfloat16, torch.bfloat16)} and blocks == {(torch.float32, torch.float32)}
    session = pipeline.new_session(_image(), "a harbour at dawn", seed=2)
    assert session.dit.kv.keys.dtype == torch.bfloat16
    assert {session.dit.time[0].temb.dtype, session.dit.time[0].timestep_proj.dtype} == {torch.float32}
    assert latents.dtype == torch.float32 and frames.dtype == torch.uint8
    assert frames.shape == (TINY.geometry.video_frames(CHUNKS), TINY.height, TINY.width, 3)
    assert torch.isfinite(latents).all()
    # the same weights in float32: the same video, to bf16 rounding (see the module docstring)
    ref_latents, ref_frames = _run(build_pipeline("tiny", model_path=checkpoint), seed=2)
    err = (latents - ref_latents).abs().max().item()
    assert err < BF16_VS_FP32_LATENTS, err
    pixel = (frames.int() - ref_frames.int()).abs().float().mean().item()
    assert pixel < BF16_VS_FP32_PIXELS, pixel


def _bf16_sp_run(comm):
    latents, frames = _run(build_pipeline("tiny", comm=comm, dtype="bfloat16"), seed=3, prompt="a castle")
    return latents, frames, comm.counts["all_to_all"]


def test_sp2_over_gloo_in_bf16_matches_sp1_in_bf16():
    """Ulysses SP-2 (bf16 all-to-alls of q/k/v and attention outputs, the text embedding broadcast in bf16)
    and the width-sharded float32 decoder, against SP-1 with the same (random bf16) weights."""
    ref_latents, ref_frames, _ = _bf16_sp_run(Comm())
    ranks = run_local(_bf16_sp_run, 2, timeout_s=600)
    for rank, (latents, _, all_to_alls) in enumerate(ranks):
        assert all_to_alls > 0, rank                                    # the DiT did run sequence-parallel
        err = (latents - ref_latents).abs().max().item()
        assert err < BF16_SP_LATENTS, f"rank {rank}: latents differ from SP-1 by {err}"
    frames = ranks[0][1]
    assert ranks[1][1] is None and frames.shape == ref_frames.shape
    pixel = (frames.int() - ref_frames.int()).abs().float().mean().item()
    assert pixel < BF16_SP_PIXELS, pixel
