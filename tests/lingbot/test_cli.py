"""The `lingbot` command line end to end: generate (in process and over 2 local gloo ranks), its errors."""
import numpy as np
import pytest
import torch
from PIL import Image

from lingbot.cli import main
from lingbot.io.video import read_frames


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
    (["--image", __file__], "is not a readable PNG, JPEG or WebP image"),
    (["--preset", "lingbot-world-v2-14b"], "preset lingbot-world-v2-14b has no random weights"),
])
def test_generate_cli_bad_arguments_give_one_line(tmp_path, image_file, capsys, extra, message):
    args = ["generate", "--image", str(image_file), "--prompt", "x", "-o", str(tmp_path / "o.mp4")] + extra
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("lingbot: error: ") and message in err


def test_generate_cli_with_sp2_shows_the_sp1_video(tmp_path, image_file):
    """SP-2 frames are within one uint8 level of SP-1's (float rounding of split matmuls and decoder
    columns), so after the same H.264 encoder the two videos agree closely; another seed does not."""
    base = ["generate", "--image", str(image_file), "--prompt", "a forest path", "--keys", "w,,l", "--chunks", "2"]
    sp2 = base + ["--sp", "2", "--pixel-mode", "root_uint8_allgather", "-o", str(tmp_path / "sp2.mp4")]
    assert main(sp2) == 0
    assert main(base + ["-o", str(tmp_path / "sp1.mp4")]) == 0
    assert main(base + ["--seed", "1", "-o", str(tmp_path / "seed1.mp4")]) == 0
    a, b, c = (read_frames(tmp_path / f).astype(float) for f in ("sp2.mp4", "sp1.mp4", "seed1.mp4"))
    assert a.shape == b.shape == (21, 64, 112, 3)
    assert np.abs(a - b).mean() < 0.5
    assert np.abs(a - c).mean() > 5.0
    assert main(sp2[:-2] + ["--device", "cuda", "-o", str(tmp_path / "x.mp4")]) == 2   # --sp: local CPU ranks


def test_trajectory_shows_what_the_model_receives(capsys):
    import json
    assert main(["trajectory", "--keys", "wd,wd,wd,w,i,l", "--json"]) == 0
    frames = json.loads(capsys.readouterr().out)
    assert [f["frame"] for f in frames] == list(range(6))
    steps = [round(float(np.linalg.norm(f["translation"])), 6) for f in frames]
    assert steps == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]          # held diagonal: unit steps; w alone is its chunk's largest
    assert [f["pitch_deg"] for f in frames] == [0, 0, 0, 0, 4.0, 4.0]
    assert [f["yaw_deg"] for f in frames] == [0, 0, 0, 0, 0, 6.0]
    np.testing.assert_allclose(np.array(frames[2]["c2w"])[:3, 3], [0.15, 0, 0.15], atol=1e-12)   # 3 x 0.05 each way
    assert main(["trajectory", "--keys", "w,q"]) == 2
    assert "unknown key(s) 'q'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    """13 video frames yawing 10 deg and moving 0.1 along z per frame (4 latent frames: 2 chunks)."""
    from lingbot.camera import make_pose, rot_y
    folder = tmp_path_factory.mktemp("clip")
    poses = np.stack([make_pose(rot_y(10 * i), (0.0, 0.0, 0.1 * i)) for i in range(13)])
    np.save(folder / "poses.npy", poses)
    np.save(folder / "intrinsics.npy", np.array([[500.0 + i, 400.0, 416.0, 240.0] for i in range(13)]))
    return folder / "poses.npy", folder / "intrinsics.npy"


def test_trajectory_of_an_offline_path(capsys, clip_files):
    import json
    poses, intrinsics = clip_files
    assert main(["trajectory", "--poses", str(poses), "--intrinsics", str(intrinsics), "--json"]) == 0
    frames = json.loads(capsys.readouterr().out)
    assert len(frames) == 6                                   # 4 latent frames -> 2 chunks; then the camera holds
    steps = [round(float(np.linalg.norm(f["translation"])), 9) for f in frames]
    assert steps == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]            # unit: the clip's largest step (0.4)
    assert [round(f["yaw_deg"], 9) for f in frames] == [0, 40, 80, 120, 120, 120]
    assert [round(f["pitch_deg"], 9) for f in frames] == [0] * 6
    sx, sy = 112 / 832, 64 / 480                              # the tiny preset's size
    assert [round(f["intrinsics"][0], 9) for f in frames] == [round((500 + 4 * k) * sx, 9) for k in (0, 1, 2, 3, 3, 3)]
    assert frames[0]["intrinsics"][1:] == pytest.approx([400 * sy, 416 * sx, 240 * sy], abs=1e-12)
    assert main(["trajectory", "--poses", str(poses)]) == 2
    assert "--poses and --intrinsics go together" in capsys.readouterr().err


def test_generate_follows_an_offline_path(tmp_path, image_file, clip_files, capsys):
    poses, intrinsics = clip_files
    base = ["generate", "--image", str(image_file), "--prompt", "a forest path", "--seed", "3"]
    assert main(base + ["--poses", str(poses), "--intrinsics", str(intrinsics), "-o", str(tmp_path / "t.mp4")]) == 0
    assert main(base + ["--chunks", "2", "-o", str(tmp_path / "still.mp4")]) == 0
    moved, still = read_frames(tmp_path / "t.mp4"), read_frames(tmp_path / "still.mp4")
    assert moved.shape == still.shape == (21, 64, 112, 3)     # chunks default to the path's 2
    assert np.abs(moved[9:].astype(int) - still[9:].astype(int)).mean() > 1.0
    bad = tmp_path / "bad.npy"
    np.save(bad, np.load(poses) * 1.5)
    assert main(base + ["--poses", str(bad), "--intrinsics", str(intrinsics), "-o", str(tmp_path / "b.mp4")]) == 2
    assert "pose 0 is not a rigid camera-to-world transform" in capsys.readouterr().err


def test_generate_cli_in_bf16(tmp_path, image_file, capsys, monkeypatch):
    """--dtype bfloat16 builds the DiT and the text encoder in bf16, the VAE as configured (float32), and
    writes the video; a dtype outside the list is refused by the parser."""
    from lingbot import builder
    built = []
    original = builder.build_pipeline
    monkeypatch.setattr(builder, "build_pipeline", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    args = ["generate", "--image", str(image_file), "--prompt", "a forest path", "--keys", "w,,l", "--chunks", "2"]
    assert main(args + ["--dtype", "bfloat16", "-o", str(tmp_path / "bf16.mp4")]) == 0
    assert read_frames(tmp_path / "bf16.mp4").shape == (21, 64, 112, 3)
    assert "wrote 21 frames" in capsys.readouterr().out
    runner = built[0].runner
    assert runner.model.dtype == runner.text_encoder.model.dtype == torch.bfloat16
    assert next(built[0].vae.parameters()).dtype == torch.float32 and runner.preset.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        main(args + ["--dtype", "int8", "-o", str(tmp_path / "x.mp4")])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
