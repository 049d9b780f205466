"""Images as the 8-bit RGB a person sees: the one reader behind every image input (`generate
--image`, a PIL image given to the Python call).

Pillow's own `convert("RGB")` is wrong for several common files: a 16-bit PNG (mode "I;16" or "I")
is clipped, so a 0..65535 ramp comes out almost all white; an alpha channel is dropped, so a
transparent pixel shows whatever colour it stored; and a phone's JPEG is not turned by its EXIF
orientation. Here:
- EXIF orientation is applied (`PIL.ImageOps.exif_transpose`);
- 16-bit integer modes ("I;16*", and "I", which is how Pillow reads 16-bit files) are scaled from
  0..65535 to 0..255 (v / 257, rounded); float mode "F" is read as [0, 1];
- alpha ("RGBA", "LA", "PA", a palette with a transparent colour) is composited on black, as the
  straight-alpha image would show over a black background;
- every other mode ("P", "CMYK", "YCbCr", "LAB", "HSV", "L", "1") goes through Pillow's RGB
  conversion.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


@dataclasses.dataclass(frozen=True)
class RGBImage:
  """An image read for generation.

  Attributes:
    pixels: numpy uint8 [H, W, 3], RGB as displayed (orientation applied, alpha on black).
    source_mode: the Pillow mode it came in ("I;16", "RGBA", "P", ...), for the run's record.
    rotated: whether an EXIF orientation turned or flipped it.
  """
  pixels: np.ndarray
  source_mode: str
  rotated: bool = False


def to_rgb(image: Any) -> RGBImage:
  """A PIL image as `RGBImage` (rules in the module docstring).

  Raises:
    ValueError: an image with a zero-sized side.
  """
  from PIL import ImageOps

  mode, rotated = image.mode, _orientation(image) not in (None, 1)
  image = ImageOps.exif_transpose(image) if rotated else image
  if min(image.size) < 1:
    raise ValueError(f"the image is {image.size[0]}x{image.size[1]} pixels; give a non-empty image")
  if mode in SIXTEEN_BIT_MODES:
    grey = np.asarray(image).astype(np.float64)
    return RGBImage(_grey_to_rgb(np.rint(np.clip(grey, 0, 65535) / 257)), mode, rotated)
  if mode == "F":
    grey = np.nan_to_num(np.asarray(image, np.float64), nan=0.0)
    return RGBImage(_grey_to_rgb(np.rint(np.clip(grey, 0, 1) * 255)), mode, rotated)
  if mode == "P" and "transparency" in image.info:
    image = image.convert("RGBA")
  if image.mode in ALPHA_MODES:
    rgba = np.asarray(image.convert("RGBA"), np.float64)
    rgb = rgba[..., :3] * (rgba[..., 3:] / 255.0)
    return RGBImage(np.rint(rgb).astype(np.uint8), mode, rotated)
  return RGBImage(np.asarray(image.convert("RGB"), np.uint8), mode, rotated)


def read_image(path: str | os.PathLike) -> RGBImage:
  """The image file at `path` as `RGBImage` (the first frame of an animated file).

  Raises:
    OSError: an unreadable file (Pillow's `UnidentifiedImageError` is one).
    ValueError: see `to_rgb`.
  """
  import PIL.Image

  with PIL.Image.open(path) as image:
    image.load()
    return to_rgb(image)


def displayed_size(path: str | os.PathLike) -> tuple[int, int]:
  """(width, height) of the image file as displayed: EXIF rotations of 90 / 270 degrees swap them."""
  import PIL.Image

  with PIL.Image.open(path) as image:
    width, height = image.size
    return (height, width) if _orientation(image) in (5, 6, 7, 8) else (width, height)


def describe(path: str | os.PathLike) -> dict[str, Any]:
  """What a run records of an image file (its header only): path, Pillow mode, EXIF-rotated."""
  import PIL.Image

  with PIL.Image.open(path) as image:
    return {"path": os.path.abspath(path), "source_mode": image.mode,
            "rotated": _orientation(image) not in (None, 1)}


def _orientation(image: Any) -> int | None:
  """The EXIF orientation tag (1 = as stored), or None."""
  try:
    return image.getexif().get(0x0112)
  except Exception:  # noqa: BLE001 (a malformed EXIF block is read as none)
    return None


def _grey_to_rgb(grey: np.ndarray) -> np.ndarray:
  """uint8 [H, W, 3] from one grey channel of 0..255 values."""
  return np.repeat(grey.astype(np.uint8)[..., None], 3, axis=-1)
