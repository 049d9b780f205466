"""Wan image-to-video (diffusers' `WanImageToVideoPipeline`): Wan 2.1 I2V 14B (CLIP image branch),
Wan 2.1 FLF2V 14B (first and last frame) and Wan 2.2 I2V A14B (two experts, no image encoder).

Everything but the conditioning is `WanPipeline`'s: the request (with its `image`, `last_image`,
`image_embeds`), the runner, the compiled step, the loop and its hooks, decoding. What this class
adds is the conditioning stage (`conditioning`), run once before the denoising loop:
1. the images resized to the video's size and mapped to [-1, 1]; the condition video (first image,
   zeros, last image) encoded by the VAE (its mean, normalised) with the mask channels in front
   (`encode_condition`; diffusers `prepare_latents`);
2. with an image branch (Wan 2.1), the images through transformers' `CLIPImageProcessor` and our
   CLIP vision encoder (penultimate states; diffusers `encode_image`), or `image_embeds` as given;
and each step the transformer sees [noise; mask; condition latents] and attends to the image
states (`ImageConditioning`, an argument of the compiled step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pipelines.pipeline.checked.image_inputs import clip_pixels, to_video_frame
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.wan_pipeline import WanPipeline
from pipelines.wan.encoders import CLIPVision, penultimate_states
from pipelines.wan.conditioning import ImageConditioning, encode_condition


class WanImageToVideoPipeline(WanPipeline):
  """Image-to-video Wan; build with `from_pretrained(folder)` of a diffusers
  `WanImageToVideoPipeline` folder, call with an image and prompts (`__call__`).

  Attributes (besides `WanPipeline`'s):
    image_encoder: the CLIP vision encoder (`CLIPVision`), None without an image branch.
    image_processor: transformers' `CLIPImageProcessor`, None without an image branch.
  """

  image_to_video = True

  def __init__(self, *, image_encoder: CLIPVision | None = None, image_processor: Any = None,
               **parts: Any):
    super().__init__(**parts)
    branch = self.transformer_config.has_image_branch
    if branch and (image_encoder is None or image_processor is None):
      raise ValueError("this transformer has an image branch (Wan 2.1 I2V / FLF2V): give image_encoder and "
                       "image_processor (the folder's image_encoder/ and image_processor/)")
    if branch and image_encoder.config.hidden_size != self.transformer_config.image_dim:
      raise ValueError(f"image encoder width {image_encoder.config.hidden_size} != transformer image_dim="
                       f"{self.transformer_config.image_dim}")
    self.image_encoder = image_encoder if branch else None
    self.image_processor = image_processor if branch else None

  def __call__(self, image: Any = None, prompt: Any = None, negative_prompt: Any = None, height: int | None = None,
               width: int | None = None, num_frames: int | None = None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
               seed: int | Sequence[int] | None = None, latents: Any = None, max_sequence_length: int | None = None,
               mesh: Any = None, *, last_image: Any = None, image_embeds: Any = None, **kwargs: Any) -> Any:
    """Generates videos from an image; diffusers `WanImageToVideoPipeline.__call__(...).frames`.

    Args:
      image: the first frame (`image_inputs.IMAGE_FORMS`: PIL, numpy uint8 or float in [0, 1], HWC).
      last_image: the last frame (FLF2V folders; Wan 2.2 I2V A14B conditions on it too).
      image_embeds: CLIP penultimate states [1 or 2, J, image_dim] instead of encoding the images
        (Wan 2.1 I2V / FLF2V; `image` is still needed for the condition latents).
      the rest: as `WanPipeline.__call__` (`call_options.CALL_DOCS`).

    Returns and Raises:
      as `WanPipeline.__call__`; also ValueError for missing or bad images (before any compute).
    """
    return super().__call__(prompt, negative_prompt, height, width, num_frames, num_inference_steps,
                            guidance_scale, seed, latents, max_sequence_length, mesh, image=image,
                            last_image=last_image, image_embeds=image_embeds, **kwargs)

  def _conditioning_weights(self) -> dict[str, Any]:
    """The CLIP image encoder's weights (Wan 2.1), in the fingerprint."""
    return {} if self.image_encoder is None else {"image_encoder": self.image_encoder.params}

  def conditioning(self, request: GenerationRequest, stage: Any) -> ImageConditioning:
    """The request's images encoded: the condition latents with their mask channels, one row per
    video, and (Wan 2.1) the CLIP image states in the model dtype.

    A Wan 2.2 TI2V folder (`expand_timesteps`) conditions as `WanPipeline` does (`pipeline.run.ti2v`):
    the first frame's latents and per-token timesteps, its image optional.

    Raises:
      ValueError: a request without images (built for a text-to-video model).
    """
    if self.expand_timesteps:
      return super().conditioning(request, stage)
    inputs = request.image
    if inputs is None:
      raise ValueError("an image-to-video request needs `image` (GenerationRequest.build(pipe.facts, image=...))")
    frames = [inputs.image] + ([] if inputs.last_image is None else [inputs.last_image])
    stage(f"image encode: {len(frames)} image(s) at {request.width}x{request.height} (VAE"
          f"{', CLIP' if self.image_encoder is not None and inputs.image_embeds is None else ''})")
    first, *last = (to_video_frame(f, request.height, request.width) for f in frames)
    video = encode_condition(self.vae, first, last[0] if last else None, request.num_frames)
    video = np.repeat(video, request.videos, axis=0)
    states = None
    if self.image_encoder is not None:
      states = inputs.image_embeds
      if states is None:
        states = penultimate_states(self.image_encoder, jnp.asarray(clip_pixels(self.image_processor,
                                                                                            frames)))
      states = jnp.tile(jnp.asarray(states), (request.videos, 1, 1)).astype(self.dtype)  # [B' x frames, J, I]
    return ImageConditioning(video_BCFHW=jnp.asarray(video), image_BJI=states)
