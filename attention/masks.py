"""Input validation and key masks from positions (shared by every attention path).

Masks are built from arithmetic on global token positions and the valid key length, never by
exchanging boolean masks between devices (DESIGN.md section 3, step 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def validate_qkv(q, k, v, *, kv_valid_len=None, window=None) -> tuple[int, int, int, int]:
  """Checks q [B, T, N, H], k/v [B, S, K, H] before any compute; returns (B, T, N, H).

  Raises:
    ValueError: naming the offending shapes/dtypes/values.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must have rank 4 [B, T|S, N|K, H], got shape {getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got {name}.dtype={x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v dtypes differ: {q.dtype=} {k.dtype=} {v.dtype=}")
  B, T, N, H = q.shape
  if k.shape != v.shape:
    raise ValueError(f"k and v shapes differ: {k.shape=} {v.shape=}")
  Bk, S, K, Hk = k.shape
  if Bk != B or Hk != H:
    raise ValueError(f"batch/head-dim mismatch: q.shape={q.shape} k.shape={k.shape}")
  if K == 0 or N % K != 0:
    raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K} (GQA)")
  if min(B, T, N, H, S) <= 0:
    raise ValueError(f"empty attention input: q.shape={q.shape} k.shape={k.shape}")
  if kv_valid_len is not None:
    if getattr(kv_valid_len, "shape", None) != (B,):
      raise ValueError(f"kv_valid_len must be an int array of shape [B]=({B},), got {getattr(kv_valid_len, 'shape', None)}")
    if not jnp.issubdtype(kv_valid_len.dtype, jnp.integer):
      raise ValueError(f"kv_valid_len must be integer, got {kv_valid_len.dtype}")
  if window is not None and (not isinstance(window, (int, np.integer)) or window < 0):
    raise ValueError(f"window must be None or an int >= 0, got {window=}")
  return B, T, N, H


def key_mask(
    q_pos: jax.Array,
    kv_pos: jax.Array,
    *,
    kv_valid_len: jax.Array | None,
    window: int | None,
    causal: bool,
) -> jax.Array:
  """Boolean [B or 1, Tq, Sk] mask (leading 1 when there is no kv_valid_len): True where query q_pos[i] may see key kv_pos[j].

  Args:
    q_pos: int [Tq] global query positions.
    kv_pos: int [Sk] global key positions.
    kv_valid_len: None or int [B]; keys at positions >= it are padding.
    window: None or w: |i - j| <= w (with causal: i - w <= j <= i).
    causal: j <= i.
  """
  mask = jnp.ones((1, q_pos.shape[0], kv_pos.shape[0]), bool)
  if kv_valid_len is not None:
    mask = mask & (kv_pos[None, None, :] < kv_valid_len[:, None, None])
  diff = q_pos[:, None] - kv_pos[None, :]  # i - j
  if causal:
    mask = mask & (diff >= 0)[None]
  if window is not None:
    mask = mask & (jnp.abs(diff) <= window)[None]
  return mask


def kernel_mask(q_pos_col, kv_pos_row, slot_row, *, limit, S, kv_padded, window, causal):
  """Bool [bq, bk] (or None): key visible to query, from positions (q_pos_col [bq, 1] and
  kv_pos_row / slot_row [1, bk] int32; limit an int32 scalar or None)."""
  mask = None

  def both(a, b):
    return b if a is None else a & b

  if limit is not None:
    mask = both(mask, kv_pos_row < limit)
  if causal or window is not None:
    diff = q_pos_col - kv_pos_row
    if causal:
      mask = both(mask, diff >= 0)
    if window is not None:
      mask = both(mask, jnp.abs(diff) <= window)
  if kv_padded:
    mask = both(mask, slot_row < S)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (q_pos_col.shape[0], kv_pos_row.shape[1]))
  return mask
