"""Tests for producers/block_input.py (issue 4): LayerNorm + AdaLN modulation against float64 math
(one rounding to x.dtype, as diffusers' block), diffusers' block formula in bf16, and the affine
`layer_norm` (Wan's cross-attention norm2) against torch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import producers
from producers import layernorm_adaln
from tests.numerics import assert_close_scaled
from tests.producers.rounding import NUM_TOKENS, _assert_bf16_rounding_points, _f32_rel, _round_to

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def _layer_norm_exact(x, eps=1e-6):
  """float64 LayerNorm over the last axis (biased variance, no affine) of x's values."""
  xd = np.asarray(x, np.float64)
  centred = xd - xd.mean(axis=-1, keepdims=True)
  return centred / np.sqrt(np.mean(centred**2, axis=-1, keepdims=True) + eps)


def _larger_term(*terms):
  """Element-wise max |term|: the scale of a sum's rounding error where the sum cancels."""
  return np.max(np.abs(np.stack(np.broadcast_arrays(*terms))), axis=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_layernorm_adaln_matches_exact_math(dtype, per_token):
  # The property we own: fp32 statistics and modulation, one rounding to x.dtype at the end (as
  # diffusers' block): fp32 results within fp32 rounding of the exact math in units of the output's
  # scale; bf16 results are the exact math rounded once, up to rounding-boundary flips.
  batch, tokens, width = 2, NUM_TOKENS, 192
  kx, ks, kb = jax.random.split(jax.random.key(3), 3)
  mod_shape = (batch, tokens if per_token else 1, width)
  x = (2.0 + 3.0 * jax.random.normal(kx, (batch, tokens, width))).astype(dtype)
  scale = 0.2 * jax.random.normal(ks, mod_shape)
  shift = 0.2 * jax.random.normal(kb, mod_shape)
  fused = layernorm_adaln(x, scale, shift)
  assert fused.shape == x.shape and fused.dtype == dtype
  modulated = _layer_norm_exact(x) * (1 + np.asarray(scale, np.float64))
  exact = modulated + np.asarray(shift, np.float64)
  if dtype == jnp.float32:
    assert_close_scaled(fused, exact, rel=_f32_rel(width), name="layernorm_adaln")
    return
  terms = _larger_term(exact, modulated, shift)
  _assert_bf16_rounding_points(fused, _round_to(exact, dtype), terms, roundings=1, width=width,
                               name="layernorm_adaln")
  # Positive control: an extra bf16 rounding of the LayerNorm output before the modulation.
  extra = _round_to(_round_to(_layer_norm_exact(x), dtype) * (1 + np.asarray(scale, np.float64))
                    + np.asarray(shift, np.float64), dtype)
  assert np.mean(np.asarray(fused, np.float64) != extra) > 0.1


def test_layernorm_adaln_matches_diffusers_block_formula():
  torch = pytest.importorskip("torch")
  from diffusers.models.normalization import FP32LayerNorm

  batch, tokens, width = 2, NUM_TOKENS, 192
  gen = torch.Generator().manual_seed(0)
  x = (2.0 + 3.0 * torch.randn(batch, tokens, width, generator=gen)).to(torch.bfloat16)
  scale = 0.2 * torch.randn(batch, 1, width, generator=gen)
  shift = 0.2 * torch.randn(batch, 1, width, generator=gen)
  norm1 = FP32LayerNorm(width, 1e-6, elementwise_affine=False)
  # WanTransformerBlock.forward, self-attention input.
  with torch.no_grad():
    modulated = (norm1(x.float()) * (1 + scale)).numpy()
  want = (norm1(x.float()) * (1 + scale) + shift).type_as(x).float().numpy()
  out = layernorm_adaln(jnp.asarray(x.float().numpy()).astype(jnp.bfloat16),
                        jnp.asarray(scale.numpy()), jnp.asarray(shift.numpy()))
  _assert_bf16_rounding_points(out, want, _larger_term(want, modulated, shift.numpy()), roundings=1,
                               width=width, name="layernorm_adaln vs diffusers bf16")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_affine_layer_norm_matches_torch(dtype):
  # diffusers FP32LayerNorm(D, elementwise_affine=True): Wan's cross-attention norm2.
  import torch
  rng = np.random.default_rng(5)
  x = rng.standard_normal((2, 70, 48)).astype(np.float32)
  w, b = rng.standard_normal(48).astype(np.float32), rng.standard_normal(48).astype(np.float32)
  xj = jnp.asarray(x, dtype)
  out = producers.layer_norm(xj, jnp.asarray(w), jnp.asarray(b))
  x_t = torch.from_numpy(np.asarray(xj, np.float32))
  normed = torch.nn.functional.layer_norm(x_t, (48,), eps=1e-6).numpy()
  ref = torch.nn.functional.layer_norm(x_t, (48,), torch.from_numpy(w), torch.from_numpy(b), 1e-6)
  ref = ref.numpy()
  assert out.dtype == dtype
  if dtype == jnp.float32:
    assert_close_scaled(out, ref, rel=_f32_rel(48), name="layer_norm vs torch")
  else:
    _assert_bf16_rounding_points(out, _round_to(ref, dtype), _larger_term(ref, normed * w, b),
                                 roundings=1, width=48, name="layer_norm vs torch")
  with pytest.raises(ValueError, match="weight and bias"):
    producers.layer_norm(xj, jnp.asarray(w[:4]), jnp.asarray(b))
