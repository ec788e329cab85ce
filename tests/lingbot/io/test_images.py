"""First frames: the reference runtime's resize (float in [-1, 1] first, then bicubic, align_corners=False,
no antialiasing, no clamping), bitwise; an image at the served size only converted."""
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from lingbot.io.images import load_image, model_image, open_image, resize_image


def _photo(w, h, seed=0):
    rng = np.random.RandomState(seed)
    pixels = rng.randint(0, 256, (h, w, 3), dtype=np.uint8)
    pixels[:, w // 2:] = 255                                   # a sharp edge: bicubic overshoots it
    pixels[:, :w // 2] = np.minimum(pixels[:, :w // 2], 20)
    return pixels


def test_resize_is_float_bicubic_without_antialias_or_clamp():
    pixels = _photo(150, 90)
    got = resize_image(Image.fromarray(pixels), 112, 64)
    reference = F.interpolate(((torch.from_numpy(pixels).permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5)[None],
                              size=(64, 112), mode="bicubic", align_corners=False, antialias=False)[0]
    assert got.dtype == np.float32 and got.shape == (3, 64, 112)
    assert np.array_equal(got, reference.numpy())
    assert got.max() > 1.0 or got.min() < -1.0                  # not clamped: the overshoot at the edge stays


def test_an_image_at_the_served_size_is_only_converted(tmp_path):
    pixels = _photo(112, 64, seed=1)
    path = tmp_path / "first.png"
    Image.fromarray(pixels).save(path)
    got = load_image(path, 112, 64)
    expected = (pixels.astype(np.float32).transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    assert np.array_equal(got, expected)
    assert torch.equal(model_image(got), torch.from_numpy(expected))          # the pipeline takes it as it is
    assert torch.equal(model_image(pixels), torch.from_numpy(expected))       # uint8 at the size: the same
    assert open_image(pixels).size == (112, 64)
