"""The running state of blockwise attention (o, l, m) and the empty state a kernel builds itself.

`Carry` is what one key set leaves for the next (a ring step for the next); `Start` is the empty
carry described instead of materialised: o = l = 0 and m = -inf (LSE) or the fixed-m row offsets,
which the Pallas TPU kernel forms in VMEM on its first key block (no zeros or offsets in HBM);
`materialise` is the same carry for the XLA loops and the GPU kernel. `finish` turns a carry into
the output, `carry_lse` into its base-2 log-sum-exp, `merge_partials` merges two finished partials.

Shapes: B batch, K kv heads, G = N // K query heads per kv head, T query rows, H head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention import fixed_m as fm


@dataclasses.dataclass(frozen=True)
class Carry:
  """Running state of one query set against any number of key blocks (fp32).

  Attributes:
    o: [B, K, G, T, H] unnormalised output sum_j 2^(s_ij - m_i) v_j.
    l: [B, K, G, T] sum_j 2^(s_ij - m_i).
    m: [B, K, G, T] the row offset: running max (LSE, -inf before any key) or the pinned
      b_i = q~_i . k_mean + m_i (fixed-m).
  """

  o: jax.Array
  l: jax.Array
  m: jax.Array


jax.tree_util.register_dataclass(Carry, data_fields=["o", "l", "m"], meta_fields=[])


def init_carry(q_BKGTH: jax.Array, row_offset_BKGT: jax.Array | None = None) -> Carry:
  """Empty carry: LSE when row_offset is None (m = -inf), else fixed-m with m pinned to it."""
  B, K, G, T, H = q_BKGTH.shape
  m = jnp.full((B, K, G, T), -jnp.inf, jnp.float32) if row_offset_BKGT is None else row_offset_BKGT
  return Carry(jnp.zeros((B, K, G, T, H), jnp.float32), jnp.zeros((B, K, G, T), jnp.float32), m)


@dataclasses.dataclass(frozen=True)
class Start:
  """An empty carry, described: o = l = 0 and m = -inf (`offsets` None: LSE) or the fixed-m row
  offsets of `offsets` (`fm.offsets_of_rows`; with an update's mode "auto", where its flag is set
  and -inf elsewhere).

  Attributes:
    offsets: None, or the fixed-m offsets' inputs (fp32, per batch and kv head).
  """

  offsets: fm.OffsetInputs | None = None

  def check_mode(self, mode: str) -> None:
    """Raises ValueError when the offsets do not fit the update's `mode` (fixed-m and "auto" need
    them, LSE takes none): a fixed-m start at m = -inf would make every output NaN."""
    if (mode == "lse") != (self.offsets is None):
      raise ValueError(f"a Start for mode {mode!r} {'takes no' if mode == 'lse' else 'needs'} fixed-m offsets")

  def materialise(self, q_BKGTH: jax.Array, logit_scale: float, fixed: jax.Array | None = None) -> Carry:
    """The Carry itself, fp32, for queries q [B, K, G, T, H] (q * logit_scale = q~); `fixed` the
    mode-"auto" flag (bool scalar) or None."""
    if self.offsets is None:
      return init_carry(q_BKGTH)
    b = self.offsets.row_offsets(q_BKGTH, logit_scale)
    return init_carry(q_BKGTH, b if fixed is None else jnp.where(fixed, b, -jnp.inf))


jax.tree_util.register_dataclass(Start, data_fields=["offsets"], meta_fields=[])


def finish(carry: Carry) -> jax.Array:
  """o / l as fp32 [B, K, G, T, H]; rows that saw no valid key give 0, not NaN."""
  l = carry.l[..., None]
  return jnp.where(l > 0, carry.o / jnp.where(l > 0, l, 1.0), 0.0)


def carry_lse(carry: Carry) -> jax.Array:
  """Base-2 log-sum-exp per row, fp32 [B, K, G, T] (-inf for rows with no valid key)."""
  return jnp.where(carry.l > 0, carry.m + jnp.log2(jnp.where(carry.l > 0, carry.l, 1.0)), -jnp.inf)


def merge_partials(o_a, lse_a, o_b, lse_b):
  """Merges two normalised partial outputs of the same rows over disjoint key sets (base 2).

  lse = max(a, b) + log2(2^(a - max) + 2^(b - max)); o = weights-averaged. Fully masked partials
  (lse = -inf) are guarded: merging with one gives the other unchanged; both gives (0, -inf).

  Args:
    o_a, o_b: [..., T, H] normalised outputs; lse_a, lse_b: [..., T] base-2 LSEs.
  """
  mx = jnp.maximum(lse_a, lse_b)
  mx_safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
  wa, wb = jnp.exp2(lse_a - mx_safe), jnp.exp2(lse_b - mx_safe)
  tot = wa + wb
  safe = jnp.where(tot > 0, tot, 1.0)
  o = (wa[..., None] * o_a + wb[..., None] * o_b) / safe[..., None]
  lse = jnp.where(tot > 0, mx_safe + jnp.log2(safe), -jnp.inf)
  return o, lse
