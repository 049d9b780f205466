"""Per-token timesteps as levels (`transformer.timesteps.TokenTimesteps`, Wan 2.2 TI2V): the same
forward as the written-out [B, T] timesteps (diffusers' form), on one device and on a mesh, in less
memory (XLA's memory analysis of the compiled forward)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelines.parallel.plan import ParallelPlan
from pipelines.wan import transformer as wan_transformer
from pipelines.wan.pretrained import TINY_TRANSFORMER
from pipelines.wan.transformer.timesteps import TokenTimesteps, select_levels
from tests.numerics import EPS_F32, assert_close_scaled

pytestmark = pytest.mark.numerics

CONFIG = dataclasses.replace(TINY_TRANSFORMER, in_channels=8, out_channels=8)
# 3 latent frames of 4 x 6: 18 tokens (U=2,R=2 pads them to 20); the first frame's 6 tokens at level 0.
LATENTS = np.random.default_rng(3).standard_normal((2, 8, 3, 4, 6)).astype(np.float32)
TEXT = np.random.default_rng(4).standard_normal((2, 16, CONFIG.text_dim)).astype(np.float32)


def _timesteps(tokens: int, first: int) -> TokenTimesteps:
  levels = jnp.asarray([[0.0, 700.0], [0.0, 310.5]], jnp.float32)
  index = jnp.broadcast_to((jnp.arange(tokens) >= first).astype(jnp.int32), (2, tokens))
  return TokenTimesteps(levels, index)


def test_select_levels_is_the_gather():
  values = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 6, 5)), jnp.float32)
  index = jnp.asarray(np.random.default_rng(1).integers(0, 3, (2, 7)), jnp.int32)
  want = np.take_along_axis(np.asarray(values), np.asarray(index)[:, :, None, None], axis=1)
  np.testing.assert_array_equal(select_levels(values, index), want)  # selects copy values: exact
  t = TokenTimesteps(values[:, :, 0, 0], index)
  assert t.shape == (2, 7)
  np.testing.assert_array_equal(t.dense(), want[:, :, 0, 0])


@pytest.mark.parametrize("mesh", [None, "U=2,R=2"])
def test_levels_give_the_per_token_forward(mesh):
  """Each token's embedding and modulations are the same functions of the same timestep value, so
  the two forms differ only by how XLA rounds the embedding's matmuls for K rows instead of T
  (fp32: a few ulps of the time embedding, carried through 2 blocks; measured 0, bit for bit, under
  the three ISA settings). 64 EPS_F32 (7.6e-6) allows that rounding and is far below what a wrong
  level costs: the positive control swaps the two rows' levels."""
  model = wan_transformer.init_transformer(CONFIG, seed=5)
  plan = None if mesh is None else ParallelPlan.build(mesh, heads=CONFIG.num_attention_heads)
  if plan is not None:
    model = jax.device_put(model, plan.replicated)
  levels = _timesteps(18, first=6)
  forward = jax.jit(lambda m, x, t, s: wan_transformer.forward(m, x, t, s, plan))
  ours = forward(model, LATENTS, levels, TEXT)
  dense = forward(model, LATENTS, levels.dense(), TEXT)
  assert_close_scaled(ours, dense, rel=64 * EPS_F32, name=f"levels vs per token, mesh {mesh}")
  swapped = TokenTimesteps(levels.levels[::-1], levels.index)
  err = float(jnp.max(jnp.abs(forward(model, LATENTS, swapped, TEXT) - dense)) / jnp.max(jnp.abs(dense)))
  assert err > 1e-3, "the positive control: other levels must change the forward"


def test_levels_use_less_memory():
  """The compiled forward at 768 tokens: the per-token form builds the time projection [B, T, 6 D]
  (fp32 here) and the blocks' modulations from it; the levels form embeds K = 2 rows and selects
  inside the fusions, so its temporaries are smaller by at least one such projection (CPU backend;
  measured 5.5 MB less, the bound 1.2 MB). On a TPU v5e the 5B TI2V step at 704x1280x121 went from
  17.05 GB of temporaries (not compiling for one chip) to 3.39 GB (docs/performance.md)."""
  model = wan_transformer.init_transformer(CONFIG, seed=5)
  latents = jnp.zeros((2, 8, 6, 16, 32), jnp.float32)
  tokens = 6 * 8 * 16  # (F / 1) (Hl / 2) (Wl / 2)
  levels = _timesteps(tokens, first=8 * 16)

  def temp(timestep):
    compiled = jax.jit(wan_transformer.forward).lower(model, latents, timestep, TEXT).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  ours, dense = temp(levels), temp(levels.dense())
  projection = 2 * tokens * 6 * CONFIG.dim * 4
  assert dense - ours >= projection, f"temporaries: levels {ours} B, per token {dense} B ({projection} B)"
