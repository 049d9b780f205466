"""Fixed-m attention's eligibility gate and row bound (attention/fixed_m.py), through `local_attention`.

A sink head and huge values fail the gate (`auto` then takes the LSE path, bit for bit; forced
fixed-m is a documented all-NaN), inputs just inside / outside the gate's edge, the per-Q-block
bound against the per-row one, and the key maxima. References: the float64 numpy attention and the
dense fp32 reference, on test_blockwise.py's inputs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import BlockSizes, attention_reference, fixed_m_gate, local_attention
from attention import block_layout, blockwise, fixed_m
from attention.carry import finish, init_carry
from tests.attention.test_blockwise import _err, _inputs, _reference_f64, _scaled
from tests.numerics import fp32_attention_tol as fp32_tol
from tests.numerics import within

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_sink_head_fails_gate_and_auto_stays_exact():
  q, k, v = _inputs(1, 64, 200, 4, 4, 64)
  q = q.at[:, :, 1].multiply(400.0)  # head 1: huge q and k norms, logits far beyond 2^126
  k = k.at[:, :, 1].multiply(400.0)
  stats = fixed_m.local_key_stats(k, v)
  q_norm = fixed_m.query_norm_max(_scaled(q, 1 / 8))
  gate = fixed_m_gate(q_norm, stats.k_centred_max, stats.v_absmax, stats.valid_count)
  assert not bool(gate.eligible) and bool(jnp.all(gate.v_ok))
  ref = attention_reference(q, k, v)
  auto = local_attention(q, k, v, implementation="auto")
  assert bool(jnp.all(jnp.isfinite(auto)))
  within(_err(auto, ref), fp32_tol(v), "auto with a sink head")
  # Bit-exact is the property: auto took the LSE branch, the same arithmetic as the forced LSE run.
  assert _err(auto, local_attention(q, k, v, implementation="lse")) == 0.0
  # Forcing fixed-m on an ineligible input is detected: a documented all-NaN result.
  assert bool(jnp.all(jnp.isnan(local_attention(q, k, v, implementation="fixed_m"))))
  # Positive control: without the sink head the same input is admitted.
  q2, k2 = q.at[:, :, 1].divide(400.0), k.at[:, :, 1].divide(400.0)
  within(_err(local_attention(q2, k2, v, implementation="fixed_m"), attention_reference(q2, k2, v)), fp32_tol(v),
         "fixed-m without the sink")


def test_large_v_breaks_headroom():
  q, k, v = _inputs(1, 16, 64, 4, 4, 64)
  big = v * 2.0**122  # S=64 -> 6 bits, |v| up to ~2^124: c_max = 127 - 6 - 124 - 2 < 0
  stats = fixed_m.local_key_stats(k, big)
  q_norm = fixed_m.query_norm_max(_scaled(q, 1 / 8))
  gate = fixed_m_gate(q_norm, stats.k_centred_max, stats.v_absmax, stats.valid_count)
  assert not bool(jnp.all(gate.v_ok)) and not bool(gate.eligible)
  out = local_attention(q, k, big, implementation="auto")
  ref = attention_reference(q, k, big)
  assert bool(jnp.all(jnp.isfinite(out)))
  within(_err(out / 2.0**122, ref / 2.0**122), fp32_tol(v), "huge v, in units of 2^122")
  # Positive control: the same v at unit scale is admitted.
  stats1 = fixed_m.local_key_stats(k, v)
  assert bool(jnp.all(fixed_m_gate(q_norm, stats1.k_centred_max, stats1.v_absmax, stats1.valid_count).v_ok))


@pytest.mark.parametrize("side", ["inside", "outside"])
def test_gate_edge(side):
  B, T, S, N, H = 1, 32, 128, 2, 64
  q, k, v = _inputs(B, T, S, N, N, H, seed=3)
  scale = 1.0 / math.sqrt(H)
  stats = fixed_m.local_key_stats(k, v)
  c_max = float(fixed_m.headroom_cap(stats.v_absmax, stats.valid_count)[0, 0])
  threshold = c_max + 126.0 - 2.0 * fixed_m.DEFAULT_MARGIN
  u_target = threshold * (0.995 if side == "inside" else 1.005)
  # Scale head 0 so its largest row bound u = ||q~|| * max||k - k_mean|| lands at u_target.
  q_norm = fixed_m.query_norm_max(_scaled(q, scale))
  u0 = float(q_norm[0, 0] * stats.k_centred_max[0, 0])
  q = q.at[:, :, 0].multiply(u_target / u0)
  q_norm = fixed_m.query_norm_max(_scaled(q, scale))
  gate = fixed_m_gate(q_norm, stats.k_centred_max, stats.v_absmax, stats.valid_count)
  assert bool(gate.eligible) == (side == "inside")
  # At the edge the logits reach ~u nats, so fp32 rounding of the logits alone (in any exact
  # algorithm, the fp32 reference included) moves outputs by ~|logit| * 2^-24 per op.
  logits = np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64)) * scale
  tol = 2e-6 + 8 * 2.0**-24 * float(np.max(np.abs(logits)))
  exact = _reference_f64(q, k, v)
  auto = local_attention(q, k, v, implementation="auto")
  assert bool(jnp.all(jnp.isfinite(auto))) and np.max(np.abs(np.asarray(auto) - exact)) <= tol
  forced = local_attention(q, k, v, implementation="fixed_m")
  if side == "inside":
    assert bool(jnp.all(jnp.isfinite(forced))) and np.max(np.abs(np.asarray(forced) - exact)) <= tol
  else:
    assert bool(jnp.all(jnp.isnan(forced)))


def test_per_q_block_bound_is_exact():
  B, T, S, N, K, H = 1, 256, 300, 4, 2, 64
  q, k, v = _inputs(B, T, S, N, K, H)
  qs = _scaled(q, 1 / 8).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
  ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  stats = fixed_m.local_key_stats(k, v)
  gate = fixed_m_gate(fixed_m.query_norm_max(_scaled(q, 1 / 8)),
                      stats.k_centred_max, stats.v_absmax, stats.valid_count)
  assert bool(gate.eligible)
  b_row = fixed_m.row_offsets(qs, stats, gate.c_max)
  b_blk = fixed_m.row_offsets(qs, stats, gate.c_max, q_block=64)
  assert bool(jnp.all(b_blk >= b_row - 1e-4))  # a block bound is never below its rows' bound
  @jax.jit
  def fixed_m_with(b):
    layout = block_layout.BlockLayout.make(T, S, BlockSizes(64, 300))
    carry = blockwise.attend(init_carry(qs, b), qs, ks, vs, mode="fixed_m", layout=layout,
                             q_pos=jnp.arange(T), kv_pos=jnp.arange(S))
    return finish(carry).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)

  ref = attention_reference(q, k, v)
  for b in (b_row, b_blk):
    within(_err(fixed_m_with(b), ref), fp32_tol(v), "per-row / per-block bound")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_key_maxima_v_absmax_is_exact(dtype):
  """max |v| over the valid keys, per batch and kv head, exactly (the max of the magnitudes is one
  of the values): a head whose largest magnitude is negative, padding keys with larger values that
  must not count, a NaN that must propagate (the gate then refuses fixed-m)."""
  B, S, K, H = 2, 40, 3, 16
  rng = np.random.default_rng(5)
  v = rng.normal(size=(B, S, K, H)).astype(np.float32)
  v[1, 3, 1, 7] = -9.5  # batch 1, head 1: its largest magnitude is negative
  v[:, 30:] = 100.0  # beyond valid_len[1] = 30: padding for batch 1 only
  valid = np.arange(S)[None, :] < np.asarray([40, 30])[:, None]
  v = np.asarray(jnp.asarray(v, dtype).astype(jnp.float32))
  k = jnp.asarray(rng.normal(size=(B, S, K, H)), dtype)
  _, got = fixed_m.key_maxima(k, jnp.asarray(v, dtype), jnp.zeros((B, K, H)), jnp.asarray(valid))
  want = np.max(np.where(valid[:, :, None, None], np.abs(v), 0.0), axis=(1, 3))
  assert got.dtype == jnp.float32 and np.array_equal(np.asarray(got), want)
  assert np.all(np.asarray(got[0]) == 100.0) and float(got[1, 1]) == 9.5  # batch 0's keys are all valid
  v_nan = jnp.asarray(v, dtype).at[1, 2, 0, 0].set(jnp.nan)
  _, got = fixed_m.key_maxima(k, v_nan, jnp.zeros((B, K, H)), jnp.asarray(valid))
  assert bool(jnp.isnan(got[1, 0])) and bool(jnp.all(jnp.isfinite(got[0])))
