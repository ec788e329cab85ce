"""First-frame images: read (file, bytes or array), resize to the served size, and the model's input form.

Resizing follows the reference runtime: the image goes to float in [-1, 1] first, then bicubic
interpolation (torch, align_corners=False, no antialiasing, no clamping) to the served size; an image
already at that size is only converted. Every path that takes a first frame (the CLI, the server, and so
the Python client, which sends the file as it is) goes through `resize_image`, so a given photo gives the
same input everywhere.
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

MAX_IMAGE_PIXELS = 40_000_000      # a first frame is resized to the session size; this is plenty


def open_image(source: Union[str, Path, bytes, PIL.Image.Image, np.ndarray]) -> PIL.Image.Image:
    """A decoded RGB image from a path, encoded bytes, an array [H, W, 3] or a PIL image.

    Raises FileNotFoundError for a missing file and ValueError for bytes that are not a readable image
    or hold more than MAX_IMAGE_PIXELS pixels (checked from the header, before decoding)."""
    import io

    from PIL import Image, UnidentifiedImageError
    if isinstance(source, np.ndarray):
        return Image.fromarray(source).convert("RGB")
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    name = "image data" if isinstance(source, (bytes, bytearray)) else str(source)
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
        if image.width * image.height > MAX_IMAGE_PIXELS:     # refuse before decoding (decompression bombs)
            raise ValueError(f"{name}: image {image.width}x{image.height} has more than {MAX_IMAGE_PIXELS} pixels")
        image.load()
    except FileNotFoundError:
        raise FileNotFoundError(f"image {source} does not exist") from None
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name} is not a readable image ({type(e).__name__})") from None
    return image.convert("RGB")


def resize_image(image: PIL.Image.Image, width: int, height: int) -> np.ndarray:
    """An RGB image -> float32 [3, height, width] in [-1, 1] (about: bicubic may overshoot, as in the
    reference), resized after the conversion to float."""
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float()
    pixels = (pixels / 255.0 - 0.5) / 0.5                                     # [3, h, w] in [-1, 1]
    if tuple(pixels.shape[1:]) != (height, width):
        pixels = F.interpolate(pixels[None], size=(height, width), mode="bicubic", align_corners=False,
                               antialias=False)[0]
    return pixels.numpy()


def load_image(source, width: int, height: int) -> np.ndarray:
    """open_image + resize_image: any first frame -> float32 [3, height, width]."""
    return resize_image(open_image(source), width, height)


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
