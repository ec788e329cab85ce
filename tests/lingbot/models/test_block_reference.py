"""The causal camera DiT against an independent float64 reference written from the formulas.

The diffusers oracle (test_dit_oracle.py) checks one chunk-0 forward with the camera layers zeroed, so it
sees neither the camera injector nor the RoPE time position of later chunks. The reference of
reference_dit.py re-derives the whole LingBot-World forward (patch embedding, time / text / camera
embeddings, every block, the head and the unpatchify) with plain torch ops on the model's parameters, read
by name; this file runs it beside the real runtime (DiTRunner / DiTSession: probes, commits, the K/V slab
window) for 8 chunks with a moving camera, non-zero camera weights and non-trivial norm weights. The
reference keeps its own history: the K/V of every committed chunk, rotated at absolute time positions
3j + f, concatenated explicitly for the chunks the window shows (the sink frames and the most recent
frames, current chunk included).

It proves:
- every forward (4 probes + commit) of every chunk 0..7 matches the reference, end to end and block by
  block (chunk 2 sees chunks 0-2; chunk 7 is past the window: sink 0-2, recent 5-6 and itself);
- the RoPE tables the runtime builds for chunk k are the formula's at time positions 3k, 3k+1, 3k+2;
- the comparison is sharp: dropping the `+ camera tokens` residual of the camera injector, or restarting
  the RoPE time position at 0 every chunk, makes it fail by orders of magnitude (monkeypatched mutants).

Nothing of lingbot/models/dit.py's math (norms, RoPE, attention, modulation, embeddings) is called by
the reference; only the model's parameters are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lingbot.camera import Controls
from lingbot.config import get_preset
from lingbot.io.weights import build_random_transformer
from lingbot.models import dit
from lingbot.models.dit import CausalCameraBlock, CausalWanModel
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.dit_runner import DiTRunner
from tests.lingbot.models.reference_dit import ReferenceDiT, rope_angles, rope_axis_dims

PRESET = get_preset("tiny")
CFG = PRESET.transformer
CHUNKS = 8                  # chunks 0..7: 7 is the first chunk whose window has dropped chunks (3, 4)
KEYS = [("w", "w", "l"), ("l", "i", "w"), ("d", "d", "j"), ("w", "k", "l"), ("a", "a", "s"),
        ("i", "w", "d"), ("j", "j", "w"), ("s", "l", "i")]

# Tolerance. The model runs in float32, the reference in float64 on the same (float32-representable)
# weights, so the difference is the model's float32 rounding only: ~6e-8 relative per op on a residual
# stream that reaches |x| ~ 10 (outputs: mean |v| ~ 0.5, max ~ 3), through 2 blocks, attention over up to
# 6 * 84 window keys and 512 text keys, and the K/V history of up to 7 earlier chunks. Observed: <= 2.5e-6
# on the outputs, <= 3.6e-6 block by block. 2e-5 leaves ~6x for other BLAS kernels / thread counts; a
# mutation must exceed MARGIN * ATOL = 2e-3. Observed mutants: RoPE time restart >= 6.8e-3 (chunks >= 1),
# camera residual dropped >= 2.5 (ad hoc, not kept: half-split instead of interleaved RoPE pairs >= 1.2e-2;
# later chunks' time position off by one frame 4e-3). RoPE is relative, so a constant offset of every
# time position leaves the outputs unchanged: only the direct table test below sees that.
ATOL = 2e-5
MARGIN = 100                # a mutation must exceed the tolerance by at least this factor


# ---------------------------------------------------------------------------------------------------
# the model, driven by the runtime, with every forward recorded
# ---------------------------------------------------------------------------------------------------
def make_model() -> CausalWanModel:
    """The tiny model with seeded random weights; camera layers and norm weights re-drawn so that none
    is zero or one (the released init zeroes camera layers; LayerNorm/RMSNorm weights start at 1)."""
    model = build_random_transformer(CFG, seed=11)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "cam" in name or name.startswith("c2ws_"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return model


def make_inputs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    lh, lw = PRESET.latent_hw
    latents = torch.randn(16, CFG.num_frames_per_block * CHUNKS, lh, lw, generator=g)
    context = torch.randn(1, 512, CFG.text_dim, generator=g)
    context[:, 23:] = 0                                  # pad rows are zero, as the text encoder gives them
    return latents, context


@dataclass
class Forward:
    chunk: int
    timestep: float
    commit: bool
    latents: Tensor
    condition: Tensor
    output: Tensor
    blocks: list[tuple[Tensor, Tensor]]                  # per layer: (input x, output x)


@dataclass
class Run:
    patches: list[Tensor] = field(default_factory=list)             # per chunk [1, L, 1536]
    ropes: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # per chunk, the model's (cos, sin)
    forwards: list[Forward] = field(default_factory=list)


def run_session(model: CausalWanModel, latents: Tensor, context: Tensor) -> Run:
    """CHUNKS chunks through DiTRunner / DiTSession (4 probes + commit each, the K/V slab window), with
    the inputs, the block inputs/outputs and the output of every forward recorded."""
    runner = DiTRunner(PRESET, model, None)
    session = runner.new_session(LatentCondition(latents), text_embedding=context, seed=3)
    timestep_of = {id(t): v for t, v in zip(session.time, [*session.sampler.timesteps,
                                                           session.sampler.commit_timestep])}
    run, block_io = Run(), []
    prepare, forward = model.prepare_chunk, model.forward

    def recording_prepare(camera_patches, first_frame, grid, *args, **kwargs):
        chunk = prepare(camera_patches, first_frame, grid, *args, **kwargs)
        run.patches.append(camera_patches.clone())
        run.ropes.append(chunk.rope)
        return chunk

    def recording_forward(latents, condition, time, text, chunk, kv, commit=False):
        block_io.clear()
        out = forward(latents, condition, time, text, chunk, kv, commit=commit)
        run.forwards.append(Forward(len(run.patches) - 1, timestep_of[id(time)], commit, latents.clone(),
                                    condition.clone(), out.clone(), list(block_io)))
        return out

    hooks = [block.register_forward_hook(lambda _m, args, out: block_io.append((args[0].clone(), out.clone())))
             for block in model.blocks]
    model.prepare_chunk, model.forward = recording_prepare, recording_forward
    try:
        for keys in KEYS[:CHUNKS]:
            session.run_chunk(Controls(keys=keys))
    finally:
        del model.prepare_chunk, model.forward
        for hook in hooks:
            hook.remove()
    assert len(run.forwards) == CHUNKS * (len(PRESET.sampler.timesteps) + 1)          # probes + commit
    assert [f.commit for f in run.forwards].count(True) == CHUNKS
    return run


@dataclass
class Errors:
    """Max |model - reference| per chunk: of the output, and of any block given the model's block input."""
    output: dict[int, float] = field(default_factory=dict)
    block: dict[int, float] = field(default_factory=dict)
    output_scale: float = 0.0

    def after(self, first_chunk: int) -> float:
        return max(v for k, v in self.output.items() if k >= first_chunk)


