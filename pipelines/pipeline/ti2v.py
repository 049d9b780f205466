"""Image conditioning of a Wan 2.2 TI2V-5B run: `ti2v_condition`.

Glossary (DESIGN.md section 1): B' videos, C latent channels, F / Hl / Wl latent frames / height /
width.

A TI2V folder (model_index.json `expand_timesteps: true`) loads as a `WanPipeline`; without an
image it is text-to-video (every token at the step's timestep). With an image, diffusers'
`WanImageToVideoPipeline` (`expand_timesteps=True`) encodes the first frame with the VAE and keeps
it fixed: the first latent frame's tokens run at t = 0 and that frame of the transformer's input
is the image's latents at every step (`wan.ti2v`). Here that is a request field:

    request = GenerationRequest.build(pipe.facts, prompt, height=704, width=1280, ...)
    request = ti2v_condition(pipe.vae, request, image)   # image: [1 or B', 3, 704, 1280] in [-1, 1]
    frames = pipe.generate(request).frames

The request carries the image's latents (`first_frame_latents`); `WanPipeline.conditioning` turns
them into the step's `condition` (`wan.ti2v.TI2VConditioning`, replicated, not donated).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pipelines.pipeline.request import GenerationRequest
from pipelines.wan import ti2v, vae as wan_vae


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
      through the transformer's channels and CLIP instead), an image of another size or batch, or
      one `wan.ti2v.encode_image` refuses. All before the VAE runs.
  """
  if not request.model.expand_timesteps:
    raise ValueError(f"{request.model.name!r} is not a Wan 2.2 TI2V model (model_index.json has no "
                     "expand_timesteps: true); first-frame conditioning by timestep needs one")
  shape = np.shape(image)
  want = (request.height, request.width)
  if len(shape) != 4 or tuple(shape[2:]) != want or shape[0] not in (1, request.videos):
    raise ValueError(f"image shape {shape} must be [1 or {request.videos}, 3, {want[0]}, {want[1]}] "
                     "(the call's height and width; resize the image first)")
  latents = ti2v.encode_image(vae, image)
  latents = np.ascontiguousarray(np.broadcast_to(latents, (request.videos, *latents.shape[1:])))
  expected = (request.videos, request.latent_shape[1], 1, *request.latent_shape[3:])
  if latents.shape != expected:
    raise ValueError(f"the image's latents {latents.shape} do not fit the request's {expected} (another "
                     "VAE than the pipeline's?)")
  return dataclasses.replace(request, first_frame_latents=latents.astype(np.float32))
