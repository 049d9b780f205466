"""The Ulysses exchanges of USP in fp8: Q, V and the output in e4m3, K in bf16 (`exchange="fp8"`).

Glossary (DESIGN.md section 1): B batch, L a source's token block (padded), N / K query / kv
heads, H head dim, U the Ulysses degree; hq = N / U and hk = K / U heads per head group.

Still ONE all-to-all in and ONE out (DESIGN.md section 3, steps 3 and 5), each of one uint8 buffer:
- in: per head group, hq query planes (e4m3 bytes), 2 hk key planes (each bf16 key head as its
  low and high bytes), hk value planes (e4m3 bytes) and one scale plane whose first 4 (hq + hk)
  bytes are this source's fp32 scales of those query and value heads;
- out: per destination token block, hq output planes (e4m3 bytes) and one scale plane (hq fp32).
Scales are local: per (row, head) over the sender's own tokens (in) or per (row, head, destination
block) (out), s = absmax / 448 (1 where the block is all zero), so no extra collective is needed.
K stays in bf16 because an error in a key moves every logit of its column (the fixed-m bound and
the softmax weights); Q's error moves one row's logits, V's and the output's are linear.

Errors (e4m3 round to nearest): each quantized value within 2^-4 of itself relative (2^-10 s
absolute in the subnormal range); K within 2^-9 relative (bf16). Half the bytes of a bf16 exchange
for Q, V and the output, the same for K: 5/8 of the bytes in, 1/2 out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention.mesh import ULYSSES_AXIS
from attention.padding import pad_axis

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
EXCHANGES = ("bf16", "fp8")


def _scale(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """fp32 absmax / 448 over `axes` (kept as size-1 axes); 1 where the absmax is 0."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
  return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)


def _e4m3_bytes(x: jax.Array, scale: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type((x.astype(jnp.float32) / scale).astype(E4M3), jnp.uint8)


def _from_e4m3_bytes(b: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(b, E4M3).astype(jnp.float32)


def _scale_plane(scales: jax.Array, plane: tuple[int, int]) -> jax.Array:
  """fp32 [..., n] as a uint8 [..., 1, L, H] plane (its first 4 n bytes)."""
  L, H = plane
  raw = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8).reshape(*scales.shape[:-1], -1)
  if raw.shape[-1] > L * H:
    raise ValueError(f"{scales.shape[-1]} fp32 scales do not fit one {L}x{H} byte plane; use exchange='bf16'")
  return pad_axis(raw, raw.ndim - 1, L * H).reshape(*scales.shape[:-1], 1, L, H)


def _read_scales(plane: jax.Array, n: int) -> jax.Array:
  """The first n fp32 of a uint8 [..., L, H] plane, as [..., n]."""
  flat = plane.reshape(*plane.shape[:-2], -1)[..., :4 * n]
  return jax.lax.bitcast_convert_type(flat.reshape(*flat.shape[:-1], n, 4), jnp.float32)


def heads_to_sequence(q: jax.Array, k: jax.Array, v: jax.Array, U: int, L_pad: int
                      ) -> tuple[jax.Array, jax.Array]:
  """The fp8 form of USP's packed exchange (`usp._heads_to_sequence([q, k, v], ...)`).

  Args:
    q: [B, L, N, H] local queries; k, v: [B, L, K, H] local keys and values (same L).
    U: the Ulysses degree; L_pad >= L: each source's token block in the gathered buffers.

  Returns:
    (q [B, hq, U * L_pad, H] in q's dtype, the packed K/V [B, 2 hk, U * L_pad, H] in k's dtype),
    heads-major as `usp._heads_to_sequence` returns them (padded rows zero).
  """
  B, L, N, H = q.shape
  K = k.shape[2]
  hq, hk = N // U, K // U

  def grouped(x, h):  # [B, L, U * h, H] -> [B, U, h, L_pad, H]
    return pad_axis(x.reshape(B, L, U, h, H).transpose(0, 2, 3, 1, 4), 3, L_pad)

  sq, sv = _scale(q, (1, 3)), _scale(v, (1, 3))  # [B, 1, N, 1], [B, 1, K, 1]
  k_bytes = jax.lax.bitcast_convert_type(k.astype(jnp.bfloat16), jnp.uint8)  # [B, L, K, H, 2]
  k_planes = k_bytes.transpose(0, 1, 2, 4, 3).reshape(B, L, 2 * K, H)  # head-major (lo, hi) planes
  scales = jnp.concatenate([sq.reshape(B, U, hq), sv.reshape(B, U, hk)], axis=2)  # [B, U, hq + hk]
  packed = jnp.concatenate([grouped(_e4m3_bytes(q, sq), hq), grouped(k_planes, 2 * hk),
                            grouped(_e4m3_bytes(v, sv), hk), _scale_plane(scales, (L_pad, H))], axis=2)
  recv = jax.lax.all_to_all(packed, ULYSSES_AXIS, 1, 3, tiled=True)  # [B, 1, P, U * L_pad, H]
  recv = recv.reshape(B, recv.shape[2], U, L_pad, H)  # by source block
  got = _read_scales(recv[:, -1], hq + hk)  # [B, U, hq + hk]: source s's scales of my heads
  q_scale = got[:, :, :hq].transpose(0, 2, 1)[..., None, None]  # [B, hq, U, 1, 1]
  v_scale = got[:, :, hq:].transpose(0, 2, 1)[..., None, None]
  qg = (_from_e4m3_bytes(recv[:, :hq]) * q_scale).astype(q.dtype)
  kg = recv[:, hq:hq + 2 * hk].reshape(B, hk, 2, U, L_pad, H).transpose(0, 1, 3, 4, 5, 2)
  kg = jax.lax.bitcast_convert_type(kg, jnp.bfloat16).astype(k.dtype)
  vg = (_from_e4m3_bytes(recv[:, hq + 2 * hk:hq + 3 * hk]) * v_scale).astype(k.dtype)
  T = U * L_pad
  return qg.reshape(B, hq, T, H), jnp.concatenate([kg.reshape(B, hk, T, H), vg.reshape(B, hk, T, H)], axis=1)


def sequence_to_heads(out: jax.Array, U: int, L: int) -> jax.Array:
  """The fp8 form of USP's exchange back (`usp._sequence_to_heads`): heads-major
  [B, hq, U * L_pad, H] -> [B, L, U * hq, H] (my tokens, all heads) in out's dtype."""
  B, hq, T, H = out.shape
  L_pad = T // U
  blocks = out.reshape(B, hq, U, L_pad, H)
  scale = _scale(blocks, (3, 4))  # [B, hq, U, 1, 1]: per destination block
  plane = _scale_plane(scale[..., 0, 0].transpose(0, 2, 1), (L_pad, H))  # [B, U, 1, L_pad, H]
  packed = jnp.concatenate([_e4m3_bytes(blocks, scale), plane.transpose(0, 2, 1, 3, 4)], axis=1)
  back = jax.lax.all_to_all(packed.reshape(B, hq + 1, T, H), ULYSSES_AXIS, 2, 1, tiled=True)
  back = back.reshape(B, U, hq + 1, L_pad, H)  # by source (head group)
  scales = _read_scales(back[:, :, hq], hq)[..., None, None]  # [B, U, hq, 1, 1]
  heads = (_from_e4m3_bytes(back[:, :, :hq]) * scales).astype(out.dtype).reshape(B, U * hq, L_pad, H)
  return heads[:, :, :L].transpose(0, 2, 1, 3)
