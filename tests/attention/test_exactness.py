"""Exactness at real sizes (every padded slot masked) and bf16 error no worse than XLA's.

Padded positions in the attention stack and what masks them (each case is exercised here):
  * mesh padding of T/S to a multiple of U*R (`usp_attention`, `cross_attention`, the window
    paths): keys at global positions >= S, masked by `kv_limit`; padded query rows dropped.
  * block padding of each device's gathered T_g/S_g (and of the single-device T/S) to block
    multiples: key slots >= layout.S, masked inside `blockwise.attend` by slot index, always.
    This is the case that sizes which are multiples of U*R but not of the block hit (1,280 tokens;
    Wan 480p x 81 = 32,760; 720p x 81 = 75,600).
  * halo neighbours that do not exist (first/last shard): PAD_POSITION keys, masked by position.
  * cross-attention text: the model's own zero-padded text (as diffusers/Wan attend to it) is not
    padding; T is padded and dropped like self-attention's queries.

Tolerances (fp32): `numerics.fp32_attention_tol`, 32 * 2^-24 * max|v| (~1e-5 here). The values
have mean 1 (as real values do), so |o| ~ 1 and every spurious zero key moves outputs by ~1/S
(positive control below).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import (BlockSizes, attention_reference, cross_attention, local_attention, make_mesh,
                       usp_attention)
from attention import block_layout, blockwise
from attention.halo import all_gather_window_attention, halo_attention
from tests.numerics import fp32_attention_tol, within

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def _inputs(T, N, H, *, S=None, seed=0, spread=1.0, v_mean=0.0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  S = T if S is None else S
  q = rng.standard_normal((1, T, N, H), np.float32) * spread
  k = rng.standard_normal((1, S, N, H), np.float32) * spread
  v = rng.standard_normal((1, S, N, H), np.float32) + v_mean
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _meshes_up_to(n):
  """Every (U, R) with U * R <= n devices."""
  return [(u, d // u) for d in range(1, n + 1) for u in range(1, d + 1) if d % u == 0]


def _mesh(U, R):
  return make_mesh(ulysses=U, ring=R, devices=jax.devices()[:U * R])


@functools.partial(jax.jit, static_argnames="mesh")
def _usp_paths(q, k, v, mesh):
  return {impl: usp_attention(q, k, v, mesh=mesh, implementation=impl)
          for impl in ("lse", "fixed_m", "auto")}


def test_padded_key_would_be_visible():
  """Positive control: one zero key joining a softmax over S = 1,280 moves outputs by ~|o| / S; with
  v ~ N(1, 1) (|o| ~ 1, as real values with a mean) that is ~50x the tolerance. The old block
  padding added 384 such keys per ring step here, and 8 in all at 32,760 tokens on U=1,R=8
  (~1.5e-4, still 15x the tolerance)."""
  q, k, v = _inputs(1280, 2, 16, v_mean=1.0)
  zero = jnp.zeros((1, 1, 2, 16))
  spurious = attention_reference(q, jnp.concatenate([k, zero], 1), jnp.concatenate([v, zero], 1))
  assert float(jnp.max(jnp.abs(spurious - attention_reference(q, k, v)))) > 20 * fp32_attention_tol(v)


@pytest.mark.parametrize("U,R", _meshes_up_to(8), ids=lambda x: str(x))
def test_usp_1280_tokens_every_mesh(U, R):
  """1,280 tokens (the CLI's default 256x256x17): divides U*R for most meshes, never the block."""
  N = U if 8 % U else 8
  q, k, v = _inputs(1280, N, 16, v_mean=1.0)
  ref = attention_reference(q, k, v)
  for impl, out in _usp_paths(q, k, v, _mesh(U, R)).items():
    err = float(jnp.max(jnp.abs(out - ref)))
    within(err, fp32_attention_tol(v), f"U={U} R={R} {impl}")


def _sample_rows(T, D, seed=0):
  """Both ends of every shard (where padding sits) plus random rows."""
  shard = -(-T // D)
  edges = np.concatenate([[d * shard, min(T, (d + 1) * shard) - 1] for d in range(D)])
  return np.unique(np.concatenate([edges, np.random.default_rng(seed).integers(0, T, 64)]))


def _check_large(T, U, R, implementation="auto"):
  q, k, v = _inputs(T, U, 16, seed=T, v_mean=1.0)  # N = U: as few heads as the mesh allows
  # The per-device layout really has block padding (the path under test).
  layout = block_layout.BlockLayout.make(U * T // (U * R), U * T // (U * R), BlockSizes())
  assert T % (U * R) == 0 and layout.kv_padded
  out = usp_attention(q, k, v, mesh=_mesh(U, R), implementation=implementation)
  rows = _sample_rows(T, U * R)
  exact = _dense_f64(q[:, rows], k, v)  # float64, only the sampled query rows
  err = float(np.max(np.abs(np.asarray(out)[:, rows] - exact)))
  within(err, fp32_attention_tol(v), f"T={T} U={U} R={R}")


@pytest.mark.large
@pytest.mark.parametrize("U,R", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_usp_wan_480p_tokens(U, R):
  """Wan 1.3B 480x832 x 81 frames: 32,760 tokens on every mesh of 8 devices, no kv_valid_len."""
  _check_large(32760, U, R)


@pytest.mark.large
def test_usp_wan_720p_tokens():
  """Wan 14B 1280x720 x 81 frames: 75,600 tokens, 278 padded slots per ring step on U=1,R=8."""
  _check_large(75600, 1, 8)


# --- bf16: q rounded once, error within 1.25x of XLA's on the same bf16 inputs ---

def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _dense_f64(q, k, v, window=None):
  q, k, v = _f64(q), _f64(k), _f64(v)
  s = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
  if window is not None:
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None]
    s = np.where(np.abs(i - j) <= window, s, -np.inf)
  s -= s.max(-1, keepdims=True)
  p = np.exp(s)
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, v)


def _rms(out, exact):
  return float(np.sqrt(np.mean((_f64(out) - exact) ** 2)))


WINDOW = 20


def _entry_points(mesh):
  """Every public attention entry point, as f(q, k, v) -> [B, T, N, H]; windowed ones marked."""
  eps = {"attention_reference": (attention_reference, False),
         "cross_attention": (functools.partial(cross_attention, mesh=mesh), False),
         "halo_attention": (functools.partial(halo_attention, mesh=mesh, window=WINDOW), True),
         "all_gather_window": (functools.partial(all_gather_window_attention, mesh=mesh, window=WINDOW), True)}
  for impl in ("auto", "lse", "fixed_m"):
    eps[f"local_attention[{impl}]"] = (functools.partial(local_attention, implementation=impl), False)
    eps[f"usp_attention[{impl}]"] = (functools.partial(usp_attention, mesh=mesh, implementation=impl), False)
  return eps


@pytest.mark.parametrize("spread", [1, 2, 4])
def test_bf16_error_within_xla(spread):
  """RMS error (a stable statistic over 65k outputs; the max over them fluctuates by ~20 %) against
  float64 math on the same bf16 inputs, compared with `jax.nn.dot_product_attention` (XLA)."""
  q, k, v = _inputs(256, 4, 64, spread=spread, seed=spread, dtype=jnp.bfloat16)
  exact = {False: _dense_f64(q, k, v), True: _dense_f64(q, k, v, WINDOW)}
  xla = {False: _rms(jax.nn.dot_product_attention(q, k, v, implementation="xla"), exact[False]),
         True: _rms(jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                 local_window_size=(WINDOW, WINDOW)), exact[True])}
  checked, entries = 0, _entry_points(_mesh(2, 2))
  for name, (fn, windowed) in entries.items():
    out = fn(q, k, v)
    assert out.dtype == jnp.bfloat16, name
    if name.endswith("[fixed_m]") and bool(jnp.all(jnp.isnan(out))):
      assert spread == 4, f"{name}: the gate should admit spread {spread}"  # documented NaN
      continue
    ratio = _rms(out, exact[windowed]) / xla[windowed]
    assert ratio <= 1.25, f"{name} at spread {spread}: bf16 RMS error {ratio:.2f}x XLA's"
    checked += 1
  assert checked == len(entries) - (2 if spread == 4 else 0)  # only forced fixed-m may be skipped


def test_bf16_query_scaling_rounds_once():
  """bf16 q meets the kernel unchanged with the scale on the fp32 logits; fp32 q takes it in q."""
  q = jnp.asarray([[[[1.0 + 2.0**-7, 3.0]]]], jnp.bfloat16)
  q_in, logit_scale = blockwise.query_scaling(q, 0.125, q_prescaled=False)
  assert q_in is q and logit_scale == pytest.approx(0.125 * math.log2(math.e))
  q32 = q.astype(jnp.float32)
  q_in, logit_scale = blockwise.query_scaling(q32, 0.125, q_prescaled=False)
  assert logit_scale == 1.0 and np.allclose(q_in, q32 * 0.125 * math.log2(math.e), rtol=2**-23)
  assert blockwise.query_scaling(q, 0.125, q_prescaled=True) == (q, 1.0)
