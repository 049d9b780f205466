"""VACE conditioning (diffusers' `WanVACEPipeline`): the VACE context a VACE transformer reads every
step (`vace_context`), from a video, its mask and reference images, and the step inputs it makes
(`VACEConditioning`).

Glossary (DESIGN.md section 1): B videos, C latent channels, F / Hl / Wl latent frames / height /
width, s the VAE's spatial factor (8), n reference images, Cv = 2 C + s^2 context channels (96).

Math (diffusers `pipelines/wan/pipeline_wan_vace.py`, `prepare_video_latents`, `prepare_masks`):
- the mask (1 = generate, 0 = keep) is binarised at 0.5; the video's kept part video x (1 - m)
  ("inactive") and its part to generate video x m ("reactive") are each encoded by the VAE (its
  mean, normalised): 2C channels. Without a video the video is zeros (mid-grey) and the mask ones.
- the mask (unbinarised, its first channel) at each latent pixel becomes s^2 channels (the s x s
  pixels it covers, row-major within the patch) and is resampled in time to the F latent frames
  (torch's `interpolate(mode="nearest-exact")`: frame i takes frame floor((i + 1/2) x frames / F)).
- each reference image (on a white canvas of the video's size) is encoded as a one-frame video;
  its latent frame, with C zero channels after it and a zero mask, is put in front of the video's
  latent frames, each one in front of the previous ones (so the last reference comes first). The
  noise latents then have n more latent frames, which are dropped before decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan import vae as wan_vae
from pipelines.wan.conditioning.inputs import StepInputs
from pipelines.wan.conditioning.video import encode_video


def mask_channels(mask_FHW: np.ndarray, temporal_factor: int, spatial_factor: int) -> np.ndarray:
  """float32 [s^2, F, Hl, Wl]: a pixel mask [frames, H, W] as the VACE context's mask channels
  (`prepare_masks`): each latent pixel's s x s pixels as channels, frames resampled nearest-exact to
  F = (frames + temporal_factor - 1) // temporal_factor.

  Raises:
    ValueError: H or W not a multiple of `spatial_factor`.
  """
  frames, h, w = mask_FHW.shape
  s = spatial_factor
  if h % s or w % s:
    raise ValueError(f"mask size {h}x{w} must be a multiple of the VAE's spatial factor {s}")
  latent_frames = (frames + temporal_factor - 1) // temporal_factor
  m = np.asarray(mask_FHW, np.float32).reshape(frames, h // s, s, w // s, s).transpose(2, 4, 0, 1, 3)
  m = m.reshape(s * s, frames, h // s, w // s)
  source = np.minimum(np.floor((np.arange(latent_frames) + 0.5) * (frames / latent_frames)).astype(int), frames - 1)
  return np.ascontiguousarray(m[:, source])


def vace_context(vae: wan_vae.WanVAE, video: np.ndarray | None, mask: np.ndarray | None,
                 references: list[np.ndarray], *, num_frames: int, height: int, width: int) -> np.ndarray:
  """The VACE context float32 [1, Cv, n + F, Hl, Wl] (see the module docstring).

  Args:
    vae: the pipeline's VAE (encodes on one device, in its dtype).
    video: float32 [3, frames, height, width] in [-1, 1], or None (zeros).
    mask: float32 [3, frames, height, width] in [0, 1] (1: generate; each channel masks its video
      channel, the first channel makes the mask channels, as diffusers), or None (ones).
    references: float32 [3, height, width] in [-1, 1] each (already on their canvas).
    num_frames: frames of the video (4k + 1).

  Raises:
    ValueError: shapes that do not fit num_frames x height x width.
  """
  video = np.zeros((3, num_frames, height, width), np.float32) if video is None else np.asarray(video, np.float32)
  mask = np.ones_like(video) if mask is None else np.asarray(mask, np.float32)
  if video.shape != (3, num_frames, height, width) or mask.shape != video.shape:
    raise ValueError(f"video {video.shape} and mask {mask.shape} must both be [3, {num_frames}, {height}, {width}]")
  binary = np.where(mask > 0.5, np.float32(1), np.float32(0))
  inactive = encode_video(vae, (video * (1 - binary))[None])
  reactive = encode_video(vae, (video * binary)[None])
  latents = np.concatenate([inactive, reactive], axis=1)  # [1, 2C, F, Hl, Wl]
  for reference in references:
    ref = encode_video(vae, np.asarray(reference, np.float32)[None, :, None])  # [1, C, 1, Hl, Wl]
    latents = np.concatenate([np.concatenate([ref, np.zeros_like(ref)], axis=1), latents], axis=2)
  channels = mask_channels(mask[0], vae.config.temporal_factor, vae.config.spatial_factor)
  channels = np.concatenate([np.zeros((channels.shape[0], len(references), *channels.shape[2:]), np.float32),
                             channels], axis=1)
  return np.concatenate([latents, channels[None]], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VACEConditioning:
  """What a VACE step adds to the transformer's inputs (a pytree: an argument of the compiled step,
  replicated over the mesh).

  Attributes:
    context_BCFHW: float32 [B, Cv, n + F, Hl, Wl] the VACE context (`vace_context`, one row per video).
    scale_V: float32 [V] the conditioning scale of each VACE block (diffusers' `conditioning_scale`).
    references: n, the reference latent frames in front of the video's (static).
  """
  context_BCFHW: jax.Array
  scale_V: jax.Array
  references: int = dataclasses.field(default=0, metadata=dict(static=True))

  def transformer_inputs(self, x_BCFHW: jax.Array, timestep_B: jax.Array, *, cfg: bool) -> StepInputs:
    """The latents and timestep unchanged, the context (doubled like x under CFG: the cond and
    uncond rows see the same context) and the scales."""
    context = self.context_BCFHW
    if cfg:
      context = jnp.concatenate([context, context], axis=0)
    return StepInputs(x_BCFHW, timestep_B, control=context, control_scale=self.scale_V)

  def image_states(self, *, cfg: bool) -> None:
    """No CLIP states: VACE conditions through its context only."""
    del cfg

  def final_latents(self, latents: jax.Array) -> jax.Array:
    """The latents the VAE decodes: the loop's without the reference frames in front."""
    return latents[:, :, self.references:]
