"""Gradients of the attention paths (`jax.grad`) against the dense reference's, fp32.

Tolerance: the issue's 1e-5, relative to the largest reference gradient entry. The forward passes
agree to ~5e-7 (DESIGN.md 3); the backward adds one more pass of the same fp32 sums of T terms, so
the measured gradient error is ~6e-7 relative: 1e-5 leaves a 15x margin and still catches a wrong
gradient (a dropped term of the softmax Jacobian is O(1) relative).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import attention_reference, local_attention, make_mesh, usp_attention

pytestmark = pytest.mark.numerics

REL_TOL = 1e-5
B, T, N, H = 1, 32, 4, 16


def _inputs():
  rng = np.random.default_rng(3)
  q, k, v, w = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in range(4))
  return q, k + 0.3, v, w  # k off-centre, so the fixed-m path's key centring matters


def _grads(attend, q, k, v, w):
  """d/d(q, k, v) of sum(attend(q, k, v) * w): a generic cotangent, not all ones."""
  return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)


def _check(got, want, what):
  for name, g, r in zip("qkv", got, want):
    rel = float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
    assert rel <= REL_TOL, f"{what}: d/d{name} relative error {rel:.2e} > {REL_TOL:.0e}"


@pytest.mark.parametrize("ring,ulysses,backend", [(2, 2, "xla"), (1, 4, "xla"), (2, 2, "pallas")])
def test_usp_attention_gradient_matches_reference(ring, ulysses, backend):
  """backend "pallas": the kernels (interpret mode here) with their custom VJP."""
  q, k, v, w = _inputs()
  want = _grads(attention_reference, q, k, v, w)
  mesh = make_mesh(ulysses=ulysses, ring=ring, devices=jax.devices()[:ring * ulysses])

  @jax.jit
  def all_paths(q, k, v, w):
    return {impl: _grads(functools.partial(usp_attention, mesh=mesh, implementation=impl, backend=backend),
                         q, k, v, w)
            for impl in ("lse", "fixed_m", "auto")}

  for impl, got in all_paths(q, k, v, w).items():
    _check(got, want, f"usp_attention R={ring} U={ulysses} {impl} {backend}")


def test_local_attention_gradient_matches_reference():
  q, k, v, w = _inputs()
  want = _grads(attention_reference, q, k, v, w)
  for impl in ("lse", "fixed_m", "auto"):
    _check(_grads(functools.partial(local_attention, implementation=impl), q, k, v, w), want,
           f"local_attention {impl}")
