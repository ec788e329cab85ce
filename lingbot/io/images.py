"""First-frame images: read (file, bytes or array), resize to the served size, and the model's input form.

Resizing follows the reference runtime: the image goes to float in [-1, 1] first, then bicubic
interpolation (torch, align_corners=False, no antialiasing, no clamping) to the served size; an image
already at that size is only converted. Every path that takes a first frame (the CLI, the server, and so
the Python client, which sends the file as it is) goes through `load_image`, so a given photo gives the
same input everywhere.

Reading is bounded, since a server decodes what clients send (a one-colour lossless WebP of 6300x6300 is a
few dozen bytes and 40 M pixels). Only the formats a first frame needs are opened (PNG, JPEG, WebP: Pillow
tries no other decoder on the bytes), and the pixels an image may decode to are capped from its header, before
any pixel is decoded: `pixel_cap` of the served size, 4x its width and height (16x its area: 6.4 M pixels at
832x480), never less than a Full HD frame (2.07 M; small presets still take a screenshot). Past 4x per side the
bicubic resize without antialiasing, which reads 4x4 source pixels per output pixel, skips most of the
source: such pixels cost memory and time and change little. A JPEG over the cap is decoded at 1/2, 1/4 or
1/8 of its size (libjpeg's DCT scaling, Pillow's `draft`) when that fits, then resized as above; so only
images over the cap differ from the reference's resize. An image over it in another format is refused.
An image within the cap takes the reference path exactly (converted to float in place).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    import PIL.Image

FORMATS = ("PNG", "JPEG", "WEBP")       # Image.open tries these decoders only
JPEG_FORMATS = ("JPEG", "MPO")          # a camera's multi-picture JPEG opens as MPO: its first picture is a JPEG
MIN_PIXEL_CAP = 1920 * 1080
MAX_IMAGE_PIXELS = 4096 * 4096          # the cap where no served size is known (open_image's default)


def pixel_cap(width: int, height: int) -> int:
    """The most pixels a first frame for a width x height session may decode to (the module docstring)."""
    return max(16 * width * height, MIN_PIXEL_CAP)


def open_image(source: Union[str, Path, bytes, PIL.Image.Image, np.ndarray],
               max_pixels: int = MAX_IMAGE_PIXELS) -> PIL.Image.Image:
    """A decoded RGB image from a path, encoded bytes (PNG, JPEG or WebP), an array [H, W, 3] or a PIL image.
    Encoded images decode to at most `max_pixels` pixels (a JPEG over it at a reduced scale when one fits).

    Raises FileNotFoundError for a missing file and ValueError for bytes that are not an image of those formats
    or decode to more than `max_pixels` pixels (checked from the header, before decoding)."""
    import io

    from PIL import Image, UnidentifiedImageError
    if isinstance(source, np.ndarray):
        return Image.fromarray(source).convert("RGB")
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    name = "image data" if isinstance(source, (bytes, bytearray)) else str(source)
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source,
                           formats=FORMATS)
        width, height = image.size
        if width * height > max_pixels and image.format in JPEG_FORMATS:
            scale = next((s for s in (2, 4, 8) if -(-width // s) * -(-height // s) <= max_pixels), 8)
            image.draft("RGB", (max(width // scale, 1), max(height // scale, 1)))     # decodes at 1/scale or less
        if image.width * image.height > max_pixels:                     # refuse before decoding (bombs)
            raise ValueError(f"{name}: image {width}x{height} has more than {max_pixels} pixels; send a "
                             "smaller one")
        image.load()
    except FileNotFoundError:
        raise FileNotFoundError(f"image {source} does not exist") from None
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name} is not a readable PNG, JPEG or WebP image ({type(e).__name__})") from None
    return image.convert("RGB")


def resize_image(image: PIL.Image.Image, width: int, height: int) -> np.ndarray:
    """An RGB image -> float32 [3, height, width] in [-1, 1] (about: bicubic may overshoot, as in the
    reference), resized after the conversion to float."""
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).float()
    pixels.div_(255.0).sub_(0.5).div_(0.5)                                    # [3, h, w] in [-1, 1]
    if tuple(pixels.shape[1:]) != (height, width):
        pixels = F.interpolate(pixels[None], size=(height, width), mode="bicubic", align_corners=False,
                               antialias=False)[0]
    return pixels.numpy()


def load_image(source, width: int, height: int) -> np.ndarray:
    """open_image (capped at pixel_cap of the size) + resize_image: any first frame -> float32 [3, height, width]."""
    return resize_image(open_image(source, pixel_cap(width, height)), width, height)


def model_image(image: Union[np.ndarray, Tensor]) -> Tensor:
    """The model's first-frame input: uint8 [H, W, 3] (array or tensor) -> float32 [3, H, W] in [-1, 1];
    a float [3, H, W] image (from resize_image) passes through."""
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(image)
    if image.dtype == torch.uint8:
        if image.dim() != 3 or image.shape[2] != 3:
            raise ValueError(f"a uint8 image must be [H, W, 3], got {list(image.shape)}")
        pixels = image.permute(2, 0, 1).float() / 255.0
        return (pixels - 0.5) / 0.5
    if not image.is_floating_point() or image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be uint8 [H, W, 3] or float [3, H, W], got {image.dtype} {list(image.shape)}")
    return image
