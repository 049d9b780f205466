"""A Wan VAE made time-stationary by its weights: every latent frame one picture, whatever its place.

A causal Wan VAE (2.1 layout, `is_residual` False) encodes a clip's frame 0 alone (the first chunk:
every causal 3-D conv sees two zero frames before it, so only its last time tap acts, and the
time downsamplers are skipped) and each later latent frame from 4 frames and a cache of the past.
Its later latents hold what changed since frame 0 (`long_clips.stationary_latents`), so a window
of latents that starts mid-video holds what no 17-frame clip does. `stationary_vae` rewrites the
weights so that every chunk is computed as the first one:
- every causal conv with a time kernel > 1 keeps only its last tap (the current frame): the
  first chunk is unchanged, and a later frame goes through the same per-frame path;
- encoder `downsample3d` time convs (kernel 3, stride 2, over the cached frame and the chunk)
  pass their last tap's input unchanged: of a chunk's frames 4k-3..4k they keep 4k-2, 4k and then
  4k. Latent frame k is then exactly the encoding of video frame 4k alone (`stationary_latents`;
  fp32 rounding apart);
- decoder `upsample3d` time convs (C -> 2C, the pair interleaved in time) pass the current frame
  to both halves: latent frame k >= 1 decodes to its picture, the first chunk's decode, 4 times.
The decoder then shows motion in steps of 4 frames (a picture held for 4); teaching it the frames
between (`long_clips.train_vae` with the encoder kept) starts from there.
"""

from __future__ import annotations

import jax.numpy as jnp

from pipelines.wan import vae as wan_vae


def stationary_vae(vae: wan_vae.WanVAE) -> wan_vae.WanVAE:
  """The VAE with the weights above; config (latents_mean / latents_std included) unchanged.

  Params in the loader's layout: conv weights [t, h, w, in, out]; time convs [3, 1, 1, C, C]
  (encoder) or [3, 1, 1, C, 2C] (decoder), biases [out].

  Raises:
    ValueError: a residual (Wan 2.2) VAE, whose shortcuts average or duplicate frames in time.
  """
  if vae.config.is_residual:
    raise ValueError("stationary_vae rewrites a Wan 2.1 layout VAE (is_residual False); this one is residual")
  params = {}
  for name, w in vae.params.items():
    if name.endswith("time_conv.weight"):
      t, _, _, c_in, c_out = w.shape
      eye = jnp.tile(jnp.eye(c_in, dtype=w.dtype), (1, c_out // c_in))  # [C, C] or [C, 2C]: both halves
      w = jnp.zeros_like(w).at[t - 1, 0, 0].set(eye)
    elif name.endswith("time_conv.bias"):
      w = jnp.zeros_like(w)
    elif w.ndim == 5 and w.shape[0] > 1:
      w = w.at[:-1].set(0)
    params[name] = w
  return wan_vae.WanVAE(vae.config, params)
