"""Regional torch.compile of the DiT: two graphs for the whole model, none recompiled after the first chunk,
and compiled output within a stated tolerance of eager."""
import torch
from torch._dynamo.utils import counters

from lingbot.camera import CameraEvent, Controls
from lingbot.io.weights import build_random_transformer
from lingbot.runtime.compile import compile_blocks, compile_default
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.dit_runner import DiTRunner
from tests.conftest import random_condition


def _runner(tiny, text_encoder, compiled: bool, backend: str = "inductor") -> DiTRunner:
    model = build_random_transformer(tiny.transformer, tiny.weights_seed, tiny.torch_dtype)   # its own copy:
    if compiled:                                                                              # compile changes it
        compile_blocks(model, backend=backend)
    return DiTRunner(tiny, model, text_encoder)


def test_two_graphs_and_no_recompiles_over_sessions_prompts_and_controls(tiny, tiny_text_encoder):
    """Guards and recompiles are dynamo's, whatever the backend: aot_eager keeps the test fast."""
    torch._dynamo.reset()
    counters.clear()
    runner = _runner(tiny, tiny_text_encoder, compiled=True, backend="aot_eager")
    a = runner.new_session(LatentCondition(random_condition(tiny, frames=3 * 22)), prompt="a canyon", seed=1)
    b = runner.new_session(LatentCondition(random_condition(tiny, frames=3 * 12, seed=2)), prompt="a glacier", seed=2)
    a.run_chunk()
    assert counters["stats"]["unique_graphs"] == 2              # attention_inputs, attention_output: all layers
    velocity = CameraEvent("velocity", (0.0, 0.0, 0.05), (0.0, 0.0, 0.0, 1.0))
    for k in range(1, 22):                                      # the window grows (chunks 0-5), then is steady
        controls = Controls(camera=velocity) if k % 4 == 0 else Controls(keys=("w", "wa", "l"))
        a.run_chunk(controls, prompt=("a desert at night", 2) if k == 9 else None)
        if k <= 12:                                             # a second session, interleaved
            b.run_chunk(Controls(keys=("i", "", "j")))
    assert a.chunk_index == 22 and b.chunk_index == 12
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_compiled_output_is_within_tolerance_of_eager(tiny, tiny_text_encoder):
    """Inductor fuses the fp32 elementwise chains (LN, modulation, RoPE, GELU) and may order reductions
    differently, so results agree to float32 rounding, not bitwise: measured max |diff| 6.6e-7 over 10
    chunks of latents of magnitude ~4; we allow 1e-5."""
    torch._dynamo.reset()
    cond = random_condition(tiny, frames=9)
    out = {}
    for compiled in (False, True):
        runner = _runner(tiny, tiny_text_encoder, compiled)
        out[compiled] = runner.new_session(LatentCondition(cond), prompt="a canyon", seed=3).generate(3)
    assert (out[True] - out[False]).abs().max().item() < 1e-5


def test_compiled_bf16_is_within_tolerance_of_eager_bf16(tiny):
    """bf16, as on a GPU. Eager rounds every bf16 op's output to bf16; inductor fuses each region's
    elementwise chains and decomposes some ops, so intermediates are rounded at other places (RMSNorm's
    normalised value, cast to bf16 before its weight in eager, stays float32 when fused), and a value near
    a rounding boundary lands on the other side now and then. The latents are
    float32, but the flow they are made of is the bf16 head's output, so such a flip moves them by one bf16
    bit of the flow (2^-7..2^-6 at |v| in [1, 4)) times sigma. Measured over seeds 1-4, 6 chunks each: max
    |diff| 0.0098 (0.006-0.0098 per chunk, no growth along the window), mean 0.00075, latents up to 3.9;
    for scale, bf16 against float32 on the same weights is 0.011 (test_bf16.py). We allow 0.03 for the
    max (two bits at the largest magnitudes) and 0.003 for the mean (a systematic drift, not flips)."""
    from lingbot.config import with_dtype
    from lingbot.io.weights import build_random_text_encoder
    torch._dynamo.reset()
    bf16 = with_dtype(tiny, "bfloat16")
    text_encoder = build_random_text_encoder(tiny.text, tiny.weights_seed, torch.bfloat16)
    eager, compiled = (_runner(bf16, text_encoder, c) for c in (False, True))
    assert compiled.model.dtype == torch.bfloat16
    for seed in (1, 2, 3):
        cond = LatentCondition(random_condition(tiny, frames=9, seed=seed))
        a, b = (r.new_session(cond, prompt="a canyon", seed=seed).generate(3) for r in (eager, compiled))
        diff = (b - a).abs()
        assert diff.max().item() < 0.03 and diff.mean().item() < 0.003, (seed, diff.max().item())


def test_compile_is_on_by_default_only_on_accelerators():
    assert compile_default("cuda") and compile_default("npu:0") and not compile_default("cpu")


def test_graph_mode_marks_each_forward_as_a_step_and_uncompile_restores_eager(tiny):
    from lingbot.runtime.compile import uncompile_blocks
    model = build_random_transformer(tiny.transformer, tiny.weights_seed)
    compile_blocks(model, backend="aot_eager", graphs=True)
    assert len(model._forward_pre_hooks) == 1                   # cudagraph_mark_step_begin per forward
    assert all("attention_inputs" in b.__dict__ and "attention_output" in b.__dict__ for b in model.blocks)
    compile_blocks(model, backend="aot_eager")                   # re-compiling starts from the eager regions
    assert len(model._forward_pre_hooks) == 0
    uncompile_blocks(model)
    assert not any("attention_inputs" in b.__dict__ for b in model.blocks)
