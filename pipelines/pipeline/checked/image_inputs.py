"""The image arguments of an image-to-video call (`image`, `last_image`, `image_embeds`), checked
into `ImageInputs` (a `GenerationRequest` field), and what the run makes of them: the images at the
video's size for the VAE, and the CLIP processor's pixels.

Images are HWC with 3 channels: a PIL image (as displayed: `storage.images.to_rgb`), a numpy uint8 array, or a float
array in [0, 1]. The VAE sees them as diffusers' `VideoProcessor.preprocess` makes them: resized to
the video's height x width (PIL, Lanczos) when they differ, then mapped to [-1, 1].
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from pipelines.pipeline.checked.inputs import not_a
from pipelines.storage import images

IMAGE_FORMS = "a PIL image, a numpy uint8 [H, W, 3] array, or a float [H, W, 3] array in [0, 1]"


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInputs:
  """The checked image arguments of an image-to-video request.

  Attributes:
    image: the first frame, numpy [H0, W0, 3]: uint8 as given (a PIL image becomes uint8 RGB), or
      float32 in [0, 1].
    last_image: the last frame (first-last-frame, FLF2V) in the same forms, or None.
    image_embeds: float32 [J, I] CLIP image states used instead of encoding `image` (FLF2V: [2, J,
      I], first and last frame), or None.
  """
  image: np.ndarray
  last_image: np.ndarray | None = None
  image_embeds: np.ndarray | None = None

  def digests(self) -> dict[str, str | None]:
    """SHA-256 (hex) of each input's shape, dtype and bytes (None where not given): what the
    sidecar records and a resumed run must match."""
    return {"image_sha256": digest(self.image), "last_image_sha256": digest(self.last_image),
            "image_embeds_sha256": digest(self.image_embeds)}


def digest(array: np.ndarray | None) -> str | None:
  """SHA-256 (hex) of a host array's shape, dtype and bytes; None for None."""
  if array is None:
    return None
  host = np.ascontiguousarray(array)
  return hashlib.sha256(f"{host.shape}{host.dtype}".encode() + host.tobytes()).hexdigest()


def image_array(name: str, value: Any) -> np.ndarray:
  """One image argument as numpy [H, W, 3]: uint8, or float32 in [0, 1].

  Raises:
    ValueError: not one of `IMAGE_FORMS`, naming the argument and the value's type or shape.
  """
  try:
    import PIL.Image
    if isinstance(value, PIL.Image.Image):  # 16-bit, alpha, palette, CMYK, EXIF rotation: `images`
      return images.to_rgb(value).pixels
  except ImportError:  # pragma: no cover (pillow is a dependency)
    pass
  if isinstance(value, str) or not hasattr(value, "shape"):
    raise ValueError(f"{name}={value!r:.80} must be {IMAGE_FORMS}{not_a(value)}")
  array = np.asarray(value)
  if array.ndim != 3 or array.shape[2] != 3 or min(array.shape[:2]) < 1:
    raise ValueError(f"{name} has shape {array.shape}; it must be [H, W, 3] ({IMAGE_FORMS})")
  if array.dtype == np.uint8:
    return array
  if not np.issubdtype(array.dtype, np.floating):
    raise ValueError(f"{name} has dtype {array.dtype}; give uint8 (0..255) or float in [0, 1]")
  array = array.astype(np.float32)
  if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
    raise ValueError(f"{name} (float) must hold finite values in [0, 1], got [{array.min()}, {array.max()}]; "
                     "give uint8 for 0..255 pixels")
  return array


def to_video_frame(image: np.ndarray, height: int, width: int) -> np.ndarray:
  """An `image_array` at the video's size as the VAE sees it: float32 [3, height, width] in [-1, 1]
  (diffusers `VideoProcessor.preprocess`: PIL Lanczos resize when the size differs, / 255, 2x - 1)."""
  import PIL.Image

  if image.shape[:2] != (height, width):
    if image.dtype == np.uint8:
      image = np.asarray(PIL.Image.fromarray(image).resize((width, height), PIL.Image.LANCZOS))
    else:
      image = np.stack([np.asarray(PIL.Image.fromarray(image[..., c], mode="F").resize(
          (width, height), PIL.Image.LANCZOS)) for c in range(3)], axis=-1)
  pixels = image.astype(np.float32) / 255.0 if image.dtype == np.uint8 else image.astype(np.float32)
  return np.ascontiguousarray((pixels * 2.0 - 1.0).transpose(2, 0, 1))


