"""Local attention (LSE scan, fixed-m, auto) against the dense fp32 reference, and the gate."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import BlockSizes, attention_reference, fixed_m_gate, local_attention, merge_partials
from attention import blockwise, fixed_m
from tests.numerics import fp32_attention_tol as fp32_tol
from tests.numerics import within

# bf16 inputs vs fp32 math on the same inputs: the kernels round p (2^-9 relative) and the output
# (2^-9 of |o| <~ 2) to bf16, ~4e-3 at worst; measured <= 4e-3 on every ISA setting, so 2e-2.
BF16_TOL = 2e-2

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

SIZES = BlockSizes(block_q=128, block_kv=128)
LENGTHS = (1, 7, 128, 1000)
# Each (T, S) pair of the 4x4 grid gets one of the 16 combinations of the four binary factors
# (heads, head dim, padding, window) through the bijection (i, j) -> (i + j, i + 2j) mod 4, so every
# factor combination is run exactly once and every T and every S meets every (heads, head dim) pair.
FACTORS = list(itertools.product([(4, 4), (8, 2)], [64, 128], [False, True], [False, True]))
GRID = [(t, s, *FACTORS[4 * ((i + j) % 4) + (i + 2 * j) % 4])
        for i, t in enumerate(LENGTHS) for j, s in enumerate(LENGTHS)]


def _inputs(B, T, S, N, K, H, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H), np.float32)
  k = rng.standard_normal((B, S, K, H), np.float32) + 0.5  # a non-zero key mean exercises centring
  v = rng.standard_normal((B, S, K, H), np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _valid_len(B, S, padded):
  if not padded:
    return None
  return jnp.asarray([S, max(1, (2 * S) // 3)][:B], jnp.int32)


def _scaled(q, scale):
  """fp32 q * scale * log2(e), as the kernels see it."""
  q_in, logit_scale = blockwise.query_scaling(q, scale, False)
  assert logit_scale == 1.0 and q.dtype == jnp.float32
  return q_in


def _err(a, b):
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def test_grid_covers_every_length_and_factor():
  assert sorted({(t, s) for t, s, *_ in GRID}) == sorted(itertools.product(LENGTHS, LENGTHS))
  assert sorted(tuple(g[2:]) for g in GRID) == sorted(FACTORS)


def _reference_f64(q, k, v, kv_valid_len=None, window=None):
  """Independent float64 numpy attention, to measure the fp32 paths' own error."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(H)
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  mask = np.ones((B, 1, T, S), bool)
  if kv_valid_len is not None:
    mask &= (j < np.asarray(kv_valid_len)[:, None, None, None])
  if window is not None:
    mask &= (np.abs(i - j) <= window)
  s = np.where(mask, s, -np.inf)
  row_max = s.max(-1, keepdims=True)
  p = np.where(mask, np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
  denom = p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p / np.where(denom > 0, denom, 1.0), v)  # no key -> 0


@functools.partial(jax.jit, static_argnames=("window", "causal", "backend"))
def _all_paths(q, k, v, vl, window, causal=False, backend="xla"):
  # One compiled program for the three paths and the fp32 reference keeps the grid fast.
  # backend "pallas": the kernels of attention/kernels.py in Pallas interpret mode.
  outs = {impl: local_attention(q, k, v, kv_valid_len=vl, window=window, causal=causal,
                                implementation=impl, block_sizes=SIZES, backend=backend)
          for impl in ("lse", "fixed_m", "auto")}
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  outs["reference"] = attention_reference(*f32, kv_valid_len=vl, window=window, causal=causal)
  return outs


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("T,S,NK,H,padded,windowed", GRID)
def test_matches_reference_fp32(T, S, NK, H, padded, windowed, backend):
  N, K = NK
  q, k, v = _inputs(2, T, S, N, K, H)
  vl = _valid_len(2, S, padded)
  window = 5 if windowed else None
  exact = _reference_f64(q, k, v, vl, window)
  outs = _all_paths(q, k, v, vl, window, backend=backend)
  # The fp32 reference is itself within 2e-6 of float64, so it is a fair yardstick.
  within(np.max(np.abs(np.asarray(outs["reference"]) - exact)), fp32_tol(v), "fp32 reference vs float64")
  for impl in ("lse", "fixed_m", "auto"):
    assert outs[impl].shape == q.shape and outs[impl].dtype == q.dtype
    err = float(np.max(np.abs(np.asarray(outs[impl], np.float64) - exact)))
    within(err, fp32_tol(v), impl)
  # The gate admits these random inputs, so fixed-m must agree with LSE.
  # (fixed-m == LSE follows: both are within TOL of float64 on these admitted inputs.)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("T,S,NK,H,padded,windowed", GRID[::4])
def test_matches_reference_bf16(T, S, NK, H, padded, windowed, backend):
  N, K = NK
  q, k, v = _inputs(2, T, S, N, K, H, dtype=jnp.bfloat16)
  vl = _valid_len(2, S, padded)
  outs = _all_paths(q, k, v, vl, 5 if windowed else None, backend=backend)
  for impl in ("lse", "fixed_m", "auto"):
    assert outs[impl].dtype == jnp.bfloat16
    within(_err(outs[impl], outs["reference"]), BF16_TOL, impl)


