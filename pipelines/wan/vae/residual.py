"""The Wan 2.2 VAE's parameter-free reshapes: the residual blocks' shortcuts and the 2x2 patching.

Source of the math: diffusers `models/autoencoders/autoencoder_kl_wan.py` (`AvgDown3D`, `DupUp3D`,
`patchify`, `unpatchify`), there channels-first; here channels-last `[B, T, H, W, C]` (T frames,
H x W pixels, C channels at that level, as in `layers`), with the channel orders of diffusers'
views and permutes reproduced exactly (a checkpoint's channels mean the same here). All of them are
local per pixel block, so under the decoder's height split (`layers.RowShards`) each device
applies them to its own band.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelines.wan.vae.topology import Shortcut


def avg_down(s: Shortcut, x_BTHWC: jax.Array) -> jax.Array:
  """`AvgDown3D`: [B, T, H, W, in_dim] -> [B, ceil(T / ft), H / fs, W / fs, out_dim].

  T is first zero-padded at the front to a multiple of ft (diffusers' `F.pad(x, (0, 0, 0, 0,
  pad_t, 0))`); torch's channel index after the permute is c * factor + (a * fs + b) * fs + d for
  the time / row / column offsets (a, b, d) inside a block; the mean is over consecutive groups of
  in_dim * factor / out_dim of those channels.
  """
  ft, fs = s.factor_t, s.factor_s
  pad_t = (ft - x_BTHWC.shape[1] % ft) % ft
  x = jnp.pad(x_BTHWC, ((0, 0), (pad_t, 0), (0, 0), (0, 0), (0, 0)))
  B, T, H, W, C = x.shape
  x = x.reshape(B, T // ft, ft, H // fs, fs, W // fs, fs, C)
  x = x.transpose(0, 1, 3, 5, 7, 2, 4, 6)  # [B, T', H', W', C, ft, fs, fs]
  group = C * ft * fs * fs // s.out_dim
  x = x.reshape(B, T // ft, H // fs, W // fs, s.out_dim, group)
  return jnp.mean(x, axis=-1)


def dup_up(s: Shortcut, x_BTHWC: jax.Array, first_chunk: bool) -> jax.Array:
  """`DupUp3D`: [B, T, H, W, in_dim] -> [B, T * ft, H * fs, W * fs, out_dim]; on the first chunk the
  first ft - 1 frames are dropped (diffusers' `first_chunk`), matching the causal upsampler.

  Channel c is repeated (`repeat_interleave`) out_dim * factor / in_dim times; the repeated index
  k = ((o * ft + a) * fs + b) * fs + d goes to output channel o at offsets (a, b, d).
  """
  ft, fs = s.factor_t, s.factor_s
  B, T, H, W, C = x_BTHWC.shape
  x = jnp.repeat(x_BTHWC, s.out_dim * ft * fs * fs // C, axis=-1)
  x = x.reshape(B, T, H, W, s.out_dim, ft, fs, fs)
  x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4)  # [B, T, ft, H, fs, W, fs, out_dim]
  x = x.reshape(B, T * ft, H * fs, W * fs, s.out_dim)
  return x[:, ft - 1:] if first_chunk else x


def patchify(x_BTHWC: jax.Array, patch: int) -> jax.Array:
  """diffusers `patchify`: [B, T, H, W, C] -> [B, T, H / p, W / p, C p p], channel c * p * p +
  pw * p + ph (the column offset before the row offset, as diffusers' permute puts them)."""
  if patch == 1:
    return x_BTHWC
  B, T, H, W, C = x_BTHWC.shape
  x = x_BTHWC.reshape(B, T, H // patch, patch, W // patch, patch, C)
  x = x.transpose(0, 1, 2, 4, 6, 5, 3)  # [B, T, H', W', C, pw, ph]
  return x.reshape(B, T, H // patch, W // patch, C * patch * patch)


def unpatchify(x_BTHWC: jax.Array, patch: int) -> jax.Array:
  """diffusers `unpatchify`, the inverse of `patchify`: [B, T, H, W, C p p] -> [B, T, H p, W p, C]."""
  if patch == 1:
    return x_BTHWC
  B, T, H, W, CPP = x_BTHWC.shape
  x = x_BTHWC.reshape(B, T, H, W, CPP // (patch * patch), patch, patch)  # [.., C, pw, ph]
  x = x.transpose(0, 1, 2, 6, 3, 5, 4)  # [B, T, H, ph, W, pw, C]
  return x.reshape(B, T, H * patch, W * patch, CPP // (patch * patch))
