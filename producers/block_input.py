"""Block-input producer: LayerNorm without affine, then AdaLN modulation x * (1 + scale) + shift.

Glossary (DESIGN.md section 1): B batch, T tokens, D model width.

The math and dtypes are diffusers' `WanTransformerBlock.forward` (models/transformers/
transformer_wan.py):
  shift, scale, ... = (self.scale_shift_table + temb.float()).chunk(6, dim=1)   # fp32
  norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
with `norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)` (models/normalization.py): the
LayerNorm, the `1 + scale`, the product and the shift are all fp32, and the only rounding to
x.dtype is the final `type_as`. `temb` is [B, 6, D] for Wan 2.1 / 2.2 A14B (per-batch modulation,
here [B, 1, D]) and [B, T, 6, D] for Wan 2.2 TI2V (per-token, here [B, T, D]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _mean_last(v: jax.Array) -> jax.Array:
  """Mean over the last axis as sum * (1/D) (the form XLA uses inside a jit). [..., D] -> [..., 1]."""
  return jnp.sum(v, axis=-1, keepdims=True) * (1.0 / v.shape[-1])


def _check_inputs(x, scale, shift) -> None:
  if x.ndim != 3:
    raise ValueError(f"x must be [B, T, D], got {x.shape=}")
  batch, tokens, width = x.shape
  for name, m in (("scale", scale), ("shift", shift)):
    if m.ndim != 3 or m.shape[0] != batch or m.shape[1] not in (1, tokens) or m.shape[2] != width:
      raise ValueError(f"{name} must be [B, 1, D] (per batch) or [B, T, D] (per token) with "
                       f"B={batch}, T={tokens}, D={width}; got {name}.shape={m.shape}")


@functools.partial(jax.jit, static_argnames=("eps",))
def layernorm_adaln(x: jax.Array, scale: jax.Array, shift: jax.Array, *,
                    eps: float = 1e-6) -> jax.Array:
  """LayerNorm over D (fp32, no affine) then x * (1 + scale) + shift in fp32, one jit.

  Args:
    x: [B, T, D] hidden states, any float dtype.
    scale, shift: [B, 1, D] (per batch) or [B, T, D] (per token) modulation, any float dtype;
      upcast to fp32 as diffusers' `temb.float()` does.
    eps: LayerNorm epsilon (static); Wan uses 1e-6.

  Returns:
    [B, T, D] in x.dtype (one rounding, at the end).

  Raises:
    ValueError: x not 3-D, or scale / shift not [B, 1, D] or [B, T, D].

  Math: diffusers WanTransformerBlock norm1/norm3 + modulation (module doc); the LayerNorm is the
  two-pass biased-variance form of torch's `F.layer_norm`. The fp32 statistics put fp32 results
  within (4 + sqrt(D)) fp32 eps of the output's scale of the exact math, whatever order and FMA
  contraction XLA picks for the CPU; bf16 results are the exact math rounded once, except where
  fp32 rounding lands on a bf16 rounding boundary (tests/producers/test_block_input.py).
  """
  _check_inputs(x, scale, shift)
  normed = _normalize_f32(x, eps)
  out = normed * (1.0 + scale.astype(jnp.float32)) + shift.astype(jnp.float32)
  return out.astype(x.dtype)


def _normalize_f32(x: jax.Array, eps: float) -> jax.Array:
  """(x - mean) / sqrt(var + eps) over D in fp32, torch's two-pass biased variance. -> fp32."""
  x_f32 = x.astype(jnp.float32)  # [B, T, D]
  mean = _mean_last(x_f32)  # [B, T, 1]
  centred = x_f32 - mean
  variance = _mean_last(jnp.square(centred))  # [B, T, 1]
  return centred * jax.lax.rsqrt(variance + eps)


@functools.partial(jax.jit, static_argnames=("eps",))
def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, *, eps: float = 1e-6) -> jax.Array:
  """diffusers `FP32LayerNorm(D, eps, elementwise_affine=True)`: fp32 statistics and affine.

  Wan's cross-attention `norm2`. Args: x [B, T, D] any float dtype; weight, bias [D] (kept fp32 by
  diffusers in bf16 models); eps static. Returns [B, T, D] in x.dtype (one rounding, as
  FP32LayerNorm's `.to(origin_dtype)`). Raises ValueError when weight/bias are not [D].
  """
  if weight.shape != x.shape[-1:] or bias.shape != x.shape[-1:]:
    raise ValueError(f"weight and bias must be [D]=[{x.shape[-1]}], got {weight.shape=} {bias.shape=}")
  out = _normalize_f32(x, eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
  return out.astype(x.dtype)


def layer_norm_reference(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """FP32LayerNorm(D, elementwise_affine=False) on an fp32 input: [B, T, D] -> fp32 [B, T, D]."""
  x_f32 = x.astype(jnp.float32)
  mean = _mean_last(x_f32)
  variance = _mean_last(jnp.square(x_f32 - mean))
  return (x_f32 - mean) * jax.lax.rsqrt(variance + eps)


def layernorm_adaln_reference(x: jax.Array, scale: jax.Array, shift: jax.Array, *,
                              eps: float = 1e-6) -> jax.Array:
  """Unfused twin of `layernorm_adaln`, written as diffusers' block writes it.

  Same arguments, returns and errors as `layernorm_adaln`; materialises the fp32 LayerNorm output
  and the fp32 `1 + scale` before modulating.
  """
  _check_inputs(x, scale, shift)
  scale_f32, shift_f32 = scale.astype(jnp.float32), shift.astype(jnp.float32)
  normed = layer_norm_reference(x.astype(jnp.float32), eps)  # [B, T, D] fp32
  return (normed * (1 + scale_f32) + shift_f32).astype(x.dtype)
