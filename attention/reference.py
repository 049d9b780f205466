"""Dense fp32 attention: the reference every fast path is tested against.

Shapes (DESIGN.md section 1): q [B, T, N, H], k and v [B, S, K, H] with N % K == 0; query head n
reads kv head n // (N // K) (grouped order, as `jax.nn.dot_product_attention` and Wan/GQA models).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from attention.masks import key_mask, validate_qkv


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    kv_valid_len: jax.Array | None = None,
    window: int | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> jax.Array:
  """Softmax attention computed densely in float32 (the numerical reference).

  softmax(scale * q k^T + mask) v, with the logits, the softmax and the output in fp32 and
  `Precision.HIGHEST` matmuls (Vaswani et al. 2017, eq. 1).

  Args:
    q: [B, T, N, H].
    k: [B, S, K, H], N % K == 0.
    v: [B, S, K, H].
    kv_valid_len: None or int [B]; keys at positions >= kv_valid_len[b] are padding (masked).
    window: None or an int w >= 0: query i sees key j only when |i - j| <= w (with `causal`,
      i - w <= j <= i). Positions count from 0 in both q and k.
    causal: key j visible to query i only when j <= i.
    scale: logit scale, default 1 / sqrt(H).

  Returns:
    [B, T, N, H] in q's dtype. A query row that sees no valid key returns zeros (not NaN).

  Raises:
    ValueError: ranks, shapes or dtypes that do not fit, N % K != 0, window < 0.
  """
  B, T, N, H = validate_qkv(q, k, v, kv_valid_len=kv_valid_len, window=window)
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  hp = jax.lax.Precision.HIGHEST
  q_BTKGH = q.astype(jnp.float32).reshape(B, T, K, G, H)
  s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k.astype(jnp.float32), precision=hp) * scale
  mask_BTS = key_mask(
      jnp.arange(T), jnp.arange(S), kv_valid_len=kv_valid_len, window=window, causal=causal)
  mask = mask_BTS[:, None, None]
  s_BKGTS = jnp.where(mask, s_BKGTS, -jnp.inf)
  row_max = jnp.max(s_BKGTS, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(s_BKGTS - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  o_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", p, v.astype(jnp.float32), precision=hp)
  return o_BTKGH.reshape(B, T, N, H).astype(q.dtype)
