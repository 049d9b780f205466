"""Tests for pipelines/wan/vae/layers.py: the form a stride-1 3D convolution takes in the program lowered
for each platform (a 2D conv per time tap on CPU, one 3D conv for GPU and TPU)."""

import jax
import jax.numpy as jnp
import pytest

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_conv_form_follows_the_platform_compiled_for():
  """CPU programs run a stride-1 3D conv as one 2D conv per time tap; programs lowered for GPU or
  TPU (also ahead of time from a CPU host) keep the one 3D conv."""
  from pipelines.wan.vae import layers as L

  x = jax.ShapeDtypeStruct((1, 6, 8, 8, 4), jnp.float32)
  w = jax.ShapeDtypeStruct((3, 3, 3, 4, 4), jnp.float32)
  b = jax.ShapeDtypeStruct((4,), jnp.float32)
  conv = jax.jit(lambda x, w, b: L.conv3d(x, w, b, padding=((0, 0), (1, 1), (1, 1))))
  counts = {p: conv.trace(x, w, b).lower(lowering_platforms=(p,)).as_text().count("stablehlo.convolution")
            for p in ("cpu", "tpu", "cuda")}
  assert counts == {"cpu": 3, "tpu": 1, "cuda": 1}
