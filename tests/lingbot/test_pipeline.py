"""The whole pipeline in process, and the `lingbot generate` command end to end."""
import numpy as np
import pytest
import torch
from PIL import Image

from lingbot.camera import Controls
from lingbot.cli import main, parse_key_script
from lingbot.video import read_frames
from tests.conftest import random_image


def test_chunks_give_9_then_12_uint8_frames(tiny, tiny_pipeline):
    session = tiny_pipeline.new_session(random_image(tiny), "a harbour", seed=1)
    chunks = [session.step(Controls(keys=("w", "", "l"))) for _ in range(3)]
    assert [c.frames.shape for c in chunks] == [(9, 64, 112, 3), (12, 64, 112, 3), (12, 64, 112, 3)]
    assert all(c.frames.dtype == torch.uint8 for c in chunks)
    assert set(chunks[1].timings) >= {"prepare", "probe_0", "probe_3", "commit", "decode"}
    with pytest.raises(ValueError, match=r"image must be \[3, 64, 112\]"):
        tiny_pipeline.new_session(torch.zeros(3, 10, 10), "x")


def test_key_script_parsing():
    controls = parse_key_script("w,w,wa,,J", chunks=2)
    assert [c.keys for c in controls] == [("w", "w", "wa"), ("", "j", "")]
    with pytest.raises(ValueError, match="--keys has 7 key sets but 2 chunks hold 6 latent frames"):
        parse_key_script("w,w,w,w,w,w,w", chunks=2)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "first.png"
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (90, 160, 3), dtype=np.uint8)).save(path)
    return path


def test_generate_cli_end_to_end_is_deterministic(tmp_path, image_file, capsys):
    args = ["generate", "--preset", "tiny", "--image", str(image_file), "--prompt", "a forest path",
            "--keys", "w,w,wa,,j,l", "--chunks", "3", "--seed", "7"]
    assert main(args + ["-o", str(tmp_path / "a.mp4")]) == 0
    assert main(args + ["-o", str(tmp_path / "b.mp4")]) == 0
    a, b = read_frames(tmp_path / "a.mp4"), read_frames(tmp_path / "b.mp4")
    assert a.shape == (12 * 3 - 3, 64, 112, 3)
    assert np.array_equal(a, b)
    assert "wrote 33 frames" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    (["--keys", "w,x"], "unknown key(s) 'x'"),
    (["--image", "/nonexistent.png"], "image /nonexistent.png does not exist"),
    (["--model-path", "/nonexistent"], "model path /nonexistent is not a directory"),
    (["--image", __file__], "is not a readable image"),
    (["--preset", "lingbot-world-v2-14b"], "preset lingbot-world-v2-14b has no random weights"),
])
def test_generate_cli_bad_arguments_give_one_line(tmp_path, image_file, capsys, extra, message):
    args = ["generate", "--image", str(image_file), "--prompt", "x", "-o", str(tmp_path / "o.mp4")] + extra
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("lingbot: error: ") and message in err


def test_generate_cli_with_sp2(tmp_path, image_file):
    out = tmp_path / "sp2.mp4"
    args = ["generate", "--image", str(image_file), "--prompt", "a forest path", "--keys", "w,,l",
            "--chunks", "2", "--sp", "2", "--pixel-mode", "root_uint8_allgather", "-o", str(out)]
    assert main(args) == 0
    assert read_frames(out).shape == (21, 64, 112, 3)
    assert main(args[:-2] + ["--device", "cuda", "-o", str(out)]) == 2          # --sp is for local CPU ranks


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
