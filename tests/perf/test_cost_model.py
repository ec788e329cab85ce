"""The analytical FLOP count equals what torch's FlopCounterMode counts on the real tiny forward."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from lingbot.camera import Controls
from lingbot.runtime.condition import LatentCondition
from lingbot.runtime.dit_runner import DiTRunner
from perf.cost_model import preset_chunk_flops
from tests.conftest import random_condition


def _register_cpu_sdpa():
    """FlopCounterMode knows the CUDA attention kernels but not the CPU one; count it the same way."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    from torch.utils.flop_counter import flop_registry
    if op in flop_registry or op.default in flop_registry:
        return

    @register_flop_formula(op)
    def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        b, h, q, d = query_shape
        s = key_shape[2]
        return 2 * b * h * q * s * d + 2 * b * h * q * s * value_shape[3]     # scores + weighted values


@pytest.mark.parametrize("cached", [True, False])
def test_count_matches_flop_counter(tiny, tiny_model, tiny_text_encoder, cached):
    _register_cpu_sdpa()
    runner = DiTRunner(tiny, tiny_model, tiny_text_encoder, cache_camera_modulation=cached)
    # the text K/V is made once per prompt, not per chunk: made here from the embedding, outside the count
    # (a session from a prompt encodes it at its first chunk)
    text = tiny_text_encoder.encode(["a fjord"])
    s = runner.new_session(LatentCondition(random_condition(tiny)), text_embedding=text, seed=0)
    for k in range(8):
        with FlopCounterMode(display=False) as counter:
            s.run_chunk(Controls(keys=("w", "", "")))
        assert counter.get_total_flops() == preset_chunk_flops(tiny, k, camera_cached=cached).total, k


def test_count_matches_flop_counter_in_a_sessions_own_window(tiny, tiny_model, tiny_text_encoder):
    """A session of its own K/V window (sink 1 chunk, window 3) attends fewer keys from chunk 3 on: the count
    follows it, and a steady chunk costs less than the model's window."""
    _register_cpu_sdpa()
    runner = DiTRunner(tiny, tiny_model, tiny_text_encoder)
    text = tiny_text_encoder.encode(["a fjord"])
    s = runner.new_session(LatentCondition(random_condition(tiny)), text_embedding=text, seed=0, window=(1, 3))
    for k in range(5):
        with FlopCounterMode(display=False) as counter:
            s.run_chunk(Controls(keys=("w", "", "")))
        assert counter.get_total_flops() == preset_chunk_flops(tiny, k, window=(1, 3)).total, k
    assert preset_chunk_flops(tiny, 4, window=(1, 3)).total < preset_chunk_flops(tiny, 4).total


def test_v2_14b_steady_chunk():
    from lingbot.config import get_preset
    f = preset_chunk_flops(get_preset("lingbot-world-v2-14b"), 6)
    assert f.forwards == 5
    assert 1.0e15 < f.total < 1.3e15


def _count_sp_bytes(comm):
    from lingbot.builder import build_pipeline
    pipe = build_pipeline("tiny", comm=comm)
    image = torch.rand(3, 64, 112, generator=torch.Generator().manual_seed(0)) * 2 - 1
    session = pipe.new_session(image, "a fjord", seed=0)
    session.step()
    comm.reset_counts()
    session.step()                                   # chunk 1: 12 frames
    return dict(comm.bytes_sent)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sp_bytes_match_the_analytical_count(tiny, world_size):
    from lingbot.parallel.launch import run_local
    from perf.cost_model import sp_dit_bytes_per_chunk, sp_pixel_bytes_per_chunk
    counted = run_local(_count_sp_bytes, world_size, timeout_s=120)
    for rank, got in enumerate(counted):
        expected = sp_dit_bytes_per_chunk(tiny.transformer, tiny.tokens_per_frame, world_size, rank, 4)
        assert got["all_to_all"] == expected["all_to_all"], rank
        assert got["all_gather"] == expected["all_gather"], rank
        assert got.get("pixels", 0) == sp_pixel_bytes_per_chunk(64, 112, 12, 14, world_size, rank)


def test_a_rung_costs_the_prepare_one_forward_per_probe_kept_the_commit_and_its_decoders_decode():
    from lingbot.config import get_preset
    from perf.decode_time import steady_step_flops
    from perf.rungs import modelled
    preset = get_preset("lingbot-world-v2-14b")
    f = preset_chunk_flops(preset, 24)
    wan, tae = (3 * steady_step_flops(preset, d) for d in ("wan", "tae"))
    costs = modelled()
    assert costs["full"] == f.total + wan and costs["steps3"] == f.prepare + 4 * f.forward + wan
    assert costs["steps2"] == f.prepare + 3 * f.forward + wan and costs["tiny"] == f.total + tae
    assert costs["tiny_steps2"] == f.prepare + 3 * f.forward + tae
    assert 0.60 < (costs["steps2"] - wan) / (costs["full"] - wan) < 0.62 and 24 < wan / tae < 26
