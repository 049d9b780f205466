"""The VACE arguments of a call on a VACE model (`video`, `mask`, `reference_images`,
`conditioning_scale`; diffusers' `WanVACEPipeline`), checked into `VACEInputs` (a `GenerationRequest`
field), and the step's conditioning they make (`conditioning`).

Frames and images are in one of `image_inputs.IMAGE_FORMS`. What the VAE sees is what diffusers'
`preprocess_conditions` makes, at the call's height x width:
- video frames resized to height x width (PIL Lanczos when they differ; diffusers keeps the video's
  own size, which must then be the call's for the model to run) and mapped to [-1, 1];
- mask frames likewise, then (m + 1) / 2: 1 (white) = generate, 0 (black) = keep; one mask image
  stands for every frame;
- each reference image resized (Lanczos) to its own size floored to a multiple of the VAE's spatial factor,
  mapped to [-1, 1], scaled bilinearly (torch's `interpolate(mode="bilinear", align_corners=False)`)
  to fit height x width with its aspect kept, and centred on a white canvas.

Glossary (DESIGN.md section 1): B' videos, F frames, V VACE blocks, n reference images.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import warnings
from typing import Any

import numpy as np

from pipelines.pipeline.checked.image_inputs import digest, image_array, to_video_frame
from pipelines.pipeline.checked.inputs import is_real, not_a
from pipelines.pipeline.checked.video_inputs import video_frames


@dataclasses.dataclass(frozen=True, eq=False)
class VACEInputs:
  """The checked VACE arguments of a request.

  Attributes:
    video: numpy [F, H0, W0, 3] (uint8, or float32 in [0, 1]) or None (no video: zeros, every pixel
      generated).
    mask: numpy [F or 1, H0, W0, 3] in the same forms or None (every pixel generated).
    references: reference images, numpy [H, W, 3] each (any sizes).
    scale: the conditioning scale of each of the V VACE blocks.
  """
  video: np.ndarray | None
  mask: np.ndarray | None
  references: tuple[np.ndarray, ...]
  scale: tuple[float, ...]

  def digests(self) -> dict[str, Any]:
    """What the sidecar and a resumed run record: the inputs' SHA-256 and the scales."""
    return {"vace_video_sha256": digest(self.video), "vace_mask_sha256": digest(self.mask),
            "reference_images_sha256": [digest(r) for r in self.references],
            "conditioning_scale": list(self.scale)}

  def video_pixels(self, height: int, width: int) -> np.ndarray | None:
    """float32 [3, F, height, width] in [-1, 1], or None."""
    if self.video is None:
      return None
    return np.stack([to_video_frame(frame, height, width) for frame in self.video], axis=1)

  def mask_pixels(self, num_frames: int, height: int, width: int) -> np.ndarray | None:
    """float32 [3, num_frames, height, width] in [0, 1] (diffusers: clamp((m + 1) / 2, 0, 1)), or None."""
    if self.mask is None:
      return None
    frames = [np.clip((to_video_frame(frame, height, width) + 1) / 2, 0, 1) for frame in self.mask]
    return np.stack(frames * num_frames if len(frames) == 1 else frames, axis=1)

  def reference_pixels(self, height: int, width: int, spatial_factor: int) -> list[np.ndarray]:
    """Each reference on its canvas: float32 [3, height, width] in [-1, 1] (see the module docstring)."""
    return [reference_canvas(r, height, width, spatial_factor) for r in self.references]


