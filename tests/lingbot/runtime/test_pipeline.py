"""The whole pipeline in process: image + prompt + controls -> uint8 frames, chunk by chunk."""
import pytest
import torch

from lingbot.camera import Controls
from tests.conftest import random_image


def test_chunks_give_9_then_12_uint8_frames(tiny, tiny_pipeline):
    session = tiny_pipeline.new_session(random_image(tiny), "a harbour", seed=1)
    chunks = [session.step(Controls(keys=("w", "", "l"))) for _ in range(3)]
    assert [c.frames.shape for c in chunks] == [(9, 64, 112, 3), (12, 64, 112, 3), (12, 64, 112, 3)]
    assert all(c.frames.dtype == torch.uint8 for c in chunks)
    assert set(chunks[1].timings) >= {"prepare", "probe_0", "probe_3", "commit", "decode"}
    with pytest.raises(ValueError, match=r"image must be \[3, 64, 112\]"):
        tiny_pipeline.new_session(torch.zeros(3, 10, 10), "x")


def test_a_failed_decode_fails_the_session_until_reset(tiny, tiny_pipeline):
    session = tiny_pipeline.new_session(random_image(tiny), "a harbour", seed=1)
    session.step()

    def boom(module, inputs, output):
        raise RuntimeError("injected decode failure")
    handle = tiny_pipeline.vae.decoder.conv_out.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected decode failure"):
            session.step()
    finally:
        handle.remove()
    with pytest.raises(RuntimeError, match="session failed earlier \\(RuntimeError while decoding chunk 1\\)"):
        session.step()
    session.reset()
    assert session.step().frames.shape == (9, 64, 112, 3)
