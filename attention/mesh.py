"""The (ring, ulysses) device mesh: axis names and the one constructor.

DESIGN.md section 2: ulysses is the inner axis (its all-to-all stays among neighbouring devices),
ring the outer one (may cross hosts). Tokens are sharded over both axes jointly, ring-major:
device (r, u) holds token chunk r * U + u, i.e. `P(None, (RING_AXIS, ULYSSES_AXIS))`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

RING_AXIS = "ring"
ULYSSES_AXIS = "ulysses"
SEQUENCE_AXES = (RING_AXIS, ULYSSES_AXIS)
# Global [B, T, N, H] / [B, T, D] arrays are sharded along T over both axes, ring-major.
SEQUENCE_SPEC = P(None, SEQUENCE_AXES)


def make_mesh(ulysses: int = 1, ring: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the `(ring, ulysses)` mesh of shape (R, U) with Auto axis types.

  Args:
    ulysses: U, the Ulysses (all-to-all over heads) degree, >= 1.
    ring: R, the ring (K/V rotation) degree, >= 1.
    devices: the devices to use, at least U * R of them (default `jax.devices()`); the first U * R
      are laid out row-major, so consecutive devices share a Ulysses group.

  Raises:
    ValueError: U or R < 1, or fewer than U * R devices.
  """
  if not (isinstance(ulysses, int) and isinstance(ring, int)) or ulysses < 1 or ring < 1:
    raise ValueError(f"mesh degrees must be positive integers, got {ulysses=} {ring=}")
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < ulysses * ring:
    raise ValueError(
        f"mesh ring={ring} x ulysses={ulysses} needs {ring * ulysses} devices but only "
        f"{len(devices)} are available; use a smaller mesh (on CPU, set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={ring * ulysses} before JAX starts)")
  grid = np.array(devices[: ulysses * ring], dtype=object).reshape(ring, ulysses)
  axis_types = (jax.sharding.AxisType.Auto,) * 2
  return Mesh(grid, (RING_AXIS, ULYSSES_AXIS), axis_types=axis_types)


def mesh_degrees(mesh: Mesh) -> tuple[int, int]:
  """Returns (U, R) of a mesh built by `make_mesh` (a ValueError if its axes are not named so)."""
  names = tuple(mesh.axis_names)
  if RING_AXIS not in names or ULYSSES_AXIS not in names:
    raise ValueError(f"mesh axes must include {RING_AXIS!r} and {ULYSSES_AXIS!r}, got {names}")
  return int(mesh.shape[ULYSSES_AXIS]), int(mesh.shape[RING_AXIS])