def reference_canvas(image: np.ndarray, height: int, width: int, spatial_factor: int) -> np.ndarray:
  """One reference image as diffusers' `preprocess_conditions` places it: float32 [3, height, width]."""
  h0, w0 = image.shape[:2]
  h8, w8 = max(h0 // spatial_factor, 1) * spatial_factor, max(w0 // spatial_factor, 1) * spatial_factor
  pixels = to_video_frame(image, h8, w8)
  scale = min(height / h8, width / w8)
  new_h, new_w = int(h8 * scale), int(w8 * scale)
  canvas = np.ones((3, height, width), np.float32)
  top, left = (height - new_h) // 2, (width - new_w) // 2
  canvas[:, top:top + new_h, left:left + new_w] = bilinear(pixels, new_h, new_w)
  return canvas


def bilinear(image_CHW: np.ndarray, height: int, width: int) -> np.ndarray:
  """float32 [C, height, width]: torch's `interpolate(mode="bilinear", align_corners=False)` without
  antialiasing (half-pixel centres, edge rows clamped), computed as torch does in float32."""
  def axis(out: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale = np.float32(size / out)
    src = np.maximum(scale * (np.arange(out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    low = src.astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    return low, high, (src - low).astype(np.float32)

  y0, y1, ly = axis(height, image_CHW.shape[1])
  x0, x1, lx = axis(width, image_CHW.shape[2])
  img = np.asarray(image_CHW, np.float32)
  top = img[:, y0][:, :, x0] * (1 - lx) + img[:, y0][:, :, x1] * lx
  bottom = img[:, y1][:, :, x0] * (1 - lx) + img[:, y1][:, :, x1] * lx
  return (top * (1 - ly)[:, None] + bottom * ly[:, None]).astype(np.float32)


def check_vace_inputs(video: Any, mask: Any, reference_images: Any, conditioning_scale: Any, *,
                      num_frames: int | None, vace_layers: tuple[int, ...] | None,
                      temporal_factor: int) -> VACEInputs | None:
  """The VACE arguments checked against each other and the model.

  Args:
    num_frames: the call's frames (None: the video's, else 81), after rounding to 4k + 1.
    vace_layers: the model's VACE layers (`WanTransformerConfig.vace_layers`: V of them); None: it
      has none (then `video` is another conditioning's, e.g. video-to-video's: not checked here).
    temporal_factor: frames per latent frame after the first (4).

  Returns:
    The `VACEInputs` (its video holds 4k + 1 frames), or None for a model without VACE blocks.

  Raises:
    ValueError: naming the argument and the fix: a VACE-only argument (mask, reference_images, a
      conditioning_scale other than 1) on a model without VACE blocks, a mask without a video,
      frames not in an image form, a video whose length (its 4k + 1 first frames: the rest are dropped with a warning, as
      diffusers' VAE drops them) differs from num_frames, a mask whose length is neither 1 nor the
      video's or whose size is not the video's, reference images that are not images, a scale that
      is not a finite number or one per VACE block.
  """
  if vace_layers is None:
    _refuse_without_vace(mask, reference_images, conditioning_scale)
    return None
  scale = _scale(conditioning_scale, len(vace_layers))
  references = _references(reference_images)
  if video is None:
    if mask is not None:
      raise ValueError("mask given without video: a mask marks which pixels of the video to generate; give the "
                       "video too (diffusers refuses a mask alone as well)")
    return VACEInputs(video=None, mask=None, references=references, scale=scale)
  frames = video_frames("video", video)
  masks = None if mask is None else video_frames("mask", [mask] if _is_image(mask) else mask)
  used = (len(frames) - 1) // temporal_factor * temporal_factor + 1
  if used != len(frames):
    warnings.warn(f"video has {len(frames)} frames; the VAE encodes 4k + 1 of them, so the last {len(frames) - used} "
                  "(and the mask's) are not used", stacklevel=3)
    masks = masks if masks is None or len(masks) != len(frames) else masks[:used]
    frames = frames[:used]
  if num_frames is not None and len(frames) != num_frames:
    raise ValueError(f"video has {len(frames)} frames but num_frames={num_frames}: give a video of num_frames "
                     "(4k + 1) frames, or leave num_frames out to take the video's length")
  if masks is not None:
    if len(masks) not in (1, len(frames)) or masks.shape[1:3] != frames.shape[1:3]:
      raise ValueError(f"mask is {len(masks)} frame(s) of {masks.shape[2]}x{masks.shape[1]}; it must be one image "
                       f"or {len(frames)} frames (the video's) of the video's size {frames.shape[2]}x{frames.shape[1]}")
  return VACEInputs(video=frames, mask=masks, references=references, scale=scale)


def _refuse_without_vace(mask: Any, reference_images: Any, conditioning_scale: Any) -> None:
  given = [f"{name}={_shown(value)}" for name, value in (("mask", mask), ("reference_images", reference_images))
           if value is not None]
  if not (is_real(conditioning_scale) and conditioning_scale == 1.0):
    given.append(f"conditioning_scale={_shown(conditioning_scale)}")
  if given:
    raise ValueError(f"{', '.join(given)} given, but this model has no VACE blocks (they condition a VACE model: "
                     "WanVACEPipeline of a Wan VACE folder); leave them out")


def _shown(value: Any) -> str:
  """A value for a message: an array as its shape and dtype (a list of them element-wise), else its
  short repr."""
  if isinstance(value, np.ndarray):
    return f"<{value.dtype} array {list(value.shape)}>"
  if isinstance(value, (list, tuple)) and any(isinstance(v, np.ndarray) for v in value):
    return f"[{', '.join(_shown(v) for v in value)}]"
  return reprlib.repr(value)


def _is_image(value: Any) -> bool:
  return hasattr(value, "convert") or (isinstance(value, np.ndarray) and value.ndim in (2, 3))


def _references(reference_images: Any) -> tuple[np.ndarray, ...]:
  if reference_images is None:
    return ()
  items = [reference_images] if _is_image(reference_images) else reference_images
  if not isinstance(items, (list, tuple)):
    raise ValueError(f"reference_images={reference_images!r} must be an image or a list of images"
                     f"{not_a(reference_images)}")
  return tuple(image_array(f"reference_images[{i}]", image) for i, image in enumerate(items))


def _scale(conditioning_scale: Any, layers: int) -> tuple[float, ...]:
  values = list(conditioning_scale) if isinstance(conditioning_scale, (list, tuple, np.ndarray)) else None
  if values is None:
    values = [conditioning_scale] * layers
  if len(values) != layers or not all(is_real(v) and math.isfinite(v) for v in values):
    raise ValueError(f"conditioning_scale={conditioning_scale!r} must be a finite number or {layers} of them (one "
                     "per VACE layer)")
  return tuple(float(v) for v in values)


def conditioning(vae: Any, request: Any, stage: Any) -> Any:
  """The step's condition of a VACE model's request (`wan.conditioning.VACEConditioning`): the VACE
  context of `request.vace` encoded (`wan.conditioning.vace_context`; `stage(line)` announces it),
  one row per video, and the scales."""
  import jax.numpy as jnp

  from pipelines.wan.conditioning import VACEConditioning, vace_context

  inputs = request.vace
  frames = request.num_frames
  stage(f"VACE encode: {'a video' if inputs.video is not None else 'no video'}, "
        f"{'a mask' if inputs.mask is not None else 'no mask'}, {len(inputs.references)} reference image(s) at "
        f"{request.width}x{request.height} (VAE)")
  context = vace_context(vae, inputs.video_pixels(request.height, request.width),
                              inputs.mask_pixels(frames, request.height, request.width),
                              inputs.reference_pixels(request.height, request.width, vae.config.spatial_factor),
                              num_frames=frames, height=request.height, width=request.width)
  return VACEConditioning(context_BCFHW=jnp.asarray(np.repeat(context, request.videos, axis=0)),
                               scale_V=jnp.asarray(inputs.scale, jnp.float32), references=len(inputs.references))