def test_padding_changes_the_answer():
  # Positive control for the padding tests: masking keys must matter.
  q, k, v = _inputs(2, 7, 128, 4, 4, 64)
  vl = _valid_len(2, 128, True)
  assert _err(local_attention(q, k, v, kv_valid_len=vl), local_attention(q, k, v)) > 1e-2


def test_causal_and_window_match_reference():
  q, k, v = _inputs(1, 300, 300, 4, 2, 64)
  for window, causal in ((None, True), (16, True), (0, False)):
    outs = _all_paths(q, k, v, None, window, causal)
    for impl in ("lse", "fixed_m", "auto"):
      within(_err(outs[impl], outs["reference"]), fp32_tol(v), f"{window=} {causal=} {impl}")


def test_rows_without_keys_are_zero():
  q, k, v = _inputs(2, 5, 9, 4, 4, 64)
  vl = jnp.asarray([0, 9], jnp.int32)
  for impl in ("lse", "auto"):
    out = local_attention(q, k, v, kv_valid_len=vl, implementation=impl)
    assert bool(jnp.all(out[0] == 0)) and bool(jnp.all(jnp.isfinite(out)))
  within(_err(out[1], attention_reference(q, k, v)[1]), fp32_tol(v), "batch row with keys")


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
    layout = blockwise.BlockLayout.make(T, S, BlockSizes(64, 300))
    carry = blockwise.attend(blockwise.init_carry(qs, b), qs, ks, vs, mode="fixed_m", layout=layout,
                             q_pos=jnp.arange(T), kv_pos=jnp.arange(S))
    return blockwise.finish(carry).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)

  ref = attention_reference(q, k, v)
  for b in (b_row, b_blk):
    within(_err(fixed_m_with(b), ref), fp32_tol(v), "per-row / per-block bound")


def test_merge_partials_equals_full_and_guards_empty():
  B, T, S, N, H = 1, 16, 96, 2, 64
  q, k, v = _inputs(B, T, S, N, N, H)
  qs = _scaled(q, 1 / 8).reshape(B, T, N, 1, H).transpose(0, 2, 3, 1, 4)
  ks, vs = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def part(lo, hi):
    layout = blockwise.BlockLayout.make(T, hi - lo, BlockSizes(16, 96))
    c = blockwise.attend(blockwise.init_carry(qs), qs, ks[:, :, lo:hi], vs[:, :, lo:hi], mode="lse",
                         layout=layout, q_pos=jnp.arange(T), kv_pos=jnp.arange(lo, hi))
    return blockwise.finish(c), blockwise.carry_lse(c)

  o, lse = merge_partials(*part(0, 40), *part(40, 96))
  o_full, lse_full = part(0, 96)
  within(_err(o, o_full), fp32_tol(v), "merged output")
  # LSE values are ~log2(96) + max logit ~ 10: fp32 ulp ~1e-6; 4e-6 is 4 ulps (measured <= 1 ulp).
  within(_err(lse, lse_full), 4e-6, "merged LSE")
  empty_o, empty_lse = jnp.zeros_like(o), jnp.full_like(lse, -jnp.inf)
  o2, lse2 = merge_partials(o_full, lse_full, empty_o, empty_lse)
  # Bit-exact by arithmetic: the empty partial's weight is exactly 0 and the other's exactly 2^0 = 1.
  assert _err(o2, o_full) == 0.0 and _err(lse2, lse_full) == 0.0
  o3, lse3 = merge_partials(empty_o, empty_lse, empty_o, empty_lse)
  assert bool(jnp.all(o3 == 0)) and bool(jnp.all(jnp.isneginf(lse3)))


@pytest.mark.parametrize("case,match", [
    (dict(q=(2, 8, 4)), "rank 4"),
    (dict(k=(2, 9, 3, 16), v=(2, 9, 3, 16)), "multiple of kv heads"),
    (dict(v=(2, 10, 2, 16)), "k and v shapes differ"),
    (dict(k=(3, 9, 2, 16), v=(3, 9, 2, 16)), "batch/head-dim mismatch"),
    (dict(kdtype=jnp.bfloat16), "dtypes differ"),
    (dict(kv_valid_len=jnp.ones((3,), jnp.int32)), "kv_valid_len"),
    (dict(window=-1), "window"),
    (dict(implementation="flash"), "unknown implementation"),
])
def test_bad_input_raises(case, match):
  q = jnp.zeros(case.get("q", (2, 8, 4, 16)))
  k = jnp.zeros(case.get("k", (2, 9, 2, 16)), case.get("kdtype", jnp.float32))
  v = jnp.zeros(case.get("v", (2, 9, 2, 16)), case.get("kdtype", jnp.float32))
  with pytest.raises(ValueError, match=match):
    local_attention(q, k, v, kv_valid_len=case.get("kv_valid_len"), window=case.get("window"),
                    implementation=case.get("implementation", "auto"))


@pytest.mark.parametrize("bad", [dict(block_q=0), dict(block_kv=-4), dict(block_q=1.5)])
def test_bad_block_sizes_raise(bad):
  with pytest.raises(ValueError, match="BlockSizes"):
    BlockSizes(**bad)


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
