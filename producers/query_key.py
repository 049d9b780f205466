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
kernels, DESIGN.md section 3) is applied to the fp32 rotation result before the final rounding, or
without a rotation (the cross-attention q) to the fp32 norm output before its one rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout, with_layout_constraint

_HEADS_MAJOR = Layout((0, 2, 1, 3))  # [B, T, N, H] stored as [B, N, T, H]


def _check_inputs(x, weight, cos, sin, num_heads: int) -> tuple[int, int, int, int]:
  """Validates shapes; returns (B, T, D, H)."""
  if x.ndim == 4 and x.shape[2] != num_heads:
    raise ValueError(f"x split into heads must be [B, T, N, H] with N = {num_heads=}, got {x.shape=}")
  if x.ndim not in (3, 4):
    raise ValueError(f"x must be [B, T, D] or [B, T, N, H], got {x.shape=}")
  batch, tokens, width = *x.shape[:2], x.shape[2] * (x.shape[3] if x.ndim == 4 else 1)
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


def _mean_last(v: jax.Array, axes: int = 1) -> jax.Array:
  """Mean over the last `axes` axes as sum * (1/D): the form XLA rewrites a division by a constant
  into inside a jit, written out so the eager reference rounds the same way. [..., D] -> [..., 1]
  (axes=2: [..., N, H] -> [..., 1, 1])."""
  last = tuple(range(v.ndim - axes, v.ndim))
  return jnp.sum(v, axis=last, keepdims=True) * (1.0 / math.prod(v.shape[a] for a in last))


def _partner_by_flip(y: jax.Array) -> jax.Array:
  """y[..., i ^ 1] of [..., H] (H even) through a [..., H/2, 2] view: each pair's two channels
  swapped. XLA:CPU fuses it into the rotation; XLA:TPU relays the pair axis out (`_pair_partner`)."""
  return y.reshape(*y.shape[:-1], -1, 2)[..., ::-1].reshape(y.shape)


def _partner_by_matmul(y: jax.Array, dtype) -> jax.Array:
  """y[..., i ^ 1] of [..., H] as a matmul with the pair-swap permutation [H, H] (XLA:TPU).

  y: f32 holding values of `dtype` (already rounded to it). Every output is one product y * 1 plus
  exact zeros accumulated in fp32: y[..., i ^ 1] exactly for finite y (a zero may change sign; an
  inf or NaN spreads over its head). The operands are `dtype` (exact: y is representable), or
  fp32 at HIGHEST precision for fp32 y (the bf16 passes add up to y exactly).
  """
  head_dim = y.shape[-1]
  swap = np.eye(head_dim, dtype=np.float32)[np.arange(head_dim) ^ 1]  # [H, H]
  highest = jnp.dtype(dtype) == jnp.float32
  return jnp.einsum("...i,ij->...j", y.astype(dtype), jnp.asarray(swap, dtype),
                    precision=jax.lax.Precision.HIGHEST if highest else None,
                    preferred_element_type=jnp.float32)


def _pair_partner(y: jax.Array, dtype) -> jax.Array:
  """Each channel's RoPE partner y[..., i ^ 1] of f32 [..., H] holding `dtype` values: the same
  values on every platform, by the form each compiles best. On TPU the pair axis of the flip is
  the lane axis: XLA relaid q and k out in fp32 around it ([2, 9450, 5120] copies, 5.3 Mcycles each
  in the 14B 720p step on v6e:2x4), where the MXU swaps lanes in a fusion with the rotation."""
  return jax.lax.platform_dependent(y, tpu=functools.partial(_partner_by_matmul, dtype=dtype),
                                    default=_partner_by_flip)


def _rotate(y: jax.Array, cos: jax.Array, sin: jax.Array, dtype) -> jax.Array:
  """Wan RoPE of f32 [B, T, N, H] (values of `dtype`) by the f32 [T, H/2] tables: f32 [B, T, N, H].

  Each channel with its partner i ^ 1: even x1 cos + x2 (-sin) == x1 cos - x2 sin, odd
  x2 cos + x1 sin == x1 sin + x2 cos (IEEE: the same products and sums as the pairwise form).
  """
  partner = _pair_partner(y, dtype)  # [B, T, N, H]: channel i ^ 1
  cos_h = jnp.repeat(cos, 2, axis=-1)[None, :, None, :]  # [1, T, 1, H]
  sin_h = jnp.repeat(sin, 2, axis=-1)[None, :, None, :]
  even_lane = np.arange(y.shape[-1]) % 2 == 0  # [H]
  return y * cos_h + partner * jnp.where(even_lane, -sin_h, sin_h)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "out_scale"))
