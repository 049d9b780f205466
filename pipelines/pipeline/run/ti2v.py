"""Image conditioning of a Wan 2.2 TI2V-5B run: the step's `condition` (`conditioning`) and
`ti2v_condition`.

Glossary (DESIGN.md section 1): B' videos, C latent channels, F / Hl / Wl latent frames / height /
width.

A TI2V folder (model_index.json `expand_timesteps: true`) loads as a `WanPipeline`; without an
image it is text-to-video (every token at the step's timestep). With an image, diffusers'
`WanImageToVideoPipeline` (`expand_timesteps=True`) encodes the first frame with the VAE and keeps
it fixed: the first latent frame's tokens run at t = 0 and that frame of the transformer's input
is the image's latents at every step (`wan.conditioning.ti2v`). Here the image is the request's `image` (as for
image-to-video: `pipe(prompt, image=...)` on a `WanPipeline` or `WanImageToVideoPipeline` of the
folder, `generate --image`), resized to the video and encoded by `conditioning`; or, already
preprocessed, its latents set by `ti2v_condition`:

    request = GenerationRequest.build(pipe.facts, prompt, height=704, width=1280, ...)
    request = ti2v_condition(pipe.vae, request, image)   # image: [1 or B', 3, 704, 1280] in [-1, 1]
    frames = pipe.generate(request).frames

`conditioning` (called by `WanPipeline.conditioning` once before the loop) makes the step's
`condition`: `wan.conditioning.TI2VConditioning`, replicated, not donated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import jax.numpy as jnp

from pipelines.pipeline.checked.image_inputs import to_video_frame
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.wan import vae as wan_vae
from pipelines.wan.conditioning import TI2VConditioning, encode_image


def conditioning(vae: wan_vae.WanVAE, request: GenerationRequest, patch_size: tuple[int, int, int],
                 stage: Any) -> TI2VConditioning:
  """The step's condition of a TI2V model's request (or a context window's that continues the one
  before): the first Fg frames' latents float32 [B', C, Fg, Hl, Wl] from `request.first_frame_latents`, or `request.image` resized to the video, mapped to
  [-1, 1] and encoded (`wan.conditioning.encode_image`; `stage(line)` announces it), or none (text-to-video:
  per-token timesteps all t)."""
  first = request.first_frame_latents
  if first is None and request.image is not None:
    stage(f"image encode: 1 image at {request.width}x{request.height} (VAE)")
    frame = to_video_frame(request.image.image, request.height, request.width)
    first = np.repeat(encode_image(vae, frame[None]), request.videos, axis=0)
  return TI2VConditioning(patch_size=tuple(patch_size),
                               first_frame_BCFHW=None if first is None else jnp.asarray(first, jnp.float32))


def ti2v_condition(vae: wan_vae.WanVAE, request: GenerationRequest, image: Any) -> GenerationRequest:
  """`request` conditioned on a first frame (diffusers' `WanImageToVideoPipeline` with a TI2V folder).

  Args:
    vae: the pipeline's VAE (`pipe.vae`).
    request: a checked request of a TI2V model (`request.model.expand_timesteps`).
    image: float [1, 3, height, width] (one image for every video, as diffusers repeats it) or
      [B', 3, height, width], in [-1, 1] at the request's height and width (diffusers'
      `VideoProcessor.preprocess` output).

  Returns:
    The request with `first_frame_latents` set (float32 [B', C, 1, Hl, Wl]); its settings and
    resume identity include their digest.

  Raises:
    ValueError: a model without `expand_timesteps` (Wan 2.1 / 2.2 A14B image-to-video conditions
      through the transformer's channels and CLIP instead), a request with `image` already, an
      image of another size or batch, or one `wan.conditioning.encode_image` refuses. All before the VAE
      runs.
  """
  if not request.model.expand_timesteps:
    raise ValueError(f"{request.model.name!r} is not a Wan 2.2 TI2V model (model_index.json has no "
                     "expand_timesteps: true); first-frame conditioning by timestep needs one")
  if request.image is not None:
    raise ValueError("the request already has an `image` (encoded by the pipeline); give the image once")
  shape = np.shape(image)
  want = (request.height, request.width)
  if len(shape) != 4 or tuple(shape[2:]) != want or shape[0] not in (1, request.videos):
    raise ValueError(f"image shape {shape} must be [1 or {request.videos}, 3, {want[0]}, {want[1]}] "
                     "(the call's height and width; resize the image first)")
  latents = encode_image(vae, image)
  latents = np.ascontiguousarray(np.broadcast_to(latents, (request.videos, *latents.shape[1:])))
  expected = (request.videos, request.latent_shape[1], 1, *request.latent_shape[3:])
  if latents.shape != expected:
    raise ValueError(f"the image's latents {latents.shape} do not fit the request's {expected} (another "
                     "VAE than the pipeline's?)")
  return dataclasses.replace(request, first_frame_latents=latents.astype(np.float32))
