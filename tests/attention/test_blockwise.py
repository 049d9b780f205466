"""Local attention (LSE scan, fixed-m, auto) against the dense fp32 reference (attention/blockwise.py).

The fixed-m gate and bound are tested in test_fixed_m.py, merging partials in test_carry.py, the input
checks in test_masks.py and the block sizes in test_settings.py, on this file's inputs (`_inputs`).
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import BlockSizes, attention_reference, local_attention
from attention import blockwise
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


