"""The in-process session API: shapes, stage split, switches that must be bit-identical, no host reads."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lingbot.camera import CameraEvent, Controls
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.dit_runner import DiTRunner
from tests.conftest import random_condition
from tests.lingbot.runtime.states import assert_same_state, host


def test_generate_shape_and_stage_split(tiny, tiny_runner):
    s = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a canyon", seed=0)
    lh, lw = tiny.height // 8, tiny.width // 8
    assert s.generate(3).shape == (16, 9, lh, lw)
    result = s.run_chunk(Controls(keys=("w", "w", "w")))
    assert result.index == 3 and result.latents.shape == (16, 3, lh, lw)
    assert list(result.timings) == ["condition", "prepare", "probe_0", "probe_1", "probe_2", "probe_3", "commit"]


def test_camera_modulation_cache_is_bit_identical(tiny, tiny_model, tiny_text_encoder):
    cond = random_condition(tiny)
    controls = [Controls(keys=("w", "l", "i"))] * 7
    outs = []
    for cached in (True, False):
        runner = DiTRunner(tiny, tiny_model, tiny_text_encoder, cache_camera_modulation=cached)
        outs.append(runner.new_session(LatentCondition(cond), prompt="a canyon", seed=4).generate(7, controls))
    assert torch.equal(outs[0], outs[1])


def test_controls_change_the_video_from_their_chunk_on(tiny, tiny_runner):
    cond = random_condition(tiny)
    still = tiny_runner.new_session(LatentCondition(cond), prompt="a canyon", seed=4).generate(3)
    moved = tiny_runner.new_session(LatentCondition(cond), prompt="a canyon", seed=4).generate(
        3, [None, Controls(keys=("l", "l", "l")), None])
    assert torch.equal(still[:, :3], moved[:, :3])
    assert (still[:, 3:6] - moved[:, 3:6]).abs().max() > 1e-2


def test_prompt_changes_the_video(tiny, tiny_runner):
    cond = random_condition(tiny)
    a = tiny_runner.new_session(LatentCondition(cond), prompt="a canyon", seed=4).generate(1)
    b = tiny_runner.new_session(LatentCondition(cond), prompt="a glacier", seed=4).generate(1)
    assert (a - b).abs().max() > 1e-2


class HostReadCounter(TorchDispatchMode):
    """Counts ops that read a tensor's value back to Python (.item(), .tolist(), bool(tensor))."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


def test_no_host_reads_on_the_step_path(tiny, tiny_runner):
    s = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a canyon", seed=0)
    s.generate(2)
    with HostReadCounter() as counter:
        for _ in range(6):                      # warm-up and the first steady chunks
            s.run_chunk(Controls(keys=("w", "", "j")))
    assert counter.reads == []
    # the counter does see a host read when there is one
    with HostReadCounter() as counter:
        torch.ones(2).sum().item()
    assert len(counter.reads) == 1


def test_out_of_range_condition_is_a_clear_error(tiny, tiny_runner):
    import pytest
    s = tiny_runner.new_session(LatentCondition(random_condition(tiny, frames=3)), prompt="a canyon", seed=0)
    s.run_chunk()
    with pytest.raises(ValueError, match="condition latents hold 3 frames; chunk 1 needs 6"):
        s.run_chunk()
    assert s.chunk_index == 1


def test_prompts_differing_in_whitespace_share_one_text(tiny_runner):
    assert tiny_runner.text_kv("  a   red\tbarn \n") is tiny_runner.text_kv("a red barn")


def test_a_prompt_transition_blends_the_encoder_outputs_then_projects(tiny, tiny_runner):
    """Chunk 1 of a 2-chunk transition runs on the K/V of the half-way embedding (computed by hand here),
    which is not the half-way K/V (k goes through an RMSNorm); chunk 2 runs on the new prompt's K/V."""
    s = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a canyon", seed=0)
    s.run_chunk()
    a, b = tiny_runner.text_kv("a canyon"), tiny_runner.text_kv("a glacier")
    s.run_chunk(prompt=("a glacier", 2))
    half = 0.5 * a.embedding + 0.5 * b.embedding
    expected = tiny_runner.model.text_kv(half)
    assert all(torch.equal(x, y) for x, y in zip(s.text.keys + s.text.values, expected.keys + expected.values))
    kv_midpoint = 0.5 * (a.keys[0] + b.keys[0])
    assert (s.text.keys[0] - kv_midpoint).abs().max() > 1e-4          # blending K/V would be another thing
    s.run_chunk()
    assert s.text is b


def test_session_state_round_trip_continues_bitwise(tiny, tiny_runner):
    """A DiT session's state (RNG, text and a running prompt transition, camera rig with a move running,
    chunk counter) and its window's slots, put into a new session, give the same state and the same chunks."""
    cond = random_condition(tiny)
    move = CameraEvent("target", (0.1, 0.0, 0.4), (0.0, 0.0, 0.0, 1.0), 3)

    def new():
        return tiny_runner.new_session(LatentCondition(cond), prompt="a canyon", seed=3)
    a = new()
    assert a.state_dict()["text"] is None                    # the prompt is encoded at the first chunk
    for k in range(3):
        a.run_chunk(Controls(keys=("w", "d", ""), camera=move if k == 1 else None),
                    prompt=("a glacier", 3) if k == 1 else None)
    state = a.state_dict(copy=host)
    assert state["chunk_index"] == 3 and state["transition"][2:] == (3, 2) and state["rig"].motion is move
    b = new()
    b.kv.load_slots({c: a.kv.slot_state(c, copy=host) for c in range(3)}, next_chunk=3)
    b.load_state(state)
    assert_same_state(b.state_dict(copy=host), state)
    for _ in range(2):
        assert torch.equal(a.run_chunk(Controls(keys=("a", "", "l"))).latents,
                           b.run_chunk(Controls(keys=("a", "", "l"))).latents)


def test_session_state_refuses_a_window_at_another_chunk(tiny, tiny_runner):
    s = tiny_runner.new_session(LatentCondition(random_condition(tiny)), prompt="a canyon", seed=3)
    s.kv.begin_chunk(0)
    s.kv.commit()
    with pytest.raises(ValueError, match="K/V window is at chunk 1, the session at 0"):
        s.state_dict()
