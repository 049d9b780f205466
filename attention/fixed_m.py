"""Fixed-m attention: the eligibility gate and the per-row (or per-Q-block) bound, in base 2.

DESIGN.md section 4. With q~ = q * scale * log2(e) and the valid-key mean k_bar ("virtual
K-centring": z'_ij = q~_i . (k_j - k_bar), the same softmax since it is a per-row shift),
Cauchy-Schwarz gives |z'_ij| <= u_i := ||q~_i|| * max_j ||k_j - k_bar||, and the mean of z'_ij over
valid j is 0, so the row max is >= 0. Pin m_i = u_i - c_i and accumulate 2^(z' - m) with no
running max and no rescaling. It is exact (no overflow, no underflow of the top term) when

  * c_i <= c_max = 127 - ceil(log2 S_valid) - max(0, ceil(log2 max|v|)) - margin   (overflow)
  * (1 + lam) * u_i - c_i <= 126 - margin                                          (underflow)

where lam = 0 for full attention (row max >= 0) and lam = 1 when a window or causal mask hides
part of the keys (the visible max is only known to be >= -u_i). Any c_i in
[(1 + lam) u_i - (126 - margin), c_max] is exact; the gate admits an input when that interval is
non-empty for every head, i.e. (1 + lam) u <= c_max + 126 - 2 * margin, and `v_ok` (c_max >= 0,
max|v| finite).

Which c inside the interval sets the accuracy: exp2 sees the argument z'_ij - m_i, whose fp32
rounding is ~|z' - m| * 2^-24, so the significant (largest) terms should have small arguments. We
take c_i = clip(u_i, lower, c_max), i.e. m_i = 0 whenever possible: the argument is then the
centred logit z' itself, and the top terms' arguments are the row max (a few units on real
inputs), not u_i - max (tens). Measured on random fp32 inputs (T=128, S=7, H=128): fixed-m vs LSE
1.07e-6 with the smallest headroom c = clip(u - (126 - margin), 0, c_max), 7.2e-7 with m = 0;
with a window of 5, 1.16e-6 vs 4.8e-7. A large *fixed* headroom (a peer uses c = 88..102) is the
opposite mistake: arguments near +100 lose ~7 bits (DESIGN.md section 4).

Because k_bar, max ||k - k_bar||, max|v| and S_valid are taken over the *global* valid keys, the
bound is the same for every ring shard and partials from different shards are simply summed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
# Bits kept away from the fp32 exponent limits (2^127 overflow, 2^-126 smallest normal).
DEFAULT_MARGIN = 2.0


@dataclasses.dataclass(frozen=True)
class KeyStats:
  """Global statistics of the valid keys, per batch and kv head (fp32).

  Attributes:
    k_mean: [B, K, H] mean of the valid keys.
    k_centred_max: [B, K] max_j ||k_j - k_mean|| over valid keys.
    v_absmax: [B, K] max |v| over valid keys.
    valid_count: [B] number of valid keys (S_valid).
  """

  k_mean: jax.Array
  k_centred_max: jax.Array
  v_absmax: jax.Array
  valid_count: jax.Array


jax.tree_util.register_dataclass(
    KeyStats, data_fields=["k_mean", "k_centred_max", "v_absmax", "valid_count"], meta_fields=[])


def key_validity(S: int, kv_valid_len: jax.Array | None, offset=0) -> jax.Array:
  """Bool [B or 1, S]: key at global position offset + j is valid (not padding)."""
  pos = offset + jnp.arange(S)
  if kv_valid_len is None:
    return jnp.ones((1, S), bool)
  return pos[None, :] < kv_valid_len[:, None]


def key_sum(k_BSKH: jax.Array, valid_BS: jax.Array) -> jax.Array:
  """fp32 [B, K, H] sum of the valid keys (USP gathers the devices' sums and adds them in mesh order)."""
  k = jnp.where(valid_BS[:, :, None, None], k_BSKH.astype(jnp.float32), 0.0)
  return jnp.sum(k, axis=1)


def key_maxima(k_BSKH, v_BSKH, k_mean_BKH, valid_BS) -> tuple[jax.Array, jax.Array]:
  """Local fp32 ([B, K] max ||k - k_mean||, [B, K] max |v|) over valid keys (0 when none)."""
  kc = k_BSKH.astype(jnp.float32) - k_mean_BKH[:, None]
  valid = valid_BS[:, :, None]
  # sqrt after the max: monotone and correctly rounded, so the same value with S x fewer roots.
  kc_max = jnp.sqrt(jnp.max(jnp.where(valid, jnp.sum(kc * kc, axis=-1), 0.0), axis=1))
  # max |v| = max(max v, -min v) in v's own dtype (exact), each one reduction over tokens and head
  # dims, converted after: written as max |fp32(v)| over two stages, XLA:TPU materialised the whole
  # |v| in fp32 beside the v projection of the step and relaid it out for the reduction
  v = jnp.where(valid[..., None], v_BSKH, jnp.zeros((), v_BSKH.dtype))
  v_max = jnp.maximum(jnp.max(v, axis=(1, 3)), -jnp.min(v, axis=(1, 3))).astype(jnp.float32)
  return kc_max, v_max


def query_norm_max(q_scaled_BTNH: jax.Array) -> jax.Array:
  """fp32 [B, N] max over rows of the norms ||q~_i|| of the (already scaled, base-2) queries; the
  square root taken after the max (sqrt is monotone and correctly rounded, so the same value as
  the max of the roots, with T x fewer roots)."""
  q = q_scaled_BTNH.astype(jnp.float32)
  return jnp.sqrt(jnp.max(jnp.sum(q * q, axis=-1), axis=1))


def local_key_stats(k_BSKH, v_BSKH, kv_valid_len=None) -> KeyStats:
  """KeyStats of one device's whole K/V (the single-device path; USP reduces the pieces itself)."""
  B, S = k_BSKH.shape[:2]
  valid = jnp.broadcast_to(key_validity(S, kv_valid_len), (B, S))
  count = jnp.sum(valid, axis=1).astype(jnp.float32)
  k_mean = key_sum(k_BSKH, valid) / jnp.maximum(count, 1.0)[:, None, None]
  kc_max, v_max = key_maxima(k_BSKH, v_BSKH, k_mean, valid)
  return KeyStats(k_mean, kc_max, v_max, count)


def headroom_cap(v_absmax_BK: jax.Array, valid_count_B: jax.Array, *, margin=DEFAULT_MARGIN):
  """c_max [B, K] = 127 - ceil(log2 S_valid) - max(0, ceil(log2 max|v|)) - margin (overflow bound)."""
  log_s = jnp.ceil(jnp.log2(jnp.maximum(valid_count_B, 1.0)))[:, None]
  log_v = jnp.maximum(0.0, jnp.ceil(jnp.log2(v_absmax_BK)))
  return 127.0 - log_s - log_v - margin


@dataclasses.dataclass(frozen=True)
class GateResult:
  """Output of `fixed_m_gate`.

  Attributes:
    eligible: bool scalar, True when fixed-m is exact for every head of every batch element.
    v_ok: bool [B, K]: the max|v| / key-count part alone (c_max >= 0 and finite).
    c_max: fp32 [B, K] overflow cap on the headroom.
  """

  eligible: jax.Array
  v_ok: jax.Array
  c_max: jax.Array


jax.tree_util.register_dataclass(GateResult, data_fields=["eligible", "v_ok", "c_max"], meta_fields=[])


def fixed_m_gate(
    q_norm_max_BN: jax.Array,
    k_centred_max_BK: jax.Array,
    v_absmax_BK: jax.Array,
    valid_count_B: jax.Array,
    *,
    windowed: bool = False,
    margin: float = DEFAULT_MARGIN,
) -> GateResult:
  """Decides whether fixed-m is exact (DESIGN.md section 4).

  Args:
    q_norm_max_BN: fp32 [B, N] max over rows of ||q~_i|| (q pre-scaled by scale * log2 e).
    k_centred_max_BK: fp32 [B, K] max over valid keys of ||k_j - k_mean||.
    v_absmax_BK: fp32 [B, K] max |v| over valid keys.
    valid_count_B: [B] number of valid keys S_valid.
    windowed: a window hides some keys from each row (then the row max is only >= -u).
    margin: bits kept from the fp32 exponent limits.

  Returns:
    GateResult; `eligible` is a scalar, so it is mesh-uniform when the inputs are globally reduced.
  """
  B, N = q_norm_max_BN.shape
  K = k_centred_max_BK.shape[1]
  lam = 1.0 if windowed else 0.0
  c_max = headroom_cap(v_absmax_BK, valid_count_B, margin=margin)
  v_ok = jnp.isfinite(v_absmax_BK) & (c_max >= 0)
  u_BKG = q_norm_max_BN.reshape(B, K, N // K) * k_centred_max_BK[:, :, None]
  fits = (1.0 + lam) * u_BKG <= (c_max + 126.0 - 2.0 * margin)[:, :, None]  # NaN/inf -> False
  eligible = jnp.all(v_ok) & jnp.all(fits)
  return GateResult(eligible, v_ok, c_max)


def local_gate(q_in_BTNH: jax.Array, logit_scale: float, k_BSKH: jax.Array, v_BSKH: jax.Array,
               kv_valid_len: jax.Array | None = None, *, windowed: bool = False) -> tuple[KeyStats, GateResult]:
  """One device's whole attention's key statistics and gate (`local_key_stats`, `fixed_m_gate`), for
  q_in [B, T, N, H] with q_in * logit_scale = q * scale * log2 e (`blockwise.query_scaling`) and
  k, v [B, S, K, H]."""
  stats = local_key_stats(k_BSKH, v_BSKH, kv_valid_len)
  q_norm_max = query_norm_max(q_in_BTNH) * logit_scale  # [B, N], of q * scale * log2 e
  return stats, fixed_m_gate(q_norm_max, stats.k_centred_max, stats.v_absmax, stats.valid_count, windowed=windowed)


@dataclasses.dataclass(frozen=True)
class OffsetInputs:
  """What the fixed-m row offsets need besides the queries, per batch element and kv head (fp32).

  The kernels build the offsets from these and their own query tile (`offsets_of_rows`), so the
  per-row offsets never exist in HBM.

  Attributes:
    k_mean: [B, K, H] the global valid-key mean (`KeyStats.k_mean`).
    k_centred_max: [B, K] max ||k_j - k_mean|| over the global valid keys.
    c_max: [B, K] the overflow cap (`GateResult.c_max`).
    windowed: a window or causal mask hides keys from rows (lam = 1; static).
    margin: bits kept from the fp32 exponent limits (static).
  """

  k_mean: jax.Array
  k_centred_max: jax.Array
  c_max: jax.Array
  windowed: bool = False
  margin: float = DEFAULT_MARGIN

  def packed(self) -> jax.Array:
    """fp32 [B, K, 8, H]: row 0 k_mean, row 1 k_centred_max, row 2 c_max (both repeated along H),
    rows 3..7 zero: one (8, H) tile per (batch, kv head), the layout a TPU kernel block reads."""
    B, K, H = self.k_mean.shape
    rows = [self.k_mean, *(jnp.broadcast_to(x[:, :, None], (B, K, H)) for x in (self.k_centred_max, self.c_max))]
    return jnp.pad(jnp.stack([x.astype(jnp.float32) for x in rows], axis=2), ((0, 0), (0, 0), (0, 5), (0, 0)))

  def row_offsets(self, q_BKGTH: jax.Array, logit_scale: float = 1.0, q_norm_BKGT1: jax.Array | None = None):
    """fp32 [B, K, G, T]: `offsets_of_rows` over a whole query set q [B, K, G, T, H] (q~ = q *
    logit_scale, formed in fp32); `q_norm_BKGT1` as `offsets_of_rows`' q_norm."""
    q = q_BKGTH.astype(jnp.float32) * logit_scale
    per_bk = (slice(None), slice(None), None, None, None)
    return offsets_of_rows(q, self.k_mean[:, :, None, None, :], self.k_centred_max[per_bk], self.c_max[per_bk],
                           windowed=self.windowed, margin=self.margin, q_norm=q_norm_BKGT1)[..., 0]


jax.tree_util.register_dataclass(
    OffsetInputs, data_fields=["k_mean", "k_centred_max", "c_max"], meta_fields=["windowed", "margin"])


def offsets_of_rows(q_rows, k_mean, k_centred_max, c_max, *, windowed=False, margin=DEFAULT_MARGIN,
                    q_norm=None):
  """The fixed-m offset b_i = q~_i . k_mean + m_i, m_i = u_i - c_i, of rows along the last axis.

  The one formula for the XLA path (`row_offsets`) and the kernels (which call it on their query
  tile). c_i = clip(u_i, (1 + lam) u_i - (126 - margin), c_max): m_i = 0 unless the bound forces
  otherwise (module docstring).

  Args:
    q_rows: fp32 [..., H], q~ = q * scale * log2(e).
    k_mean: fp32 broadcastable to q_rows ([..., 1 or rows, H]).
    k_centred_max, c_max: fp32 broadcastable to [..., 1].
    windowed, margin: as in `fixed_m_gate`.
    q_norm: fp32 [..., 1] to use for ||q~_i|| (e.g. a per-block max); None: the row's own norm.

  Returns:
    fp32 [..., 1].
  """
  if q_norm is None:
    q_norm = jnp.sqrt(jnp.sum(q_rows * q_rows, axis=-1, keepdims=True))
  u = q_norm * k_centred_max
  lam = 1.0 if windowed else 0.0
  lower = (1.0 + lam) * u - (126.0 - margin)  # underflow of the top term
  c = jnp.minimum(jnp.maximum(u, lower), jnp.maximum(c_max, 0.0))
  # fp32 products and sum (a mul-sum, not a dot: XLA:TPU emits about half the code for it, 0.47 vs
  # 0.82 MiB at Wan 14B's size, and fp32 products are exact either way)
  qk_mean = jnp.sum(q_rows * k_mean, axis=-1, keepdims=True)
  return qk_mean + (u - c)


def row_offsets(
    q_scaled_BKGTH: jax.Array,
    stats: KeyStats,
    c_max_BK: jax.Array,
    *,
    windowed: bool = False,
    q_block: int | None = None,
    margin: float = DEFAULT_MARGIN,
    logit_scale: float = 1.0,
) -> jax.Array:
  """Per-row subtraction b_i = q~_i . k_mean + m_i, with m_i = u_i - c_i (fp32 [B, K, G, T]).

  The XLA form of `offsets_of_rows` over a whole query set. The fixed-m kernel computes
  2^(q~_i . k_j - b_i) = 2^(z'_ij - m_i): virtual K-centring folds into the same per-row offset as
  the pinned max, so K is never rewritten.

  Args:
    q_scaled_BKGTH: queries whose product with `logit_scale` is q * scale * log2(e), heads grouped
      by kv head.
    stats: global KeyStats.
    c_max_BK: from `fixed_m_gate`.
    windowed: as in `fixed_m_gate`.
    q_block: None for the per-row bound; an int for one bound per block of that many rows
      (the max over the block's rows). T must be a multiple of it.
    margin: as in `fixed_m_gate`.
    logit_scale: the kernels' logit factor (`blockwise.query_scaling`): q~ = q * logit_scale,
      formed here in fp32 (never rounded to q's dtype).
  """
  B, K, G, T, _ = q_scaled_BKGTH.shape
  q_norm = None
  if q_block is not None:
    if T % q_block:
      raise ValueError(f"{T=} must be a multiple of {q_block=} for a per-Q-block bound")
    q = q_scaled_BKGTH.astype(jnp.float32) * logit_scale
    q_norm = jnp.sqrt(jnp.sum(q * q, axis=-1))
    q_norm = jnp.repeat(jnp.max(q_norm.reshape(B, K, G, T // q_block, q_block), axis=-1), q_block, axis=-1)[..., None]
  offsets = OffsetInputs(stats.k_mean, stats.k_centred_max, c_max_BK, windowed=windowed, margin=margin)
  return offsets.row_offsets(q_scaled_BKGTH, logit_scale, q_norm)
