"""2D USP and cross-attention (attention/usp.py) on fake CPU meshes, against the dense reference.

Halo attention and the strategy switch are tested in test_halo.py, with this file's inputs and HLO
collective counts.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import (MeshSpec, attention_reference, cross_attention, make_mesh, usp_attention,
                       workable_degrees)
from tests.numerics import fp32_attention_tol as fp32_tol
from tests.numerics import within

BF16_TOL = 2e-2  # as in test_attention_local: bf16 rounding of p and of the output

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

# (R, U) for every R * U in {1, 2, 4, 8}.
MESHES = [(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)]


def _inputs(B, T, N, K, H, dtype=jnp.float32, seed=0, S=None):
  rng = np.random.default_rng(seed)
  S = T if S is None else S
  q = rng.standard_normal((B, T, N, H), np.float32)
  k = rng.standard_normal((B, S, K, H), np.float32) + 0.3
  v = rng.standard_normal((B, S, K, H), np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _err(a, b):
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


@functools.partial(jax.jit, static_argnames="mesh")
def _all_paths(q, k, v, vl, mesh):
  return {impl: usp_attention(q, k, v, mesh=mesh, kv_valid_len=vl, implementation=impl)
          for impl in ("lse", "fixed_m", "auto")}


@pytest.mark.parametrize("R,U", MESHES)
@pytest.mark.parametrize("case", ["mha", "gqa_padded"])
def test_usp_matches_reference_fp32(R, U, case):
  mesh = make_mesh(ulysses=U, ring=R)
  if case == "mha":
    q, k, v = _inputs(2, 64, 8, 8, 32)
    vl = None
  else:  # T = 50 tokens do not divide 8 devices; N=8, K=2 (repeated when U=4, 8); key padding
    q, k, v = _inputs(2, 50, 8, 2, 32, seed=1)
    vl = jnp.asarray([50, 37], jnp.int32)
  ref = attention_reference(q, k, v, kv_valid_len=vl)
  outs = _all_paths(q, k, v, vl, mesh)
  for impl, out in outs.items():
    assert out.shape == q.shape and out.dtype == q.dtype
    within(_err(out, ref), fp32_tol(v), impl)
  # (fixed-m == LSE follows: both are within TOL of the reference.)


@pytest.mark.parametrize("R,U", [(2, 2), (1, 4), (8, 1)])
def test_usp_matches_reference_bf16(R, U):
  mesh = make_mesh(ulysses=U, ring=R)
  q, k, v = _inputs(1, 50, 8, 2, 32, dtype=jnp.bfloat16)
  ref = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)))
  for impl, out in _all_paths(q, k, v, None, mesh).items():
    assert out.dtype == jnp.bfloat16
    within(_err(out, ref), BF16_TOL, impl)


def test_output_is_sequence_sharded():
  mesh = make_mesh(ulysses=2, ring=2)
  q, k, v = _inputs(1, 64, 4, 4, 16)
  out = usp_attention(q, k, v, mesh=mesh)
  assert out.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("ring", "ulysses"))), 4)


def test_different_query_and_key_lengths():
  mesh = make_mesh(ulysses=2, ring=2)
  q, k, v = _inputs(1, 24, 4, 2, 16, S=40)
  within(_err(usp_attention(q, k, v, mesh=mesh), attention_reference(q, k, v)), fp32_tol(v), "T != S")


def test_sink_on_one_shard_sends_every_device_to_lse():
  mesh = make_mesh(ulysses=2, ring=4)
  q, k, v = _inputs(1, 64, 4, 4, 32)
  clean = _all_paths(q, k, v, None, mesh)
  # Positive control: on clean input every device takes fixed-m (auto is bitwise the fixed-m run).
  assert _err(clean["auto"], clean["fixed_m"]) == 0.0 and _err(clean["auto"], clean["lse"]) > 0.0
  # Tokens 56..63 live on the last device (ring 3, ulysses 1); only there do head 2's q/k explode.
  q = q.at[:, 56:, 2].multiply(8.0)  # u ~ 500 bits > the gate's ~240
  k = k.at[:, 56:, 2].multiply(8.0)
  outs = _all_paths(q, k, v, None, mesh)
  assert _err(outs["auto"], outs["lse"]) == 0.0  # every row on every device took the LSE path
  assert bool(jnp.all(jnp.isnan(outs["fixed_m"])))  # the gate is global: forced fixed-m refuses everywhere
  assert bool(jnp.all(jnp.isfinite(outs["auto"])))
  ref = attention_reference(q, k, v)
  others = jnp.asarray([0, 1, 3])
  within(_err(outs["auto"][:, :, others], ref[:, :, others]), fp32_tol(v), "heads without the sink")
  # The sink head's logits reach ~350 nats: fp32 rounding of the logits alone is ~2e-5 there.
  within(_err(outs["auto"][:, :, 2], ref[:, :, 2]), 1e-4, "sink head (logits x64)")


# Batch rows split over a windows axis (W = 2), with and without a cfg split: device group (c, w) holds
# row chunk c * W + w; each group runs USP over its own (ring, ulysses) devices.
WINDOW_MESHES = ["W=2,U=2,R=1", "CFG=2,W=2,U=2,R=1", "W=2,U=1,R=2"]


@pytest.mark.parametrize("spec", WINDOW_MESHES)
@pytest.mark.parametrize("case", ["mha", "gqa_padded"])
def test_usp_rows_split_over_windows_fp32(spec, case):
  mesh = MeshSpec.parse(spec).build()
  if case == "mha":
    q, k, v = _inputs(4, 64, 8, 8, 32, seed=2)
    vl = None
  else:  # T = 50 tokens, N=8, K=2, a different key padding in every row
    q, k, v = _inputs(4, 50, 8, 2, 32, seed=3)
    vl = jnp.asarray([50, 37, 21, 44], jnp.int32)
  ref = attention_reference(q, k, v, kv_valid_len=vl)
  for impl, out in _all_paths(q, k, v, vl, mesh).items():
    assert out.shape == q.shape and out.dtype == q.dtype
    within(_err(out, ref), fp32_tol(v), f"{spec} {impl}")
    if case == "mha":  # rows over (cfg, windows), tokens over (ring, ulysses)
      rows_split = jax.sharding.PartitionSpec(("cfg", "windows"), ("ring", "ulysses"))
      assert out.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, rows_split), 4), out.sharding


@pytest.mark.parametrize("spec,rows", [("W=2,U=2,R=1", 2), ("CFG=2,W=2,U=2,R=1", 4)])
def test_sink_in_one_windows_group_sends_every_device_to_lse(spec, rows):
  """The fixed-m gate is AND-reduced over every batch axis: a sink in the last row group's rows only
  (device group (C-1, W-1)) sends the other groups to LSE too."""
  mesh = MeshSpec.parse(spec).build()
  q, k, v = _inputs(rows, 64, 4, 4, 32, seed=4)
  clean = _all_paths(q, k, v, None, mesh)
  assert _err(clean["auto"], clean["fixed_m"]) == 0.0 and _err(clean["auto"], clean["lse"]) > 0.0
  last = rows - rows // MeshSpec.parse(spec).row_groups  # the first row of the last group
  q = q.at[last:, :, 2].multiply(8.0)
  k = k.at[last:, :, 2].multiply(8.0)
  outs = _all_paths(q, k, v, None, mesh)
  assert _err(outs["auto"][:last], outs["lse"][:last]) == 0.0  # the clean rows took the LSE path too
  assert _err(outs["auto"], outs["lse"]) == 0.0
  assert bool(jnp.all(jnp.isnan(outs["fixed_m"])))  # forced fixed-m refuses on every device


def test_batch_not_split_by_the_row_groups_is_refused():
  mesh = MeshSpec.parse("CFG=2,W=2,U=2,R=1").build()
  q, k, v = _inputs(2, 16, 4, 4, 8)
  with pytest.raises(ValueError, match=r"CFG=2 x W=2 = 4 device groups but the batch has 2 rows"):
    usp_attention(q, k, v, mesh=mesh)


def test_kv_head_order_matters():
  # K=2 kv heads on U=4: each must be repeated in grouped order (kv0 kv0 kv1 kv1).
  mesh = make_mesh(ulysses=4, ring=1)
  q, k, v = _inputs(1, 32, 8, 2, 16)
  ref = attention_reference(q, k, v)
  within(_err(usp_attention(q, k, v, mesh=mesh), ref), fp32_tol(v), "GQA")
  grouped = usp_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), mesh=mesh)
  within(_err(grouped, ref), fp32_tol(v), "grouped kv order")
  tiled = usp_attention(q, jnp.tile(k, (1, 1, 2, 1)), jnp.tile(v, (1, 1, 2, 1)), mesh=mesh)
  assert _err(tiled, ref) > 1e-2  # kv0 kv1 kv0 kv1 pairs query heads with the wrong kv head


def _collective_counts(hlo: str) -> dict[str, int]:
  ops = ("all-to-all", "collective-permute", "all-reduce", "all-gather")
  return {op: len(re.findall(rf"= [^\n]*? {op}(?:-start)?\(", hlo)) for op in ops}


@pytest.mark.parametrize("R,U", [(2, 2), (4, 2), (2, 4)])
def test_compiled_collectives(R, U):
  mesh = make_mesh(ulysses=U, ring=R)
  x = jax.ShapeDtypeStruct((1, 256, 8, 32), jnp.bfloat16)
  hlo = jax.jit(lambda q, k, v: usp_attention(q, k, v, mesh=mesh)).lower(x, x, x).compile().as_text()
  counts = _collective_counts(hlo)
  # the k sums gathered (added in mesh order), the maxima in one pmax
  assert counts == {"all-to-all": 2, "collective-permute": R - 1, "all-reduce": 1, "all-gather": 1}, counts


@pytest.mark.parametrize("U,R,N,K,match", [
    (4, 2, 6, 6, r"query heads N=6 are not divisible by the Ulysses degree U=4.*\(2, 4\)"),
    (4, 1, 12, 3, r"kv heads K=3 and U=4"),
])
def test_bad_heads_name_workable_meshes(U, R, N, K, match):
  mesh = make_mesh(ulysses=U, ring=R)
  q, k, v = _inputs(1, 16, N, K, 8)
  with pytest.raises(ValueError, match=match):
    usp_attention(q, k, v, mesh=mesh)


def test_workable_degrees():
  assert workable_degrees(8, 12, 12) == [(1, 8), (2, 4), (4, 2)]
  assert workable_degrees(4, 8, 2) == [(1, 4), (2, 2), (4, 1)]


def test_cross_attention_is_local():
  mesh = make_mesh(ulysses=2, ring=2)
  q, _, _ = _inputs(2, 30, 4, 4, 16)
  _, k, v = _inputs(2, 7, 4, 4, 16, seed=5)
  vl = jnp.asarray([7, 4], jnp.int32)
  out = cross_attention(q, k, v, mesh=mesh, kv_valid_len=vl)
  within(_err(out, attention_reference(q, k, v, kv_valid_len=vl)), fp32_tol(v), "cross-attention")
  hlo = jax.jit(lambda q, k, v: cross_attention(q, k, v, mesh=mesh)).lower(
      jax.ShapeDtypeStruct((2, 32, 4, 16), jnp.float32), k, v).compile().as_text()
  assert sum(_collective_counts(hlo).values()) == 0

