"""Wan 2.2 TI2V-5B's per-token timesteps and first-frame image conditioning (the model math).

Glossary (DESIGN.md section 1): B videos, C latent channels, F / Hl / Wl latent frames / height /
width, T video tokens = F (Hl / ph) (Wl / pw).

Source: diffusers `WanPipeline.__call__` and `WanImageToVideoPipeline.__call__` /
`prepare_latents` with `expand_timesteps=True` (pipelines/wan/pipeline_wan.py,
pipeline_wan_i2v.py). A TI2V folder's transformer takes one timestep per token:

  first_frame_mask = ones(1, 1, F, Hl, Wl); with an image: first_frame_mask[:, :, 0] = 0
  timestep = (first_frame_mask[0][0][:, ::2, ::2] * t).flatten()        # [T], per batch row
  latent_model_input = (1 - first_frame_mask) * condition + first_frame_mask * latents

so text-to-video runs every token at t, and image-to-video runs the first latent frame's tokens at
t = 0 with that frame replaced by the encoded image in the transformer's input at every step (the
scheduler still steps the whole latents; the replacement is applied once more before decoding).
The encoded image is `(vae.encode(image).mode() - latents_mean) / latents_std` (`encode_image`).

`TI2VConditioning` carries this into the denoise step as its `condition` argument (the same place
as image-to-video's `image.ImageConditioning`): `transformer_inputs` gives the
transformer's input and per-token timesteps, `final_latents` the last replacement.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan import vae as wan_vae
from pipelines.wan.conditioning.inputs import StepInputs
from pipelines.wan.transformer import TokenTimesteps


def first_frame_mask(latent_shape: tuple[int, ...], given: int) -> jax.Array:
  """float32 [1, 1, F, Hl, Wl]: 0 on the first `given` latent frames (1: an image's; more: a context
  window's overlap with the one before, `context_fuse="continue"`), 1 on the rest."""
  _, _, f, h, w = latent_shape
  frames = jnp.arange(f) >= given
  return jnp.broadcast_to(frames.astype(jnp.float32)[:, None, None], (1, 1, f, h, w))


def per_token_timesteps(t_B: jax.Array, latent_shape: tuple[int, ...], patch_size: tuple[int, int, int],
                        given: int) -> TokenTimesteps:
  """diffusers' `expand_timesteps` timestep: [B] step timesteps -> the per-token timesteps [B, T] as
  `TokenTimesteps` (levels float32 [B, 2] = (0 t, 1 t), index int32 [B, T] = the mask).

  Token (f, h, w) in row-major order (the transformer's token order) gets `mask[f, h * ph, w *
  pw] * t`, i.e. t everywhere (`given` 0: text-to-video), or 0 on the first `given` latent frames'
  (Hl / ph) (Wl / pw) tokens each (1: the image's): the mask is 0 or 1, so each token's value is
  one of the two levels, computed by diffusers' own product (`.dense()` writes them out). The
  index is built from an iota inside the jitted step; under a mesh the transformer pins it to the
  tokens' sharding and embeds only the two levels (`transformer.model.embed`).

  Raises:
    ValueError: a latent grid the patch size does not divide.
  """
  pt, ph, pw = patch_size
  _, _, f, h, w = latent_shape
  if f % pt or h % ph or w % pw:
    raise ValueError(f"latent grid (F, Hl, Wl)={(f, h, w)} is not divisible by {patch_size=}")
  mask = first_frame_mask(latent_shape, given)[0, 0, ::pt, ::ph, ::pw].reshape(-1)  # [T]
  t = t_B.astype(jnp.float32)[:, None]
  levels = jnp.asarray([0.0, 1.0], jnp.float32)[None, :] * t  # the mask's two values times t
  index = jnp.broadcast_to(mask.astype(jnp.int32)[None, :], (t_B.shape[0], mask.shape[0]))
  return TokenTimesteps(levels, index)


def model_input(latents: jax.Array, condition: jax.Array | None) -> jax.Array:
  """The transformer's input: `(1 - mask) * condition + mask * latents` (diffusers' formula, fp32),
  the mask 0 on the condition's frames.

  Args:
    latents: [B, C, F, Hl, Wl] the denoising latents.
    condition: [B, C, Fg, Hl, Wl] normalised latents of the first Fg <= F frames (1: an image's), or
      None (text only: the latents unchanged).

  Returns:
    [B, C, F, Hl, Wl] in latents' dtype: the first Fg frames are the condition's.
  """
  if condition is None:
    return latents
  given = condition.shape[2]
  mask = first_frame_mask(latents.shape, given)
  pad = [(0, 0), (0, 0), (0, latents.shape[2] - given), (0, 0), (0, 0)]
  condition = jnp.pad(condition.astype(latents.dtype), pad)
  return ((1 - mask) * condition + mask * latents).astype(latents.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TI2VConditioning:
  """The step's conditioning of a Wan 2.2 TI2V model (a pytree: an argument of the compiled step,
  replicated over the mesh).

  Attributes:
    patch_size: the transformer's (pt, ph, pw) (static).
    first_frame_BCFHW: float32 [B, C, Fg, Hl, Wl] normalised latents of the first Fg frames, given
      (one row per video): Fg = 1 an image's (`encode_image`), more a context window's overlap with
      the window before (`context_fuse="continue"`); or None (text-to-video: every token at t).
  """
  patch_size: tuple[int, int, int] = dataclasses.field(metadata={"static": True})
  first_frame_BCFHW: jax.Array | None = None

  def transformer_inputs(self, x_BCFHW: jax.Array, timestep_B: jax.Array, *, cfg: bool) -> StepInputs:
    """The `StepInputs` (latents, per-token timesteps [B, T] as `TokenTimesteps`) the transformer sees for the
    step's latents x (already doubled to [cond; uncond] under CFG): x with its first Fg frames
    replaced by the given latents (`model_input`), 0 on their tokens, t on the rest.

    The replacement after the cast to the model dtype equals diffusers' (mask 0 or 1 picks one
    value, then `.to(transformer_dtype)` rounds it once either way)."""
    condition = self.first_frame_BCFHW
    if condition is not None and cfg:
      condition = jnp.concatenate([condition, condition], axis=0)
    x = model_input(x_BCFHW, condition)
    timestep = per_token_timesteps(timestep_B, x.shape, self.patch_size,
                                   given=0 if condition is None else condition.shape[2])
    return StepInputs(x, timestep)

  def image_states(self, *, cfg: bool) -> None:
    """No CLIP states: TI2V conditions through the latents and timesteps only."""
    del cfg

  def final_latents(self, latents: jax.Array) -> jax.Array:
    """The latents the VAE decodes: [B, C, F, Hl, Wl] with the first Fg frames replaced once more by
    the given latents (diffusers, after the loop), unchanged without them."""
    return model_input(latents, self.first_frame_BCFHW)


def encode_image(vae: wan_vae.WanVAE, image: np.ndarray) -> np.ndarray:
  """The conditioning latents of a first frame: float32 numpy [B, C, 1, Hl, Wl].

  Args:
    vae: the TI2V folder's VAE (the Wan 2.2 VAE: 16 pixels per latent).
    image: float [B, 3, height, width] in [-1, 1] (diffusers' `VideoProcessor.preprocess` output;
      resizing a PIL image to the call's size is the caller's), height and width multiples of
      `vae.config.spatial_factor`.

  Returns:
    `normalize_latents(vae.encode(image[:, :, None]).mean)` in float32, as diffusers'
    `prepare_latents` (`retrieve_latents(..., sample_mode="argmax")`, then `(x - mean) * (1 / std)`).

  Raises:
    ValueError: an image that is not [B, 3, H, W], is not finite, or lies outside [-1, 1]; sizes
      as `vae.encode`.
  """
  image = np.asarray(image, np.float32)
  if image.ndim != 4 or image.shape[1] != vae.config.video_channels:
    raise ValueError(f"image must be [B, {vae.config.video_channels}, height, width] in [-1, 1], "
                     f"got shape {image.shape}")
  if not np.isfinite(image).all() or np.abs(image).max() > 1.0:
    raise ValueError("image values must be finite and in [-1, 1] (diffusers' preprocessed image: "
                     "2 * pixels / 255 - 1)")
  latent = wan_vae.encode(vae, jnp.asarray(image[:, :, None])).mean.astype(jnp.float32)
  return np.asarray(wan_vae.normalize_latents(vae.config, latent))
