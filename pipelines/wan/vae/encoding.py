"""Wan VAE encode (diffusers `AutoencoderKLWan.encode`): a video into the latent Gaussian, one causal
chunk at a time (frame 0 alone, then `model.ENCODER_CHUNK` frames a chunk), the feature cache carried
as in the decode (pipelines/wan/vae/model.py says how both directions run).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pipelines.wan.vae import layers as L, residual as vae_residual
from pipelines.wan.vae.config import WanVAEConfig
from pipelines.wan.vae.model import ENCODER_CHUNK, LatentDistribution, WanVAE


def encode_chunk(vae: WanVAE, cache: L.Cache | None, x_BTHWC: jax.Array) -> tuple[jax.Array, L.Cache]:
  """One causal encoder chunk: video x [B, T, H, W, 3] in [-1, 1] (T = 1 on the first chunk, cache
  None; then `ENCODER_CHUNK` frames) -> (mean and log-variance [B, 1, H/8, W/8, 2 z_dim], the
  feature cache for the next chunk)."""
  cfg = vae.config
  x_BTHWC = vae_residual.patchify(x_BTHWC, cfg.patch)
  h, cache = L.run_layers(vae.params, cfg.encoder_layers(), x_BTHWC, cache, first_chunk=cache is None)
  h, _ = L.run_layers(vae.params, cfg.quant_layers()[:1], h, None, first_chunk=False)
  return h, cache


@jax.jit
def _encode_first_chunk(vae: WanVAE, x_BTHWC: jax.Array) -> tuple[jax.Array, L.Cache]:
  return encode_chunk(vae, None, x_BTHWC)


_encode_next_chunk = jax.jit(encode_chunk, donate_argnums=1)


def check_video(config: WanVAEConfig, video: Any) -> None:
  """Raises `encode`'s ValueErrors for a video [B, 3, frames, height, width] the VAE cannot encode."""
  if video.ndim != 5:
    raise ValueError(f"video must be [B, 3, frames, height, width], got {video.shape=}")
  B, C, frames, height, width = video.shape
  if C != config.video_channels:
    raise ValueError(f"video has {C=} channels but the VAE expects {config.video_channels}")
  if B < 1 or frames < 1 or (frames - 1) % ENCODER_CHUNK:
    raise ValueError(f"{frames=} must be 1 + {ENCODER_CHUNK}k (and {B=} >= 1)")
  f = config.spatial_factor
  if height < f or width < f or height % f or width % f:
    raise ValueError(f"{height=} and {width=} must be positive multiples of {f}")


def latent_distribution(h_BFHWC: Any) -> LatentDistribution:
  """The encoder's output [B, F, Hl, Wl, 2C] (after quant_conv) -> mean and clamped logvar [B, C, F, Hl, Wl]."""
  mean, logvar = jnp.split(jnp.transpose(jnp.asarray(h_BFHWC), (0, 4, 1, 2, 3)), 2, axis=1)
  return LatentDistribution(mean, jnp.clip(logvar, *L.LOGVAR_RANGE))


def encode(vae: WanVAE, video: jax.Array) -> LatentDistribution:
  """Encodes a video into the latent Gaussian (diffusers `AutoencoderKLWan.encode(x).latent_dist`).

  Args:
    vae: the model; the video is cast to its dtype.
    video: [B, 3, frames, height, width] in [-1, 1] (diffusers layout), frames = 1 + 4k, height and
      width multiples of s = `config.spatial_factor` (8; 16 for the Wan 2.2 VAE).

  Returns:
    LatentDistribution(mean, logvar), each [B, C, 1 + (frames - 1) / 4, height / s, width / s]; the
    latent is `mean` (diffusers' `.mode()`); apply `normalize_latents` for the diffusion model.

  Raises:
    ValueError: video not 5-D, wrong channel count, frames not 1 + 4k (diffusers would silently drop
      the extra frames), or height/width not multiples of the spatial factor.

  Time chunking as diffusers `_encode`: frame 0 alone, then chunks of 4 frames, each one latent frame
  (temporal factor 4); the cache is carried as in `decode`.
  """
  check_video(vae.config, video)
  frames = video.shape[2]
  x_BFHWC = jnp.transpose(video.astype(vae.dtype), (0, 2, 3, 4, 1))
  h, cache = _encode_first_chunk(vae, x_BFHWC[:, :1])
  chunks = [h]
  for start in range(1, frames, ENCODER_CHUNK):
    h, cache = _encode_next_chunk(vae, cache, x_BFHWC[:, start:start + ENCODER_CHUNK])
    chunks.append(h)
  return latent_distribution(jnp.concatenate(chunks, axis=1))
