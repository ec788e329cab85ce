"""`lingbot generate --decoder tae`, `--save-latents` and `lingbot decode`: a session's saved latents decoded
again give the session's own frames bit for bit (.npy), with either decoder."""
import numpy as np
import pytest
import torch
from PIL import Image

from lingbot.cli import main
from lingbot.io.video import read_frames


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "first.png"
    Image.fromarray(np.random.RandomState(1).randint(0, 255, (64, 112, 3), dtype=np.uint8)).save(path)
    return path


def _generate(image_file, out, *extra):
    return main(["generate", "--image", str(image_file), "--prompt", "a quarry", "--keys", "w,,l,d", "--chunks", "2",
                 "-o", str(out), *extra])


@pytest.fixture(scope="module")
def generated(tmp_path_factory, image_file):
    """Two runs of one session: with the Wan decoder (and its latents saved), and with the tiny decoder."""
    folder = tmp_path_factory.mktemp("generated")
    assert _generate(image_file, folder / "wan.npy", "--save-latents", str(folder / "l.npy")) == 0
    assert _generate(image_file, folder / "tae.npy", "--decoder", "tae") == 0
    return folder


def test_saved_latents_decode_to_the_sessions_frames(tmp_path, generated):
    latents = generated / "l.npy"
    saved = np.load(latents)
    assert saved.dtype == np.float32 and saved.shape == (1, 16, 6, 8, 14)          # NCTHW, 2 chunks of 3
    for decoder in ("wan", "tae"):
        out = tmp_path / f"decoded_{decoder}.npy"
        assert main(["decode", "--decoder", decoder, "--latents", str(latents), "-o", str(out)]) == 0
        got, expected = np.load(out), np.load(generated / f"{decoder}.npy")
        assert got.dtype == np.uint8 and got.shape == (12 * 2 - 3, 64, 112, 3)
        assert np.array_equal(got, expected), decoder
    assert not np.array_equal(np.load(generated / "wan.npy"), np.load(generated / "tae.npy"))
    assert main(["decode", "--decoder", "tae", "--latents", str(latents), "-o", str(tmp_path / "t.mp4")]) == 0
    assert read_frames(tmp_path / "t.mp4").shape == (21, 64, 112, 3)


def test_generate_with_the_tiny_decoder_from_a_file(tmp_path, image_file, generated, capsys):
    """--tae-path loads the weights file strictly: the tiny preset's random weights written to a file give the
    frames of the seeded random weights themselves."""
    from safetensors.torch import save_file

    from lingbot.config import get_preset
    from lingbot.io.weights import build_random_tae
    tiny = get_preset("tiny")
    path = tmp_path / "taew2_1.safetensors"
    save_file(build_random_tae(tiny.tae, tiny.weights_seed).state_dict(), path)
    assert _generate(image_file, tmp_path / "file.npy", "--decoder", "tae", "--tae-path", str(path)) == 0
    assert "wrote 21 frames (112x64, 16.0 fps, tae decoder)" in capsys.readouterr().out
    assert np.array_equal(np.load(tmp_path / "file.npy"), np.load(generated / "tae.npy"))


@pytest.mark.parametrize("latents,extra,message", [
    (np.zeros((16, 3, 8, 14), np.float32), [], "must be NCTHW [1, 16, T, h, w], got [16, 3, 8, 14]"),
    (np.zeros((1, 16, 4, 8, 14), np.float32), [], "4 latent frames are not whole chunks of 3"),
    (np.zeros((1, 16, 3, 8, 14), np.float32), ["--decoder", "tae", "--preset", "lingbot-world-v2-14b"],
     "tiny decoder needs its weights with a real model"),
])
def test_decode_bad_input_gives_one_line(tmp_path, capsys, latents, extra, message):
    np.save(tmp_path / "l.npy", latents)
    assert main(["decode", "--latents", str(tmp_path / "l.npy"), "-o", str(tmp_path / "o.npy"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("lingbot: error: ") and message in err


def test_decoded_frames_match_the_library(tmp_path):
    """The command is the library's decode_latents over build_frame_decoder, nothing more."""
    from lingbot.builder import build_frame_decoder
    from lingbot.runtime.pipeline import decode_latents
    latents = torch.randn(1, 16, 6, 8, 14, generator=torch.Generator().manual_seed(3))
    path, out = tmp_path / "l.npy", tmp_path / "o.npy"
    np.save(path, latents.numpy())
    assert main(["decode", "--decoder", "tae", "--latents", str(path), "-o", str(out)]) == 0
    expected = torch.cat(list(decode_latents(build_frame_decoder("tiny", "tae"), latents[0], 3)))
    assert np.array_equal(np.load(out), expected.numpy())


@pytest.mark.parametrize("preset", ["tiny", "lingbot-world-v2-14b"])
@pytest.mark.parametrize("widths", ["published", "tiny"])
def test_decode_reads_the_tiny_decoders_widths_from_its_file(tmp_path, widths, preset):
    """`lingbot decode --decoder tae --tae-path F` with any preset: a file written from a random decoder of the
    published widths (taew2_1's) and one of the tiny preset's load at their own widths and decode as that
    decoder does."""
    from lingbot.config import TAEConfig, get_preset
    from lingbot.io.weights import build_random_tae
    from lingbot.models.tae import TinyFrameDecoder
    from lingbot.runtime.pipeline import decode_latents
    model = build_random_tae(TAEConfig() if widths == "published" else get_preset("tiny").tae, 7)
    torch.save(model.state_dict(), tmp_path / "taew2_1.pth")
    latents = torch.randn(1, 16, 3, 2, 3, generator=torch.Generator().manual_seed(4))
    np.save(tmp_path / "l.npy", latents.numpy())
    assert main(["decode", "--decoder", "tae", "--tae-path", str(tmp_path / "taew2_1.pth"), "--preset", preset,
                 "--latents", str(tmp_path / "l.npy"), "-o", str(tmp_path / "o.npy")]) == 0
    with torch.no_grad():
        expected = torch.cat(list(decode_latents(TinyFrameDecoder(model), latents[0], 3)))
    assert np.array_equal(np.load(tmp_path / "o.npy"), expected.numpy())


def test_a_tiny_decoder_file_for_other_latents_is_refused(tmp_path, capsys):
    from lingbot.config import TAEConfig
    from lingbot.io.weights import build_random_tae
    torch.save(build_random_tae(TAEConfig(latent_channels=8, channels=(8, 8, 8, 8)), 0).state_dict(),
               tmp_path / "t.pth")
    np.save(tmp_path / "l.npy", np.zeros((1, 16, 3, 2, 3), np.float32))
    assert main(["decode", "--decoder", "tae", "--tae-path", str(tmp_path / "t.pth"), "--latents",
                 str(tmp_path / "l.npy"), "-o", str(tmp_path / "o.npy")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"lingbot: error: tiny decoder file {tmp_path / 't.pth'} decodes 8 latent channels; the VAE of "
                   "preset tiny makes 16 (a taew2_1 file is for Wan 2.1 latents)")
