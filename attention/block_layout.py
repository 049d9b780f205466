"""The one block set-up of an attention call (`BlockLayout`): real lengths, block sizes, padding.

Every blockwise path (`blockwise.local_attention`, each device of `usp_attention`, the halo and
all-gather window paths) builds its layout here and hands it to `blockwise.attend`: operands padded
to the blocks, or for one whole attention (a `Start` to the finished output) not, which the Pallas
kernels read as they are (their grid covers the lengths in ceil-divided blocks). The Pallas blocks
are multiples of 128 chosen so that a short length is not run mostly on padding (`pallas_block`).

Shapes: B batch, T query tokens, S key tokens, N query heads, K kv heads, G = N // K, H head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from attention.padding import pad_axis, round_up
from attention.settings import BlockSizes

# Position given to padded key slots: far from every real position, so every mask rejects it.
PAD_POSITION = 1 << 30


def capped_block(n: int, block: int) -> int:
  """min(block, next power of two >= max(n, 128)): the requested Pallas `block` capped so that a
  short length `n` is not padded past its own power of two."""
  return min(block, max(128, 1 << (n - 1).bit_length()))


def pallas_block(n: int, block: int) -> int:
  """The Pallas kernels' block for a length of `n` rows or keys, given the requested `block` (a
  multiple of 128): `capped_block`, halved (while it stays a multiple
  of 128) until it pads `n` by at most n / 8, else the candidate padding least (the larger on a
  tie). A short query must not run mostly on padding: a causal chunk's 4,680 rows in the v5e
  default's 4,096-row blocks are 8,192 rows (43 % padding), in 1,024-row blocks 5,120 (9 %); a
  quarter-size query block costs 2-5 % per FLOP on a v5e (docs/measurements/attention.md: 1024 x
  1024 against 4096 x 1024), so the bound is an eighth. A length the requested block already fits
  (32,760 in 4,096) is unchanged."""
  candidates = [capped_block(n, block)]
  while candidates[-1] % 256 == 0:
    candidates.append(candidates[-1] // 2)
  for c in candidates:
    if round_up(n, c) - n <= n // 8:
      return c
  return min(candidates, key=lambda c: (round_up(n, c), -c))


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """The one block set-up of an attention call: real lengths, block sizes and the padding.

  Every blockwise path (`local_attention`, each device of `usp_attention`, the halo/all-gather
  window paths) builds its layout here and hands it to `attend`, which masks the padded key slots
  (slot index >= S) *by construction*, whatever the caller's other masks: a padded key can never
  join a softmax. Padded query rows (index >= T) are computed on zero queries, or on whatever lies
  past the array's end where a kernel reads the operands unpadded, and are dropped (`unpad_rows`,
  or never written); they feed no statistic that a real row reads (the softmax is per row; zero
  rows have norm 0, so the fixed-m maxima ignore them, and unpadded ones are not in the arrays
  the maxima are taken over).

  Attributes:
    T: real query rows; S: real key slots (a slot may still be masked by position, e.g. a
      halo neighbour that does not exist, or a key beyond `kv_valid_len`).
    block_q: query rows per block (<= T); block_kv: keys per block (<= S).
    block_kv_compute: keys per chunk of a TPU kernel's key block (a multiple of 128 dividing
      block_kv; `BlockSizes.block_kv_compute`); None outside the Pallas backend or when not set.
  """

  T: int
  S: int
  block_q: int
  block_kv: int
  backend: str = "xla"
  block_kv_compute: int | None = None

  @classmethod
  def make(cls, T: int, S: int, block_sizes: "BlockSizes", backend: str = "xla") -> "BlockLayout":
    """Blocks of min(block_q, T) x min(block_kv, S) (XLA) or, for the Pallas kernels, `pallas_block`
    of each length: multiples of 128, powers of two when the given sizes are, and never padding a
    length by more than an eighth where a halved block avoids it; T and S padded up to multiples
    of them. The Pallas key chunk is gcd(block_kv, block_kv_compute) (it divides a shrunk block).

    Raises:
      ValueError: Pallas block sizes that are not multiples of 128.
    """
    if backend == "pallas":
      if block_sizes.block_q % 128 or block_sizes.block_kv % 128 or (block_sizes.block_kv_compute or 128) % 128:
        raise ValueError(f"the Pallas attention kernels need block sizes that are multiples of 128, got {block_sizes}")
      bk = pallas_block(S, block_sizes.block_kv)
      bkc = None if block_sizes.block_kv_compute is None else math.gcd(bk, block_sizes.block_kv_compute)
      return cls(T, S, pallas_block(T, block_sizes.block_q), bk, "pallas", bkc)
    if backend != "xla":
      raise ValueError(f"BlockLayout backend must be 'xla' or 'pallas' (resolve 'auto' first), got {backend!r}")
    return cls(T, S, min(block_sizes.block_q, T), min(block_sizes.block_kv, S))

  @property
  def T_pad(self) -> int:
    return round_up(self.T, self.block_q)

  @property
  def S_pad(self) -> int:
    return round_up(self.S, self.block_kv)

  @property
  def kv_padded(self) -> bool:
    """Static: some key slots are block padding (so `attend` must mask)."""
    return self.S_pad != self.S

  def queries(self, q_BTNH: jax.Array, num_kv_heads: int) -> jax.Array:
    """Token-major q [B, T, N, H] -> the kernels' [B, K, G, T, H] (query head n = k * G + g), not
    padded: the Pallas kernels read it as it is, `attend` pads it for the XLA loops."""
    B, T, N, H = q_BTNH.shape
    K = num_kv_heads
    return q_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)

  def keys(self, x_BSKH: jax.Array) -> jax.Array:
    """Token-major k or v [B, S, K, H] -> [B, K, S, H], not padded (as `queries`)."""
    return x_BSKH.transpose(0, 2, 1, 3)

  def output(self, o_BKGTH: jax.Array) -> jax.Array:
    """`finish`'s [B, K, G, T or T_pad, H] -> token-major [B, T, N, H] (padded rows dropped)."""
    B, K, G, _, H = o_BKGTH.shape
    return self.unpad_rows(o_BKGTH).transpose(0, 3, 1, 2, 4).reshape(B, self.T, K * G, H)

  def pad_q(self, x_BKGTH: jax.Array) -> jax.Array:
    """[B, K, G, T, H] (or a carry field [B, K, G, T]) zero-padded to T_pad rows."""
    return pad_axis(x_BKGTH, 3, self.T_pad)

  def pad_kv(self, x_BKSH: jax.Array) -> jax.Array:
    """[B, K, S, H] zero-padded to S_pad slots (masked by `attend`)."""
    return pad_axis(x_BKSH, 2, self.S_pad)

  def q_positions(self, pos_T: jax.Array) -> jax.Array:
    """int32 [T_pad]: the real rows' global positions, then PAD_POSITION."""
    return pad_axis(pos_T.astype(jnp.int32), 0, self.T_pad, value=PAD_POSITION)

  def kv_positions(self, pos_S: jax.Array) -> jax.Array:
    """int32 [S_pad]: the real slots' global positions, then PAD_POSITION."""
    return pad_axis(pos_S.astype(jnp.int32), 0, self.S_pad, value=PAD_POSITION)

  def unpad_rows(self, x_BKGTH: jax.Array) -> jax.Array:
    """Drops the padded query rows (axis 3)."""
    return x_BKGTH[:, :, :, :self.T]