def compare(model: CausalWanModel, run: Run, context: Tensor) -> Errors:
    ref, errors = ReferenceDiT(model, context), Errors()
    with torch.no_grad():
        for fw in run.forwards:
            expected = ref.forward(fw.latents, fw.condition, fw.timestep, run.patches[fw.chunk], fw.chunk,
                                   commit=fw.commit)
            out_err = (fw.output.double() - expected).abs().max().item()
            # block by block: the reference block on the model's own block input (history: the reference's)
            grid = (fw.latents.shape[2], fw.latents.shape[3] // 2, fw.latents.shape[4] // 2)
            _, e0, camera, angles = ref.conditioning(fw.timestep, run.patches[fw.chunk], fw.chunk, grid)
            block_err = 0.0
            for i, (x_in, x_out) in enumerate(fw.blocks):
                y, _ = ref.block(i, x_in.double(), e0, camera, angles, fw.chunk)
                block_err = max(block_err, (x_out.double() - y).abs().max().item())
            errors.output[fw.chunk] = max(errors.output.get(fw.chunk, 0.0), out_err)
            errors.block[fw.chunk] = max(errors.block.get(fw.chunk, 0.0), block_err)
            errors.output_scale = max(errors.output_scale, expected.abs().mean().item())
    assert all(len(ref.history[j]) == CFG.num_layers for j in range(CHUNKS))
    return errors


@pytest.fixture(scope="module")
def clean():
    """The unmutated model's session and its comparison with the reference."""
    model = make_model()
    latents, context = make_inputs()
    run = run_session(model, latents, context)
    return model, run, compare(model, run, context)


# ---------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------
def test_camera_and_norm_weights_are_not_trivial(clean):
    model, run, _ = clean
    for name, p in model.named_parameters():
        if "cam" in name or name.startswith("c2ws_"):
            assert p.abs().min() > 0 and p.std() > 0.03, name
    assert all(p.abs().max() > 0.1 for p in run.patches)        # the camera moved: non-zero ray patches


def test_every_forward_matches_the_reference_chunks_0_to_7(clean):
    """Outputs of all 40 forwards (chunk 0, chunk 2 with a full history, chunk 7 past the window) and
    every block given the model's block input, against the float64 reference."""
    _, _, errors = clean
    print("max |model - reference| per chunk:", errors.output, "per block:", errors.block)
    assert errors.output_scale > 0.1                  # a non-degenerate output was compared
    for chunk in range(CHUNKS):
        assert errors.output[chunk] < ATOL, (chunk, errors.output[chunk])
        assert errors.block[chunk] < ATOL, (chunk, errors.block[chunk])


def test_reference_window_is_the_sink_and_the_recent_chunks():
    """The reference's own window rule, spelled out for the tiny config (sink 9 frames, window 18)."""
    ref = ReferenceDiT(make_model(), make_inputs()[1])
    assert ref.visible_history(0) == []
    assert ref.visible_history(2) == [0, 1]
    assert ref.visible_history(5) == [0, 1, 2, 3, 4]
    assert ref.visible_history(7) == [0, 1, 2, 5, 6]
    assert ref.visible_history(10) == [0, 1, 2, 8, 9]


def test_rope_tables_of_chunk_k_are_at_time_positions_3k(clean):
    """The (cos, sin) the runtime built for chunk k equal the formula's at frames 3k, 3k+1, 3k+2."""
    _, run, _ = clean
    h, w = PRESET.latent_hw[0] // 2, PRESET.latent_hw[1] // 2
    n = CFG.num_frames_per_block
    assert rope_axis_dims(CFG.attention_head_dim) == (12, 10, 10)
    for k, (cos, sin) in enumerate(run.ropes):
        angles = rope_angles(CFG.attention_head_dim, n * k, n, h, w)
        assert cos.shape == sin.shape == angles.shape == (n * h * w, CFG.attention_head_dim // 2)
        assert (cos.double() - torch.cos(angles)).abs().max() < 1e-6, k
        assert (sin.double() - torch.sin(angles)).abs().max() < 1e-6, k
        # the time angles of the chunk's last frame are (3k + 2) * 10000^(-2i/12): a restart would show here
        last_t = angles[-1, :6]
        assert torch.allclose(last_t, (n * k + n - 1) * 10000.0 ** (-torch.arange(0, 12, 2).double() / 12))


def camera_modulation_without_residual(self, camera_tokens):
    """Mutant of CausalCameraBlock.camera_modulation: the `+ camera_tokens` residual dropped."""
    f = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(camera_tokens)))
    return self.cam_scale_layer(f), self.cam_shift_layer(f)


