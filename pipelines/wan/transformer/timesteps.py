"""Per-token timesteps held as a few levels and each token's level (Wan 2.2 TI2V).

Glossary (DESIGN.md section 1): B batch rows, T tokens, K levels, D model width.

diffusers' Wan 2.2 TI2V (`expand_timesteps`) gives the transformer one timestep per token, `mask *
t`, which takes two values in a step: 0 on the given first frame's tokens and t on the rest. Built
per token, its embedding and the six AdaLN modulations are [B, T, 6, D] (fp32 in every block):
compiled for one TPU v5e at 704x1280 x 61 frames (14,080 tokens, CFG rows 2) the step's largest
temporaries were exactly these (2.1 GB of fp32 modulation, 1 GB of the projection and 1 GB of its
copy), and at 121 frames the step did not fit the chip. Held as levels, the embedding runs on
[B, K] timesteps and every block selects each token's modulation from K rows inside the fusions
that use it; the values are the ones the per-token form computes (each token's timestep is one of
the levels, embedded by the same functions). Each of the six is selected apart ([B, T, D] beside the
op that reads it): selected together, XLA built the [B, T, 6, D] fp32 array once per block (2 GB at
121 frames), and the step's temporaries were 5.84 GB instead of 3.39 GB.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenTimesteps:
  """Token j of row b has timestep `levels[b, index[b, j]]`.

  Attributes:
    levels: float32 [B, K] the distinct timesteps of each row (K static, small: 2 for TI2V).
    index: int32 [B, T] each token's level, in [0, K), tokens in (f, h, w) order.
  """
  levels: jax.Array
  index: jax.Array

  @property
  def shape(self) -> tuple[int, int]:
    """(B, T): the shape of the per-token timestep this stands for."""
    return tuple(self.index.shape)

  def dense(self) -> jax.Array:
    """float32 [B, T] the per-token timesteps written out (diffusers' 2-D timestep)."""
    return jnp.take_along_axis(self.levels, self.index, axis=1)


def select_levels(values: jax.Array, index: jax.Array) -> jax.Array:
  """Each token's row of a per-level array: [B, K, ...] by int32 [B, T] -> [B, T, ...].

  Written as K - 1 elementwise selects (no gather), so XLA fuses it into the ops that read the
  result instead of building the [B, T, ...] array.
  """
  levels = values.shape[1]
  pick = index.reshape(*index.shape, *([1] * (values.ndim - 2)))
  out = jnp.broadcast_to(values[:, :1], (values.shape[0], index.shape[1], *values.shape[2:]))
  for k in range(1, levels):
    out = jnp.where(pick == k, values[:, k:k + 1], out)
  return out
