"""Wan's 3D rotary position table for a (F, Hl/2, Wl/2) token grid, or one sequence shard of it.

Glossary (DESIGN.md section 1): T tokens, H head dim, F latent frames, Hl / Wl latent height /
width. After the (1, 2, 2) patchify the token grid is (F, Hl/2, Wl/2) and tokens are flattened in
(f, h, w) row-major order, as diffusers' `WanRotaryPosEmbed.forward` does.

The math is diffusers' `WanRotaryPosEmbed` (models/transformers/transformer_wan.py) built on
`get_1d_rotary_pos_embed(..., use_real=True, repeat_interleave_real=True,
freqs_dtype=torch.float64)` (models/embeddings.py): the H rotary pairs are split into a frame part
of t = H - 4 * (H // 6) channels, then a height and a width part of 2 * (H // 6) channels each;
channel pair i of a part of size d rotates by angle pos * theta ** (-2 i / d), computed in float64
and rounded to float32. diffusers repeats every entry twice ([T, H]) and the attention processor
reads back `cos[..., 0::2]` and `sin[..., 1::2]`; we return the [T, H/2] half-table those reads
see, which holds the same numbers.

Padding: DESIGN.md section 2 pads the token axis to a multiple of the shard count. Positions at or
past the grid end get angle 0 (cos 1, sin 0), i.e. the identity rotation, so a padded shard gets a
well-defined table and its valid rows equal the unsharded ones.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_THETA = 10000.0


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
  """Returns the (t, h, w) channel split of one head for Wan's 3D RoPE (diffusers' split).

  Raises:
    ValueError: head_dim is not a positive even integer.
  """
  if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
    raise ValueError(f"RoPE needs a positive even head dim H, got {head_dim=}")
  h_dim = w_dim = 2 * (head_dim // 6)
  return head_dim - h_dim - w_dim, h_dim, w_dim


def _check_grid(grid) -> tuple[int, int, int]:
  grid = tuple(grid)
  if len(grid) != 3 or not all(isinstance(g, (int, np.integer)) and g > 0 for g in grid):
    raise ValueError(f"grid must be three positive ints (F, Hl//2, Wl//2), got {grid=}")
  return tuple(int(g) for g in grid)


def _axis_angles(num_positions: int, dim: int, theta: float) -> np.ndarray:
  """float64 [num_positions, dim/2] angles pos * theta ** (-2i/dim), as get_1d_rotary_pos_embed."""
  inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # [dim/2]
  return np.outer(np.arange(num_positions, dtype=np.float64), inv_freq)


@functools.lru_cache(maxsize=32)
def _axis_tables(grid: tuple[int, int, int], head_dim: int, theta: float):
  """Per-axis float32 (cos, sin) tables [F, t/2], [Hl/2, h/2], [Wl/2, w/2] (float64 math)."""
  tables = []
  for n, dim in zip(grid, rope_axis_dims(head_dim)):
    angles = _axis_angles(n, dim, theta)
    tables.append((np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)))
  return tuple(tables)


@functools.partial(jax.jit, static_argnames=("grid", "head_dim", "length", "theta"))
def _rope_table(start, *, grid, head_dim, length, theta):
  num_f, num_h, num_w = grid
  num_tokens = num_f * num_h * num_w
  (cos_t, sin_t), (cos_h, sin_h), (cos_w, sin_w) = _axis_tables(grid, head_dim, theta)
  pos = jnp.asarray(start, jnp.int32) + jnp.arange(length, dtype=jnp.int32)  # [T_shard]
  valid = (pos >= 0) & (pos < num_tokens)
  pos = jnp.clip(pos, 0, num_tokens - 1)
  # (f, h, w) row-major flattening, exactly as WanRotaryPosEmbed's reshape(1, ppf * pph * ppw, ...).
  f_idx, h_idx, w_idx = pos // (num_h * num_w), (pos // num_w) % num_h, pos % num_w

  def gather(t_tab, h_tab, w_tab, pad_value):
    table = jnp.concatenate(
        [jnp.asarray(t_tab)[f_idx], jnp.asarray(h_tab)[h_idx], jnp.asarray(w_tab)[w_idx]], axis=-1)
    return jnp.where(valid[:, None], table, jnp.float32(pad_value))  # [T_shard, H/2]

  return gather(cos_t, cos_h, cos_w, 1.0), gather(sin_t, sin_h, sin_w, 0.0)


def _resolve_length(grid, start, length) -> int:
  num_tokens = math.prod(grid)
  if isinstance(start, (int, np.integer)) and start < 0:
    raise ValueError(f"start must be >= 0, got {start=}")
  if length is None:
    if not isinstance(start, (int, np.integer)):
      raise ValueError(f"length=None needs a Python int start (a traced start has no static "
                       f"length); pass length= explicitly, got {start=}")
    return max(num_tokens - int(start), 0)
  if not isinstance(length, (int, np.integer)) or length < 0:
    raise ValueError(f"length must be a static int >= 0 or None, got {length=}")
  return int(length)


def wan_rope_table(grid, head_dim: int, *, start=0, length: int | None = None,
                   theta: float = ROPE_THETA) -> tuple[jax.Array, jax.Array]:
  """Builds Wan's 3D RoPE (cos, sin) half-table for global token positions start .. start+length.

  Args:
    grid: (F, Hl//2, Wl//2), the post-patchify token grid; T = F * Hl//2 * Wl//2.
    head_dim: H, even.
    start: global position of the first row: a Python int, or a traced int32 scalar (a shard's
      offset inside `shard_map`, e.g. `axis_index * T_shard`).
    length: T_shard, static; None means T - start (needs a Python int start).
    theta: the RoPE base (Wan uses 10000).

  Returns:
    (cos, sin), each float32 [T_shard, H/2]; column i is rotary pair i (channels 2i, 2i+1) in
    diffusers' t | h | w order. Rows at positions >= T (padding) are cos 1, sin 0.

  Raises:
    ValueError: H odd or not positive, a malformed grid, a negative int start, a negative or
      non-int length, or length=None with a traced start.

  Math: diffusers `WanRotaryPosEmbed` + `get_1d_rotary_pos_embed` (float64 angles, see module doc).
  """
  grid = _check_grid(grid)
  rope_axis_dims(head_dim)
  length = _resolve_length(grid, start, length)
  return _rope_table(start, grid=grid, head_dim=head_dim, length=length, theta=float(theta))


def wan_rope_table_reference(grid, head_dim: int, *, start: int = 0, length: int | None = None,
                             theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
  """numpy twin of `wan_rope_table`: builds diffusers' full [T, H] table, then pads and slices.

  Same arguments and returns as `wan_rope_table` (numpy float32 arrays), except start must be a
  Python int. Mirrors `WanRotaryPosEmbed.forward` step by step: per-axis repeat-interleaved
  tables broadcast over the grid, concatenated t | h | w and flattened (f, h, w) row-major; then
  the `cos[..., 0::2]` / `sin[..., 1::2]` reads of the attention processor.

  Raises:
    ValueError: as `wan_rope_table`.
  """
  grid = _check_grid(grid)
  rope_axis_dims(head_dim)
  length = _resolve_length(grid, start, length)
  num_f, num_h, num_w = grid
  cos_parts, sin_parts = [], []
  for axis, (n, dim) in enumerate(zip(grid, rope_axis_dims(head_dim))):
    angles = _axis_angles(n, dim, theta)
    shape = [1, 1, 1, dim]
    shape[axis] = n
    for parts, fn in ((cos_parts, np.cos), (sin_parts, np.sin)):
      full = np.repeat(fn(angles), 2, axis=1).astype(np.float32).reshape(shape)  # [.., dim]
      parts.append(np.broadcast_to(full, (num_f, num_h, num_w, dim)))
  cos_full = np.concatenate(cos_parts, axis=-1).reshape(num_f * num_h * num_w, head_dim)
  sin_full = np.concatenate(sin_parts, axis=-1).reshape(num_f * num_h * num_w, head_dim)
  cos, sin = cos_full[:, 0::2], sin_full[:, 1::2]  # [T, H/2]
  pad = max(start + length - cos.shape[0], 0)
  cos = np.concatenate([cos, np.ones((pad, head_dim // 2), np.float32)])
  sin = np.concatenate([sin, np.zeros((pad, head_dim // 2), np.float32)])
  return cos[start:start + length], sin[start:start + length]