def camera_tokens_without_residual(self, camera_patches):
    """Mutant of CausalWanModel.camera_tokens: c = L2(SiLU(L1(c))), the `c +` residual dropped."""
    c = self.patch_embedding_wancamctrl(camera_patches.to(self.dtype))
    return self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(c)))


@pytest.mark.parametrize("where", ["block_injector", "model_camera_tokens"])
def test_reference_catches_missing_camera_residual(monkeypatch, clean, where):
    if where == "block_injector":
        monkeypatch.setattr(CausalCameraBlock, "camera_modulation", camera_modulation_without_residual)
    else:
        monkeypatch.setattr(CausalWanModel, "camera_tokens", camera_tokens_without_residual)
    model, _, clean_errors = clean
    latents, context = make_inputs()
    errors = compare(model, run_session(model, latents, context), context)
    print(f"camera residual dropped ({where}): max |model - reference| per chunk:", errors.output)
    assert max(clean_errors.output.values()) < ATOL
    for chunk in (0, 2, 7):
        assert errors.output[chunk] > MARGIN * ATOL, (chunk, errors.output[chunk])
        assert errors.block[chunk] > MARGIN * ATOL, (chunk, errors.block[chunk])


def rope_restart_in_tables(monkeypatch):
    real = dit.rope_tables
    monkeypatch.setattr(dit, "rope_tables", lambda config, first_frame, *rest, **kw: real(config, 0, *rest, **kw))


def rope_restart_in_runtime(monkeypatch):
    real = CausalWanModel.prepare_chunk
    monkeypatch.setattr(CausalWanModel, "prepare_chunk",
                        lambda self, patches, first_frame, *rest, **kw: real(self, patches, 0, *rest, **kw))


@pytest.mark.parametrize("mutate", [rope_restart_in_tables, rope_restart_in_runtime], ids=["tables", "runtime"])
def test_reference_catches_rope_time_restart(monkeypatch, clean, mutate):
    """Time positions restarting at 0 each chunk: chunk 0 is unchanged (its positions are 0..2), every
    later chunk fails, and so does the direct RoPE table check."""
    mutate(monkeypatch)
    model, _, clean_errors = clean
    latents, context = make_inputs()
    run = run_session(model, latents, context)
    errors = compare(model, run, context)
    print("RoPE time restart: max |model - reference| per chunk:", errors.output)
    assert clean_errors.after(1) < ATOL
    assert errors.output[0] < ATOL and errors.block[0] < ATOL
    for chunk in range(1, CHUNKS):
        assert errors.output[chunk] > MARGIN * ATOL, (chunk, errors.output[chunk])
        assert errors.block[chunk] > MARGIN * ATOL, (chunk, errors.block[chunk])
    h, w = PRESET.latent_hw[0] // 2, PRESET.latent_hw[1] // 2
    cos, _ = run.ropes[2]
    assert (cos.double() - torch.cos(rope_angles(CFG.attention_head_dim, 6, 3, h, w))).abs().max() > 0.1
