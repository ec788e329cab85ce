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
    model = build_random_transformer(tiny.transformer, tiny.weights_seed)   # its own copy: compile changes it
    if compiled:
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
