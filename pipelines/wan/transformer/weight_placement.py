"""Where a Wan transformer's weights go on a mesh: replicated, or split for FSDP / ZeRO-3.

The layer scan (`transformer.model.run_blocks`) all-gathers one layer of split block weights at a time
(`SequenceLayout.gathered`) when the plan shards the weights (`ParallelPlan.shard_weights`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def weight_shardings(state: Any, mesh: Mesh | None, shard_weights: bool = False) -> Any:
  """Where a `WanTransformer`'s weights (an `nnx.State`) go on `mesh`: a pytree of shardings.

  Replicated over the mesh by default (DESIGN.md section 2). With `shard_weights` (FSDP / ZeRO-3
  over all C * R * U devices), each stacked block weight [Z, ...] is split along its largest
  non-layer axis that the device count divides (`forward` under a plan with `shard_weights`
  all-gathers one layer at a time inside the layer scan); the rest (embeddings, output head: a few percent of the
  weights) and block weights with no such axis stay replicated.

  Args:
    state: the weights (leaves are arrays; the block weights under a "blocks" key, a VACE
      transformer's VACE blocks under "vace_blocks", placed alike).
    mesh: None (one device: `SingleDeviceSharding` of the first device) or the mesh.
    shard_weights: split the block weights as above.
  """
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, state)

  def place(path, leaf) -> NamedSharding:
    in_blocks = any(getattr(k, "key", getattr(k, "name", None)) in ("blocks", "vace_blocks") for k in path)
    if not (shard_weights and in_blocks):
      return NamedSharding(mesh, P())
    return _split_largest_axis(mesh, tuple(leaf.shape), first_axis=1)

  return jax.tree_util.tree_map_with_path(place, state)


def _split_largest_axis(mesh: Mesh, shape: tuple[int, ...], first_axis: int = 0) -> NamedSharding:
  """A sharding of `shape` over all of the mesh's devices along its largest axis (from
  `first_axis` on) that the device count divides; replicated when there is none."""
  devices = mesh.devices.size
  options = [d for d in range(first_axis, len(shape)) if shape[d] % devices == 0]
  if devices == 1 or not options:
    return NamedSharding(mesh, P())
  d = max(options, key=lambda i: shape[i])
  return NamedSharding(mesh, P(*([None] * d), tuple(mesh.axis_names)))


LARGE_LEAF_ELEMENTS = 1 << 20  # `large_leaf_shardings`' default: leaves of 4 MiB (fp32) or more


def large_leaf_shardings(tree: Any, mesh: Mesh, min_elements: int | None = None) -> Any:
  """Shardings for a weight tree that has no layer structure to gather from (the UMT5 text
  encoder): every leaf of at least `min_elements` values split along its largest axis that the
  device count divides, the rest replicated. Under jit GSPMD then partitions their matmuls
  (tensor-parallel; a reduction's order, and so its rounding, may change). `min_elements` defaults
  to `LARGE_LEAF_ELEMENTS`."""
  min_elements = LARGE_LEAF_ELEMENTS if min_elements is None else min_elements
  return jax.tree.map(lambda leaf: (_split_largest_axis(mesh, tuple(leaf.shape)) if leaf.size >= min_elements
                                    else NamedSharding(mesh, P())), tree)

