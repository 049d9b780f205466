"""Padding helpers shared by the attention paths (pad, compute, drop the padded rows)."""

from __future__ import annotations

import jax.numpy as jnp


def round_up(n: int, m: int) -> int:
  """Smallest multiple of m that is >= n."""
  return -(-n // m) * m


def pad_axis(x, axis: int, size: int, value=0):
  """Pads x with `value` at the end of `axis` up to `size` (no-op when already that long)."""
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)
