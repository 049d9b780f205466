"""Heads read in place from a heads-major buffer: USP's received q, k and v without slicing copies.

USP's all-to-all delivers one buffer [B, N/U + 2K/U, T, H]: the query heads, then the keys, then
the values (attention/usp.py). The Pallas kernels read each operand straight out of it (their
index maps add the operand's head offset), so no slice of it is materialised; the XLA loops slice
(`take`). Slicing K/V and q out of it cost 4.8 and 1.0 Mcycles a block of copies in the 14B 720p
step on v6e:2x4 (U=8, R=1; `--breakdown`).

Shapes: B batch, C the buffer's heads, L tokens, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Heads:
  """Heads [start, start + count) of a heads-major buffer [B, C, L, H].

  Attributes:
    buffer: [B, C, L, H].
    start, count: static; start + count <= C.
  """

  buffer: jax.Array
  start: int
  count: int

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """[B, count, L, H]: the shape `take` returns."""
    B, _, L, H = self.buffer.shape
    return B, self.count, L, H

  @property
  def dtype(self):
    return self.buffer.dtype

  def take(self) -> jax.Array:
    """The heads as their own array [B, count, L, H] (a slice: the XLA loops' input)."""
    return self.buffer[:, self.start:self.start + self.count]


jax.tree_util.register_dataclass(Heads, data_fields=["buffer"], meta_fields=["start", "count"])


def split(x: Heads | jax.Array) -> tuple[jax.Array, int]:
  """(buffer, head offset) of an operand: a `Heads`, or a whole array at offset 0."""
  if isinstance(x, Heads):
    return x.buffer, x.start
  return x, 0


def take(x: Heads | jax.Array) -> jax.Array:
  """The operand as its own array (`Heads.take`, or the array itself)."""
  return x.take() if isinstance(x, Heads) else x


def update_dims(q: Heads | jax.Array, k: Heads | jax.Array, v: Heads | jax.Array | None) -> tuple[int, ...]:
  """(B, K, G, T, H) of a block update's operands: q [B, K, G, T, H], or `Heads` of its N = K * G
  query heads, K then being k's heads (halved when v is None: k is the packed K/V).

  Raises:
    ValueError: `Heads` of queries whose count is no multiple of the kv heads.
  """
  if not isinstance(q, Heads):
    return tuple(q.shape)
  B, N, T, H = q.shape
  K = k.shape[1] // 2 if v is None else k.shape[1]
  if N % K or q.start % (N // K):
    raise ValueError(f"query heads [{q.start}, {q.start + N}) do not split over K={K} kv heads")
  return B, K, N // K, T, H