def rmsnorm_rope(x: jax.Array, weight: jax.Array, cos: jax.Array | None, sin: jax.Array | None, *,
                 num_heads: int, eps: float = 1e-6, out_scale: float | None = None) -> jax.Array:
  """RMSNorm over D (fp32 statistics) -> [B, T, N, H] -> Wan RoPE (-> * out_scale), one jit.

  Args:
    x: [B, T, D] projected q or k, any float dtype (bf16 or fp32 in practice), or already split
      into heads, [B, T, N, H] (`Dense.heads`: on TPU laid out heads-major by the projection).
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
    ValueError: D not divisible by N, a split x's N not N, H odd, weight not [D], tables not [T, H/2].

  Math: diffusers WanAttnProcessor norm_q/norm_k + apply_rotary_emb (module doc). Instead of
  strided reads and writes, each channel i is rotated in place with its partner i ^ 1
  (`_pair_partner`): y cos + partner (-/+ sin), the same products and sums. Inside the
  jit XLA may contract x1 * cos - x2 * sin into an FMA (one rounding where the eager reference and
  torch round twice; whether it does depends on the CPU), so fp32 results agree with the exact math
  and with diffusers to within (4 + sqrt(D)) fp32 eps of the rotated pair's norm, not bitwise
  (tests/producers/test_query_key.py); bf16 results carry diffusers' two roundings, so they equal the exact
  math rounded at those two points except where fp32 rounding lands on a bf16 rounding boundary.

  Memory: on XLA:CPU (jax 0.10.2) the reduction and the normalisation form one YNNPACK fusion that
  cannot take the pair rotation, so one fp32 [B, T, D] temporary remains (201 MB at T=32,760,
  D=1536, against 503 MB for the jitted reference; tests/producers/test_producers.py measures both).
  On TPU the output is laid out heads-major and the only relayout is of x in its own dtype (the
  14B 720p step on v6e:2x4: norm/RoPE 26.1 -> 3.6 Mcycles a block, docs/measurements/tpu-step.md).
  """
  batch, tokens, _, head_dim = _check_inputs(x, weight, cos, sin, num_heads)
  split = x.ndim == 4
  inv_rms = jax.lax.rsqrt(_mean_last(jnp.square(x.astype(jnp.float32)), 1 + split) + eps)  # [B, T, 1(, 1)]
  # Split into heads in x's dtype; on TPU laid out heads-major (whole (T, H) slabs: what attention
  # and the USP exchange read), so the fp32 math below is one fusion with no fp32 relayout.
  x_heads = jax.lax.platform_dependent(x.reshape(batch, tokens, num_heads, head_dim),
                                       tpu=lambda v: with_layout_constraint(v, _HEADS_MAJOR),
                                       default=lambda v: v)
  y = (x_heads.astype(jnp.float32) * (inv_rms if split else inv_rms[..., None])
       * weight.astype(jnp.float32).reshape(num_heads, head_dim))  # [B, T, N, H] fp32
  if cos is None:
    # No rotation: round(y * out_scale) once, not round(round(y) * out_scale): one rounding of q, as
    # diffusers' q has (a second doubles q's error, `attention.blockwise.query_scaling`).
    return (y if out_scale is None else y * out_scale).astype(x.dtype)
  if x.dtype != jnp.float32:
    # diffusers rounds the norm output to x.dtype before the rotation. Inside one jit XLA drops a
    # convert(convert(y, bf16), f32) pair (xla_allow_excess_precision, on by default), which moved
    # ~25% of bf16 outputs by 1 ulp against diffusers; reduce_precision is the rounding XLA keeps.
    info = jnp.finfo(x.dtype)
    y = jax.lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  out = _rotate(y, cos, sin, x.dtype)
  if out_scale is not None:
    out = out * out_scale
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