def clip_pixels(processor: Any, images: list[np.ndarray]) -> np.ndarray:
  """The CLIP processor's pixels float32 [len(images), 3, S, S] (transformers' CLIPImageProcessor,
  as diffusers' `encode_image` calls it: uint8 images as PIL images, floats with no rescale)."""
  import PIL.Image

  if all(i.dtype == np.uint8 for i in images):
    out = processor(images=[PIL.Image.fromarray(i) for i in images], return_tensors="np")
  else:
    floats = [i.astype(np.float32) / 255.0 if i.dtype == np.uint8 else i for i in images]
    out = processor(images=floats, return_tensors="np", do_rescale=False)
  return np.asarray(out["pixel_values"], np.float32)


def check_image_inputs(image: Any, last_image: Any, image_embeds: Any, *, image_model: bool,
                       image_dim: int | None, flf2v_positions: bool, first_frame_only: bool = False
                       ) -> ImageInputs | None:
  """The image arguments checked against the model (diffusers `WanImageToVideoPipeline.check_inputs`).

  Args:
    image_model: the model is image-to-video (it needs `image`).
    image_dim: the width I of the transformer's image states, None without an image branch.
    flf2v_positions: the image branch embeds two frames (FLF2V's `pos_embed`).
    first_frame_only: a Wan 2.2 TI2V model: `image` optional (text-to-video without it), no
      `last_image`, no `image_embeds`.

  Raises:
    ValueError: an image given to a text-to-video model, none given to an image-to-video one,
      `last_image` or `image_embeds` without `image`, embeds on a model without an image branch or
      of the wrong shape, or an image not in `IMAGE_FORMS`.
  """
  given = [n for n, v in (("image", image), ("last_image", last_image), ("image_embeds", image_embeds))
           if v is not None]
  if first_frame_only:
    if last_image is not None or image_embeds is not None:
      raise ValueError("Wan 2.2 TI2V conditions on the first frame only: give `image`, not `last_image` or "
                       "`image_embeds`")
    return None if image is None else ImageInputs(image=image_array("image", image))
  if not image_model:
    if given:
      raise ValueError(f"{', '.join(given)} given, but this is a text-to-video model; image-to-video needs "
                       "an image-to-video model: a folder of Wan 2.1 I2V / FLF2V, Wan 2.2 I2V A14B "
                       "(WanImageToVideoPipeline) or Wan 2.2 TI2V-5B, or the tiny one shipped here, "
                       "WanPipeline.tiny(image=True) (generate --model tiny-i2v)")
    return None
  if image is None:
    raise ValueError("image=None: this image-to-video model needs `image`, the video's first frame "
                     f"({IMAGE_FORMS}); `generate --image PATH`")
  if last_image is not None and image_dim is not None and not flf2v_positions:
    raise ValueError("last_image given, but this Wan 2.1 I2V model embeds one frame; first-last-frame "
                     "needs an FLF2V folder (its image embedder has pos_embed for two frames)")
  if last_image is None and flf2v_positions and image_embeds is None:
    raise ValueError("last_image=None: this first-last-frame (FLF2V) model needs `last_image` too "
                     "(`generate --last-image PATH`)")
  embeds = None
  if image_embeds is not None:
    if image_dim is None:
      raise ValueError("image_embeds given, but this model has no image encoder branch (Wan 2.2 I2V "
                       "A14B): leave it out")
    embeds = np.asarray(image_embeds, np.float32)
    frames = 2 if flf2v_positions else 1
    if embeds.ndim == 2 and frames == 1:
      embeds = embeds[None]
    if embeds.ndim != 3 or embeds.shape[0] != frames or embeds.shape[2] != image_dim:
      raise ValueError(f"image_embeds has shape {embeds.shape}; it must be [{frames}, J, {image_dim}] (CLIP "
                       "penultimate states" + (", first and last frame)" if frames == 2 else ")"))
  return ImageInputs(image=image_array("image", image),
                     last_image=None if last_image is None else image_array("last_image", last_image),
                     image_embeds=embeds)
