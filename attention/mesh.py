"""The JAX side of the device mesh: the sequence `PartitionSpec`s and `make_mesh` (`MeshSpec`, its
parsing and checks, live in the JAX-free `attention.mesh_spec` and are re-exported here).

Tokens are sharded over ring and ulysses jointly, ring-major: device (c, r, u) holds token chunk
r * U + u of batch rows c * B/C ... (c + 1) * B/C - 1, i.e. `P(CFG_AXIS, (RING_AXIS, ULYSSES_AXIS))`
(`SEQUENCE_SPEC`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec as P

from attention.mesh_spec import (CFG_AXIS, DEVICE_FLAG, MESH_AXES, RING_AXIS, SEQUENCE_AXES,
                                 ULYSSES_AXIS, MeshSpec, heads_fit, request_cpu_devices)

__all__ = ["CFG_AXIS", "DEVICE_FLAG", "MESH_AXES", "RING_AXIS", "SEQUENCE_AXES", "SEQUENCE_SPEC", "ULYSSES_AXIS",
           "MeshSpec", "batch_axis", "heads_fit", "make_mesh", "mesh_degrees", "request_cpu_devices",
           "sequence_spec"]

# Global [B, T, N, H] / [B, T, D] arrays: batch over cfg, T over ring and ulysses, ring-major.
SEQUENCE_SPEC = P(CFG_AXIS, SEQUENCE_AXES)


def make_mesh(ulysses: int = 1, ring: int = 1, devices: Sequence[jax.Device] | None = None, *,
              cfg: int = 1) -> Mesh:
  """`MeshSpec(ulysses, ring, cfg).build(devices)`: the (cfg, ring, ulysses) mesh.

  Raises:
    ValueError: a degree < 1, or fewer than C * R * U devices.
  """
  if not all(isinstance(d, int) and not isinstance(d, bool) for d in (ulysses, ring, cfg)):
    raise ValueError(f"mesh degrees must be positive integers, got {ulysses=} {ring=} {cfg=}")
  return MeshSpec(ulysses=ulysses, ring=ring, cfg=cfg).build(devices)


def mesh_degrees(mesh: Mesh) -> tuple[int, int]:
  """(U, R) of a mesh (`MeshSpec.of`; a ValueError if its axes are not the mesh axes)."""
  spec = MeshSpec.of(mesh)
  return spec.ulysses, spec.ring


def batch_axis(mesh: Mesh) -> str | None:
  """The axis the batch is split over inside `shard_map` (CFG_AXIS when the mesh has it)."""
  return CFG_AXIS if CFG_AXIS in mesh.axis_names else None


def sequence_spec(mesh: Mesh) -> P:
  """[B, T, ...] arrays on `mesh`: batch over cfg (if the mesh has it), T over ring and ulysses."""
  return P(batch_axis(mesh), SEQUENCE_AXES)
