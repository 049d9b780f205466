"""The mesh rules that need no devices, checked by the command line before JAX starts (this module
imports no JAX); `ParallelPlan.build` (parallel/plan.py) applies them with the rules that do."""

from __future__ import annotations

from attention.mesh_spec import MeshSpec


def check_spec(spec: MeshSpec, *, cfg_active: bool | None, heads: int | None = None,
               kv_heads: int | None = None) -> None:
  """The mesh rules that need no devices (JAX's backend need not have started): sharded weights
  need a mesh of several devices, CFG=2 needs guidance, U must split the heads. (A windows split
  W > 1 needs no rule of its own: a `MeshSpec` with W > 1 is a mesh of W or more devices.)

  Args:
    spec: the mesh asked for.
    cfg_active: whether guidance is on (None: not known yet).
    heads, kv_heads: the model's query and kv heads N, K (None: not known yet; K defaults to N).

  Raises:
    ValueError: each broken rule, naming the workable choices.
  """
  if spec.shard_weights and spec.devices == 1:
    raise ValueError(f"shard_weights=True splits the weights over the mesh's devices, but mesh {spec} has "
                     "one; pass a mesh of several devices (e.g. mesh='U=2,R=2') or leave shard_weights off")
  spec.check(num_heads=heads, num_kv_heads=kv_heads, device_count=spec.devices, cfg_active=cfg_active)
