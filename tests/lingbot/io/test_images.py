"""First frames: the reference runtime's resize (float in [-1, 1] first, then bicubic, align_corners=False,
no antialiasing, no clamping), bitwise; an image at the served size only converted; the pixel cap from the
header, and a JPEG over it decoded at a reduced scale."""
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from lingbot.io.images import load_image, model_image, open_image, pixel_cap, resize_image


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


def _encoded(pixels, fmt, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **kw)
    return buf.getvalue()


def test_the_pixel_cap_is_4x_the_served_size_per_side_and_never_below_full_hd():
    assert pixel_cap(832, 480) == 16 * 832 * 480 == 6_389_760
    assert pixel_cap(112, 64) == 1920 * 1080                      # small presets still take a screenshot
    at_cap = _encoded(np.zeros((1080, 1920, 3), np.uint8), "PNG")
    assert load_image(at_cap, 112, 64).shape == (3, 64, 112)
    over = _encoded(np.zeros((1080, 1921, 3), np.uint8), "PNG")   # one column more: refused from the header
    with pytest.raises(ValueError, match=r"^image data: image 1921x1080 has more than 2073600 pixels; send a smaller"):
        load_image(over, 112, 64)


def test_a_jpeg_within_the_cap_takes_the_exact_path_and_one_over_it_decodes_reduced():
    pixels = _photo(1200, 800, seed=2)
    within = _encoded(pixels, "JPEG", quality=90)
    decoded = Image.open(io.BytesIO(within)).convert("RGB")
    assert open_image(within, pixel_cap(112, 64)).size == (1200, 800)
    assert np.array_equal(load_image(within, 112, 64), resize_image(decoded, 112, 64))
    big = _encoded(np.repeat(np.repeat(_photo(500, 375, seed=3), 8, axis=0), 8, axis=1), "JPEG", quality=90)
    # 4000x3000 = 12 M pixels, over 832x480's cap of 6.4 M: libjpeg decodes it at half size
    assert open_image(big, pixel_cap(832, 480)).size == (2000, 1500)
    assert load_image(big, 832, 480).shape == (3, 480, 832)
    assert open_image(big, pixel_cap(112, 64)).size == (1000, 750)               # 1/4 to fit 2 M pixels
