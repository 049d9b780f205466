"""What every TPU test needs: the two backends of one TPU process, and the CPU reference's checks.

On a TPU host with JAX_PLATFORMS unset (tests/conftest.py's TPU pass) JAX holds the TPU (the
default backend) and the CPU backend beside it; a reference is computed on the CPU by putting its
inputs there (a jitted function runs where its committed inputs live).
"""

from __future__ import annotations

from typing import Any

import jax


def tpu() -> jax.Device:
  """The first TPU device (the default backend in the TPU pass)."""
  return jax.devices("tpu")[0]


def cpu() -> jax.Device:
  """The CPU backend's first device (the references' device)."""
  return jax.devices("cpu")[0]


def on(device: jax.Device, tree: Any) -> Any:
  """`tree`'s arrays committed to `device`."""
  return jax.device_put(tree, device)


def assert_on(tree: Any, platform: str, what: str) -> None:
  """Every array of `tree` lives on `platform` ("tpu" / "cpu"): a reference that silently ran on
  the TPU would compare the TPU with itself."""
  found = {d.platform for leaf in jax.tree.leaves(tree) for d in leaf.devices()}
  assert found == {platform}, f"{what} ran on {sorted(found)}, expected {platform}"
