"""Image-to-video conditioning of Wan 2.1 I2V / FLF2V and Wan 2.2 I2V A14B: the condition video's
latents with their mask channels, and the transformer inputs they make (`ImageConditioning`).

Glossary (DESIGN.md section 1): B videos, C latent channels (the VAE's z_dim), F / Hl / Wl latent
frames / height / width, M = the VAE's temporal factor (4) mask channels, J image tokens per frame, I the
image states' width.

Math: diffusers pipelines/wan/pipeline_wan_i2v.py `prepare_latents` and the loop body. The condition
video is the first image, then zeros, then (FLF2V) the last image, [1, 3, frames, H, W] in [-1, 1];
its VAE mean (`.mode()`), normalised with the VAE statistics, is the condition latents [1, C, F,
Hl, Wl]. The mask marks the given frames: one value per video frame (1 at frame 0 and, FLF2V, at
the last frame), frame 0 repeated M times, so 4F values, read as [F, M] and transposed to M
channels [1, M, F, Hl, Wl]. Each step the transformer sees [noise latents; mask; condition] along
channels (C + M + C = 36 for Wan), the same for the cond and uncond rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan import vae as wan_vae
from pipelines.wan.conditioning.inputs import StepInputs


def mask_channels(num_frames: int, temporal_factor: int, latent_height: int, latent_width: int, *,
                  last_frame: bool) -> np.ndarray:
  """The mask channels float32 [1, M, F, Hl, Wl] of a `num_frames` (M k + 1) video: 1 where a frame
  is given (frame 0; the last frame too with `last_frame`), as diffusers' `mask_lat_size`."""
  given = np.zeros(num_frames, np.float32)
  given[0] = 1.0
  if last_frame:
    given[-1] = 1.0
  given = np.concatenate([np.repeat(given[:1], temporal_factor), given[1:]])  # [M F]
  mask_FM = given.reshape(-1, temporal_factor)
  return np.ascontiguousarray(np.broadcast_to(mask_FM.T[None, :, :, None, None],
                                              (1, temporal_factor, mask_FM.shape[0], latent_height, latent_width)))


def condition_video(first_3HW: np.ndarray, last_3HW: np.ndarray | None, num_frames: int) -> np.ndarray:
  """[1, 3, frames, H, W] float32: the first image, zeros, and the last image (FLF2V) in the last
  frame; images float32 [3, H, W] in [-1, 1]."""
  video = np.zeros((1, 3, num_frames, *first_3HW.shape[1:]), np.float32)
  video[0, :, 0] = first_3HW
  if last_3HW is not None:
    video[0, :, -1] = last_3HW
  return video


def encode_condition(vae: wan_vae.WanVAE, first_3HW: np.ndarray, last_3HW: np.ndarray | None,
                     num_frames: int) -> np.ndarray:
  """The channels appended to the noise: float32 [1, M + C, F, Hl, Wl] = [mask; condition latents].

  Args:
    vae: the pipeline's VAE (its encoder runs on one device, in the VAE's dtype).
    first_3HW, last_3HW: float32 [3, H, W] in [-1, 1] at the video's size (last: FLF2V, or None).
    num_frames: M k + 1.

  Raises:
    ValueError: as `vae.encode` (a size that is not a multiple of the spatial factor).
  """
  video = condition_video(first_3HW, last_3HW, num_frames)
  latents = wan_vae.encode(vae, jnp.asarray(video)).mean
  latents = np.asarray(wan_vae.normalize_latents(vae.config, latents.astype(jnp.float32)), np.float32)
  _, _, _, hl, wl = latents.shape
  mask = mask_channels(num_frames, vae.config.temporal_factor, hl, wl, last_frame=last_3HW is not None)
  return np.concatenate([mask, latents], axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ImageConditioning:
  """What an image-conditioned step adds to the transformer's inputs (a pytree: an argument of the
  compiled step, replicated over the mesh).

  Attributes:
    video_BCFHW: float32 [B, M + C, F, Hl, Wl] mask + condition latents (`encode_condition`, one
      row per video), appended to the noise along channels.
    image_BJI: [B or 2B, J, I] CLIP image states in the model dtype (Wan 2.1 I2V: one row per video;
      FLF2V: two, first and last frame), or None (Wan 2.2 I2V A14B has no image branch).
  """
  video_BCFHW: jax.Array
  image_BJI: jax.Array | None = None

  def transformer_inputs(self, x_BCFHW: jax.Array, timestep_B: jax.Array, *, cfg: bool) -> StepInputs:
    """The `StepInputs` (latents, timestep, image states) the transformer sees for the step's latents x (already
    doubled to [cond; uncond] under CFG): [x; mask; condition] along channels in x's dtype, the
    timestep unchanged, the image states doubled like x under CFG (`image_states`)."""
    video = self.video_BCFHW.astype(x_BCFHW.dtype)
    if cfg:
      video = jnp.concatenate([video, video], axis=0)
    return StepInputs(jnp.concatenate([x_BCFHW, video], axis=1), timestep_B, self.image_states(cfg=cfg))

  def image_states(self, *, cfg: bool) -> jax.Array | None:
    """The CLIP states the transformer's cross-attention sees ([B or 2B, J, I], FLF2V twice the
    rows; [cond; uncond] copies under CFG), or None without an image branch: what the pipeline
    turns into the image K/V once before the loop (`transformer.text_kv`)."""
    image = self.image_BJI
    return jnp.concatenate([image, image], axis=0) if cfg and image is not None else image

  def final_latents(self, latents: jax.Array) -> jax.Array:
    """The latents the VAE decodes: the loop's latents unchanged (the condition rides in extra
    channels, not in the latents)."""
    return latents
