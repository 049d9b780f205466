"""The harness's own safeguards (tests/conftest.py)."""

import gc

import jax
import jax.numpy as jnp

from tests.conftest import MAX_MAP_REGIONS, map_regions


def test_clearing_the_caches_releases_compiled_programs_maps():
  """Compiled programs hold memory-map regions until JAX's caches are cleared (what the harness
  does between modules past MAX_MAP_REGIONS, far below the kernel's 65,530)."""
  before = map_regions()
  programs = [jax.jit(lambda x, i=i: x * i + i) for i in range(200)]
  for f in programs:
    f(jnp.ones((3,)))
  held = map_regions()
  assert held - before > 200, (before, held)  # each program maps its code
  jax.clear_caches()
  gc.collect()
  assert map_regions() - before < (held - before) // 4
  assert MAX_MAP_REGIONS < 65_530 // 2
