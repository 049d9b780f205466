"""Query/key producer: RMSNorm across all heads, split into heads, Wan 3D RoPE, optional pre-scale.

Glossary (DESIGN.md section 1): B batch, T tokens (q or k; T != S is fine, each call sees its own
length), N heads, H head dim, D = N * H model width.

The math is diffusers' `WanAttnProcessor.__call__` (models/transformers/transformer_wan.py):
  query = attn.norm_q(query)                 # torch.nn.RMSNorm(D), eps 1e-6 in WanTransformerBlock
  query = query.unflatten(2, (heads, -1))    # [B, T, N, H]
  query = apply_rotary_emb(query, cos, sin)  # interleaved pairs (2i, 2i+1)
Dtypes, as measured on torch 2.13 CPU (`torch.nn.RMSNorm`, which WanAttention uses, not diffusers'
own `RMSNorm`): x is upcast to fp32, normalised with fp32 statistics, multiplied by the weight in
fp32 and rounded ONCE to x.dtype. `apply_rotary_emb` then multiplies those x.dtype values by the
fp32 tables (type promotion -> fp32) and writes into `torch.empty_like(x)`, the second rounding to
x.dtype. For fp32 inputs both roundings are no-ops. `out_scale` (q * scale * log2(e) for the base-2
kernels, DESIGN.md section 3) is applied to the fp32 rotation result before the final rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _check_inputs(x, weight, cos, sin, num_heads: int) -> tuple[int, int, int, int]:
  """Validates shapes; returns (B, T, D, H)."""
  if x.ndim != 3:
    raise ValueError(f"x must be [B, T, D], got {x.shape=}")
  batch, tokens, width = x.shape
  if not isinstance(num_heads, int) or num_heads <= 0 or width % num_heads:
    raise ValueError(f"D must equal N * H: {width=} is not divisible by {num_heads=}")
  head_dim = width // num_heads
  if head_dim % 2 and cos is not None:
    raise ValueError(f"RoPE rotates channel pairs, so H must be even; got {head_dim=} "
                     f"(D={width}, N={num_heads})")
  if weight.shape != (width,):
    raise ValueError(f"RMSNorm weight must be [D] = [{width}], got {weight.shape=}")
  if (cos is None) != (sin is None):
    raise ValueError("pass both rotary tables cos and sin, or neither (plain RMSNorm)")
  want = (tokens, head_dim // 2)
  if cos is not None and (cos.shape != want or sin.shape != want):
    raise ValueError(f"rotary tables must be [T, H/2] = {list(want)} for x.shape={x.shape} and "
                     f"{num_heads=}, got {cos.shape=} {sin.shape=}; build them with "
                     f"wan_rope_table(grid, {head_dim}, start=..., length={tokens}) (is the grid "
                     f"size / shard length equal to T={tokens}?)")
  return batch, tokens, width, head_dim


def _mean_last(v: jax.Array) -> jax.Array:
  """Mean over the last axis as sum * (1/D): the form XLA rewrites a division by a constant into
  inside a jit, written out so the eager reference rounds the same way. [..., D] -> [..., 1]."""
  return jnp.sum(v, axis=-1, keepdims=True) * (1.0 / v.shape[-1])


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "out_scale"))
def rmsnorm_rope(x: jax.Array, weight: jax.Array, cos: jax.Array | None, sin: jax.Array | None, *,
                 num_heads: int, eps: float = 1e-6, out_scale: float | None = None) -> jax.Array:
  """RMSNorm over D (fp32 statistics) -> [B, T, N, H] -> Wan RoPE (-> * out_scale), one jit.

  Args:
    x: [B, T, D] projected q or k, any float dtype (bf16 or fp32 in practice).
    weight: [D] RMSNorm gain (norm_q / norm_k weight), any float dtype; applied in fp32.
    cos, sin: float32 [T, H/2] from `wan_rope_table` for these tokens' global positions, or both
      None for no rotation (Wan's cross-attention q/k: RMSNorm across heads only).
    num_heads: N (static).
    eps: RMSNorm epsilon (static); Wan uses 1e-6.
    out_scale: optional static float multiplied into the fp32 result before the final rounding
      (e.g. H ** -0.5 * log2(e) for q).

  Returns:
    [B, T, N, H] in x.dtype.

  Raises:
    ValueError: D not divisible by N, H odd, weight not [D], tables not [T, H/2].

  Math: diffusers WanAttnProcessor norm_q/norm_k + apply_rotary_emb (module doc). Instead of
  diffusers' repeat-interleaved [T, H] tables and strided writes, the pairs are rotated as a
  [..., H/2, 2] view against the [T, H/2] half-tables: the same products and sums. Inside the
  jit XLA may contract x1 * cos - x2 * sin into an FMA (one rounding where the eager reference and
  torch round twice; whether it does depends on the CPU), so fp32 results agree with the exact math
  and with diffusers to within (4 + sqrt(D)) fp32 eps of the rotated pair's norm, not bitwise
  (tests/producers/test_rmsnorm_rope.py); bf16 results carry diffusers' two roundings, so they equal the exact
  math rounded at those two points except where fp32 rounding lands on a bf16 rounding boundary.

  Memory: on XLA:CPU (jax 0.10.2) the reduction and the normalisation form one YNNPACK fusion that
  cannot take the pair rotation, so one fp32 [B, T, D] temporary remains (201 MB at T=32,760,
  D=1536, against 503 MB for the jitted reference; tests/producers/test_producers.py measures both).
  """
  batch, tokens, _, head_dim = _check_inputs(x, weight, cos, sin, num_heads)
  x_f32 = x.astype(jnp.float32)  # [B, T, D]
  mean_square = _mean_last(jnp.square(x_f32))  # [B, T, 1]
  y = x_f32 * jax.lax.rsqrt(mean_square + eps) * weight.astype(jnp.float32)  # [B, T, D] fp32
  if x.dtype != jnp.float32:
    # diffusers rounds the norm output to x.dtype before the rotation. Inside one jit XLA drops a
    # convert(convert(y, bf16), f32) pair (xla_allow_excess_precision, on by default), which moved
    # ~25% of bf16 outputs by 1 ulp against diffusers; reduce_precision is the rounding XLA keeps.
    info = jnp.finfo(x.dtype)
    y = jax.lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  if cos is None:
    if out_scale is not None:
      y = y * out_scale
    return y.reshape(batch, tokens, num_heads, head_dim).astype(x.dtype)
  pairs = y.reshape(batch, tokens, num_heads, head_dim // 2, 2)
  x1, x2 = pairs[..., 0], pairs[..., 1]  # [B, T, N, H/2]
  cos_b = cos[None, :, None, :]  # [1, T, 1, H/2]
  sin_b = sin[None, :, None, :]
  even = x1 * cos_b - x2 * sin_b
  odd = x1 * sin_b + x2 * cos_b
  if out_scale is not None:
    even, odd = even * out_scale, odd * out_scale
  out = jnp.stack([even, odd], axis=-1).reshape(batch, tokens, num_heads, head_dim)
  return out.astype(x.dtype)


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
  """torch.nn.RMSNorm(D) as WanAttention's norm_q/norm_k run it (torch 2.13): [B, T, D] in x.dtype.

  fp32 statistics, fp32 gain, one rounding to x.dtype.
  """
  x_f32 = x.astype(jnp.float32)
  variance = _mean_last(jnp.square(x_f32))
  return (x_f32 * jax.lax.rsqrt(variance + eps) * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rotary_emb_reference(x: jax.Array, cos: jax.Array, sin: jax.Array,
                               out_scale: float | None = None) -> jax.Array:
  """diffusers' Wan `apply_rotary_emb`, literally: x [B, T, N, H], cos/sin [T, H/2] -> x.dtype.

  Rebuilds diffusers' repeat-interleaved [1, T, 1, H] tables, reads `cos[..., 0::2]` and
  `sin[..., 1::2]` back and writes the even / odd channels with strided updates.
  """
  cos_full = jnp.repeat(cos, 2, axis=-1)[None, :, None, :]  # [1, T, 1, H]
  sin_full = jnp.repeat(sin, 2, axis=-1)[None, :, None, :]
  x1, x2 = x[..., 0::2], x[..., 1::2]  # == unflatten(-1, (-1, 2)).unbind(-1)
  cos_e, sin_o = cos_full[..., 0::2], sin_full[..., 1::2]
  out = jnp.zeros(x.shape, jnp.float32)
  out = out.at[..., 0::2].set(x1 * cos_e - x2 * sin_o)
  out = out.at[..., 1::2].set(x1 * sin_o + x2 * cos_e)
  if out_scale is not None:
    out = out * out_scale
  return out.astype(x.dtype)


def rmsnorm_rope_reference(x: jax.Array, weight: jax.Array, cos: jax.Array, sin: jax.Array, *,
                           num_heads: int, eps: float = 1e-6,
                           out_scale: float | None = None) -> jax.Array:
  """Unfused twin of `rmsnorm_rope`: norm, unflatten, rotate as three diffusers-shaped steps.

  Same arguments, returns and errors as `rmsnorm_rope`. Each step materialises its result
  (run eagerly, op by op), so it shows what the fused producer saves.
  """
  batch, tokens, _, head_dim = _check_inputs(x, weight, cos, sin, num_heads)
  y = rms_norm_reference(x, weight, eps)  # [B, T, D]
  y = y.reshape(batch, tokens, num_heads, head_dim)  # [B, T, N, H]
  return apply_rotary_emb_reference(y, cos, sin, out_scale)
