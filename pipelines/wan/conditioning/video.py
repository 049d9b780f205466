"""Video-to-video's start (diffusers' `WanVideoToVideoPipeline.prepare_latents`): the input video
encoded by the VAE (the posterior mean, normalised) and noised to the first running step's sigma,
x = (1 - sigma) x0 + sigma noise, the flow-matching schedulers' `add_noise` / `scale_noise`.

Glossary (DESIGN.md section 1): B' videos, C latent channels, F / Hl / Wl latent frames / height /
width.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pipelines.wan import vae as wan_vae


def encode_video(vae: wan_vae.WanVAE, pixels: np.ndarray) -> np.ndarray:
  """float32 numpy [1, C, F, Hl, Wl]: `normalize_latents(vae.encode(pixels).mean)`, as diffusers'
  `retrieve_latents(..., sample_mode="argmax")` then `(x - mean) * (1 / std)`.

  Args:
    pixels: float [1, 3, frames, height, width] in [-1, 1], frames = 4k + 1 (`VideoInputs.pixels`).

  Raises:
    ValueError: pixels not [1, 3, frames, H, W], not finite, or outside [-1, 1]; sizes as `vae.encode`.
  """
  pixels = np.asarray(pixels, np.float32)
  if pixels.ndim != 5 or pixels.shape[:2] != (1, vae.config.video_channels):
    raise ValueError(f"pixels must be [1, {vae.config.video_channels}, frames, height, width], got {pixels.shape}")
  if not np.isfinite(pixels).all() or np.abs(pixels).max() > 1.0:
    raise ValueError("pixels must be finite and in [-1, 1] (2 * frames / 255 - 1)")
  latent = wan_vae.encode(vae, jnp.asarray(pixels)).mean.astype(jnp.float32)
  return np.asarray(wan_vae.normalize_latents(vae.config, latent))


def noised(x0: np.ndarray, noise: np.ndarray, sigma: np.float32) -> np.ndarray:
  """float32 [B', C, F, Hl, Wl]: (1 - sigma) x0 + sigma noise, in float32 in diffusers' order (x0
  [1 or B', ...] broadcast over the videos; `sigma`: the schedule's float32 sigma of the first
  running step)."""
  sigma = np.float32(sigma)
  return (np.float32(1) - sigma) * np.asarray(x0, np.float32) + sigma * np.asarray(noise, np.float32)
