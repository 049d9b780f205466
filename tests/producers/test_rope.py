"""Tests for producers/rope.py (issue 4): Wan's 3D RoPE table, bit-exact against its numpy twin, equal
to diffusers' `WanRotaryPosEmbed` to fp32 rounding, and traced shard offsets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import producers
from producers import wan_rope_table, wan_rope_table_reference
from tests.numerics import EPS_F32, assert_close_scaled
from tests.producers.rounding import GRID, NUM_TOKENS

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("start,length", [(0, None), (81, 27), (100, 10)])
def test_rope_table_matches_numpy_reference(head_dim, start, length):
  # Bit-exact by construction: both gather the same host-computed float32 table (float64 angles,
  # one rounding); a gather or a select does no arithmetic.
  cos, sin = wan_rope_table(GRID, head_dim, start=start, length=length)
  cos_ref, sin_ref = wan_rope_table_reference(GRID, head_dim, start=start, length=length)
  want_rows = NUM_TOKENS - start if length is None else length
  assert cos.shape == sin.shape == (want_rows, head_dim // 2)
  assert cos.dtype == sin.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(cos), cos_ref)
  np.testing.assert_array_equal(np.asarray(sin), sin_ref)
  pad_rows = np.arange(start, start + want_rows) >= NUM_TOKENS
  assert (np.asarray(cos)[pad_rows] == 1).all() and (np.asarray(sin)[pad_rows] == 0).all()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_table_matches_diffusers(head_dim):
  torch = pytest.importorskip("torch")
  from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

  rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=1024)
  latents = torch.zeros(1, 4, GRID[0], 2 * GRID[1], 2 * GRID[2])
  cos_t, sin_t = rope(latents)  # [1, T, 1, H], repeat-interleaved
  cos, sin = wan_rope_table(GRID, head_dim)
  assert producers.rope_axis_dims(head_dim) == (rope.t_dim, rope.h_dim, rope.w_dim)
  # Both take cos / sin of the same float64 angles and round once to fp32 (host side, no XLA): only
  # a float64 libm difference landing on a rounding boundary could flip one fp32 rounding, <= 1 eps
  # of the tables' scale 1. 4 eps.
  assert_close_scaled(cos, cos_t[0, :, 0, 0::2].numpy(), rel=4 * EPS_F32, scale=1.0, name="cos")
  assert_close_scaled(sin, sin_t[0, :, 0, 1::2].numpy(), rel=4 * EPS_F32, scale=1.0, name="sin")


def test_traced_start_needs_static_length():
  with pytest.raises(ValueError, match="length=None needs a Python int start"):
    jax.jit(lambda s: wan_rope_table(GRID, 64, start=s))(jnp.int32(3))
  cos, _ = jax.jit(lambda s: wan_rope_table(GRID, 64, start=s, length=8))(jnp.int32(100))
  # Bit-exact: a gather of the same host table (see test_rope_table_matches_numpy_reference).
  np.testing.assert_array_equal(np.asarray(cos), wan_rope_table_reference(GRID, 64, start=100,
                                                                           length=8)[0])
