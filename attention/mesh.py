"""The JAX side of the device mesh: the sequence `PartitionSpec`s and `make_mesh` (`MeshSpec`, its
parsing and checks, live in the JAX-free `attention.mesh_spec` and are re-exported here).

Tokens are sharded over ring and ulysses jointly, ring-major: device (c, r, u) holds token chunk
r * U + u of batch rows c * B/C ... (c + 1) * B/C - 1, i.e. `P(CFG_AXIS, (RING_AXIS, ULYSSES_AXIS))`
(`SEQUENCE_SPEC`). A mesh with a windows axis (W > 1) splits the rows over (cfg, windows), cfg-major:
device (c, w, r, u) holds token chunk r * U + u of row chunk c * W + w (of C * W chunks), i.e.
`P((CFG_AXIS, WINDOWS_AXIS), (RING_AXIS, ULYSSES_AXIS))`; `batch_axis` and `sequence_spec` give the
spec of any mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec as P

from attention.mesh_spec import (CFG_AXIS, DEVICE_FLAG, MESH_AXES, RING_AXIS, SEQUENCE_AXES,
                                 ULYSSES_AXIS, WINDOWS_AXIS, WINDOWS_MESH_AXES, MeshSpec, heads_fit,
                                 request_cpu_devices)

__all__ = ["CFG_AXIS", "DEVICE_FLAG", "MESH_AXES", "RING_AXIS", "SEQUENCE_AXES", "SEQUENCE_SPEC", "ULYSSES_AXIS",
           "WINDOWS_AXIS", "WINDOWS_MESH_AXES", "MeshSpec", "batch_axis", "heads_fit", "make_mesh",
           "mesh_degrees", "request_cpu_devices", "sequence_spec"]

# Global [B, T, N, H] / [B, T, D] arrays on a mesh without a windows axis: batch over cfg, T over
# ring and ulysses, ring-major (`sequence_spec(mesh)` for any mesh).
SEQUENCE_SPEC = P(CFG_AXIS, SEQUENCE_AXES)


def make_mesh(ulysses: int = 1, ring: int = 1, devices: Sequence[jax.Device] | None = None, *,
              cfg: int = 1, windows: int = 1) -> Mesh:
  """`MeshSpec(ulysses, ring, cfg, windows=windows).build(devices)`: the (cfg, ring, ulysses) mesh,
  or (cfg, windows, ring, ulysses) when windows > 1.

  Raises:
    ValueError: a degree < 1, or fewer than C * W * R * U devices.
  """
  if not all(isinstance(d, int) and not isinstance(d, bool) for d in (ulysses, ring, cfg, windows)):
    raise ValueError(f"mesh degrees must be positive integers, got {ulysses=} {ring=} {cfg=} {windows=}")
  return MeshSpec(ulysses=ulysses, ring=ring, cfg=cfg, windows=windows).build(devices)


def mesh_degrees(mesh: Mesh) -> tuple[int, int]:
  """(U, R) of a mesh (`MeshSpec.of`; a ValueError if its axes are not the mesh axes)."""
  spec = MeshSpec.of(mesh)
  return spec.ulysses, spec.ring


def batch_axis(mesh: Mesh) -> str | tuple[str, ...] | None:
  """The axis (or axes) the batch rows are split over, for a `PartitionSpec` entry or a collective's
  axis name: CFG_AXIS when the mesh has no windows axis (as a three-axis mesh always had), the
  tuple (CFG_AXIS, WINDOWS_AXIS) when it has one (rows split cfg-major: device group (c, w) holds
  row chunk c * W + w), WINDOWS_AXIS alone on a mesh with windows but no cfg axis, None with neither."""
  axes = tuple(a for a in (CFG_AXIS, WINDOWS_AXIS) if a in mesh.axis_names)
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def sequence_spec(mesh: Mesh) -> P:
  """[B, T, ...] arrays on `mesh`: batch over `batch_axis(mesh)` (cfg, and windows when the mesh
  has it), T over ring and ulysses."""
  return P(batch_axis(mesh), SEQUENCE_AXES)
