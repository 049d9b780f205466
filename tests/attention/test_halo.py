"""Sliding-window attention with halo exchange and the strategy switch (attention/halo.py) on fake CPU
meshes, against the dense windowed reference; the compiled program moves only the window."""

import re

import jax
import jax.numpy as jnp
import pytest

from attention import MeshSpec, attention_reference, make_mesh
from attention.halo import halo_attention, sequence_parallel_attention
from tests.attention.test_usp import _collective_counts, _err, _inputs
from tests.numerics import fp32_attention_tol as fp32_tol
from tests.numerics import within

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


@pytest.mark.parametrize("shards", [2, 4, 8])
@pytest.mark.parametrize("window", ["smaller", "equal", "larger"])
@pytest.mark.parametrize("causal", [False, True])
def test_halo_matches_windowed_reference(shards, window, causal):
  mesh = make_mesh(ulysses=2 if shards >= 4 else 1, ring=shards // (2 if shards >= 4 else 1))
  T = 48
  shard = T // shards
  w = {"smaller": max(1, shard // 2), "equal": shard, "larger": 2 * shard + 1}[window]
  q, k, v = _inputs(2, T, 4, 2, 16)
  vl = jnp.asarray([T, T - 5], jnp.int32)
  ref = attention_reference(q, k, v, window=w, causal=causal, kv_valid_len=vl)
  out = halo_attention(q, k, v, mesh=mesh, window=w, causal=causal, kv_valid_len=vl)
  within(_err(out, ref), fp32_tol(v), "halo")


@pytest.mark.parametrize("spec", ["W=2,U=2,R=1", "CFG=2,W=2,U=1,R=2"])
def test_window_attention_rows_split_over_windows(spec):
  """Batch rows over (cfg, windows), tokens over (ring, ulysses): both exchanges equal the reference."""
  mesh = MeshSpec.parse(spec).build()
  q, k, v = _inputs(4, 48, 4, 2, 16, seed=6)
  vl = jnp.asarray([48, 43, 30, 48], jnp.int32)
  for causal in (False, True):
    ref = attention_reference(q, k, v, window=5, causal=causal, kv_valid_len=vl)
    for strategy in ("halo", "all_gather"):
      out = sequence_parallel_attention(q, k, v, mesh=mesh, window=5, causal=causal, kv_valid_len=vl,
                                        strategy=strategy)
      within(_err(out, ref), fp32_tol(v), f"{spec} {strategy} causal={causal}")
      rows_split = jax.sharding.PartitionSpec(("cfg", "windows"), ("ring", "ulysses"))
      assert out.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, rows_split), 4), out.sharding


def test_halo_moves_only_the_window():
  mesh = make_mesh(ulysses=2, ring=2)
  x = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.float32)
  hlo = jax.jit(lambda q, k, v: halo_attention(q, k, v, mesh=mesh, window=4)).lower(x, x, x).compile().as_text()
  counts = _collective_counts(hlo)
  assert counts["collective-permute"] == 2 and counts["all-gather"] == 0 and counts["all-to-all"] == 0
  # Each permute carries the packed K/V halo [2, B, w, K, H] only.
  assert re.search(r"f32\[2,1,4,4,16\][^\n]*collective-permute", hlo)


def test_strategy_switch():
  mesh = make_mesh(ulysses=2, ring=2)
  q, k, v = _inputs(1, 40, 4, 4, 16)
  ref_global = attention_reference(q, k, v)
  ref_local = attention_reference(q, k, v, window=6)
  within(_err(sequence_parallel_attention(q, k, v, mesh=mesh), ref_global), fp32_tol(v), "strategy usp")
  for strategy in ("halo", "all_gather", None):
    out = sequence_parallel_attention(q, k, v, mesh=mesh, window=6, strategy=strategy)
    within(_err(out, ref_local), fp32_tol(v), strategy)
  with pytest.raises(ValueError, match="unknown strategy"):
    sequence_parallel_attention(q, k, v, mesh=mesh, window=6, strategy="ring")
  with pytest.raises(ValueError, match="global"):
    sequence_parallel_attention(q, k, v, mesh=mesh, window=6, strategy="usp")
