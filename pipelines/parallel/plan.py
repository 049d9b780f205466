"""The parallel plan: where and how one generation runs, built once per call, every mesh rule here.

A `ParallelPlan` holds the mesh as the user asked for it (`attention.MeshSpec`: degrees and weight
sharding), the built (cfg, ring, ulysses) `jax.sharding.Mesh` ((cfg, windows, ring, ulysses) with a
windows split: W context windows run at once, their rows on separate device groups), the attention
settings (path, the backend resolved once for the mesh's platform, block sizes) and the VAE's
parallel decode. It is frozen and hashable: the one static argument of the jitted denoise step,
and what the transformer's sequence layout (`wan.transformer.SequenceLayout`) is built from.

The rules, each written once (`ParallelPlan.build`):
- U must split the heads (and the kv heads); C * W * R * U devices must be visible;
- CFG=2 needs guidance on;
- sharded weights need a mesh of several devices (`check_spec`: the rules that need no devices);
- in a multi-process run the mesh spans every process's devices (`distributed`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from attention import BACKENDS, IMPLEMENTATIONS, BlockSizes, resolve_backend
from attention.fp8_exchange import EXCHANGES
from attention.mesh import MeshSpec
from pipelines.parallel.mesh_rules import check_spec
from pipelines.parallel import distributed


def _not_a(value: Any) -> str:
  name = type(value).__name__
  return f", not {'an' if name[0] in 'aeiou' else 'a'} {name}"


def _mesh_and_spec(mesh: Mesh | MeshSpec | str | None, shard_weights: bool) -> tuple[Mesh | None, MeshSpec]:
  """The call's mesh argument as (built mesh or None, spec); the spec's shard_weights is the OR."""
  if mesh is None:
    return None, MeshSpec(shard_weights=shard_weights)
  if isinstance(mesh, str):
    return None, MeshSpec.parse(mesh, shard_weights=shard_weights)
  if isinstance(mesh, MeshSpec):
    return None, dataclasses.replace(mesh, shard_weights=mesh.shard_weights or shard_weights)
  if isinstance(mesh, Mesh):
    return mesh, MeshSpec.of(mesh, shard_weights=shard_weights)
  raise ValueError(f"mesh must be None, a spec string like 'U=2,R=2' or 'CFG=2,U=2,R=2', an "
                   f"attention.MeshSpec or a jax.sharding.Mesh; got {mesh!r}{_not_a(mesh)}")


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
  """Where one generation runs and how its attention is computed (frozen, hashable).

  Attributes:
    spec: the `MeshSpec` (C, W, R, U degrees and `shard_weights`); `MeshSpec()` on one device.
    mesh: the built (cfg, ring, ulysses) or (cfg, windows, ring, ulysses) mesh, or None (one
      device: the first).
    attention_implementation: "auto" | "lse" | "fixed_m", the transformer's attention path.
    attention_backend: "xla" | "pallas", resolved for the mesh's platform ("auto" never stays).
    block_sizes: the attention kernels' `BlockSizes`, or None for `attention`'s defaults.
    vae_parallel: decode with the latents split along height over the mesh's devices.
    attention_exchange: "bf16" or "fp8": the dtype of Q, V and the output in USP's Ulysses
      all-to-alls (`attention.fp8_exchange`; K stays bf16).
  """
  spec: MeshSpec
  mesh: Mesh | None
  attention_implementation: str = "auto"
  attention_backend: str = "xla"
  block_sizes: BlockSizes | None = None
  vae_parallel: bool = True
  attention_exchange: str = "bf16"

  @classmethod
  def build(cls, mesh: Mesh | MeshSpec | str | None = None, *, heads: int, kv_heads: int | None = None,
            cfg_active: bool | None = None, shard_weights: bool = False,
            attention_implementation: str = "auto", attention_backend: str = "auto",
            block_sizes: BlockSizes | None = None, vae_parallel: bool = True,
            attention_exchange: str = "bf16") -> ParallelPlan:
    """Checks a call's parallel settings against the model and the devices, and builds the plan.

    Args:
      mesh: None (one device), a spec string ("U=2,R=2"; "CFG=2,U=2,R=2"; "CFG=2,W=2,U=2,R=1"), a
        `MeshSpec`, or a built `jax.sharding.Mesh` with axes (cfg,) (windows,) ring, ulysses.
      heads, kv_heads: the transformer's query and kv heads N, K (U must split them; K defaults to N).
      cfg_active: whether guidance is on (CFG=2 needs it); None: not known yet (a load).
      shard_weights: shard the transformer's block weights over the mesh (also set by a `MeshSpec`).
      attention_implementation: "auto" | "lse" | "fixed_m".
      attention_backend: "auto" | "xla" | "pallas"; "auto" becomes "pallas" on TPU/GPU, else "xla".
      block_sizes: None or `attention.BlockSizes`.
      vae_parallel: decode split over the mesh (no effect without one).
      attention_exchange: "bf16" | "fp8" (no effect without Ulysses).

    Raises:
      ValueError: a malformed mesh, more devices than visible, heads that U does not split, CFG=2
        without guidance, shard_weights without a mesh, a mesh that does not span every process,
        an unknown attention implementation or backend, a non-bool flag; each naming the fix.
    """
    for name, flag in (("shard_weights", shard_weights), ("vae_parallel", vae_parallel)):
      if not isinstance(flag, bool):
        raise ValueError(f"{name}={flag!r} must be True or False{_not_a(flag)}")
    if not isinstance(attention_implementation, str) or attention_implementation not in IMPLEMENTATIONS:
      raise ValueError(f"unknown {attention_implementation=}; expected one of {IMPLEMENTATIONS}")
    if not isinstance(attention_backend, str) or attention_backend not in BACKENDS:
      raise ValueError(f"unknown {attention_backend=}; expected one of {BACKENDS}")
    if attention_exchange not in EXCHANGES:
      raise ValueError(f"unknown {attention_exchange=}; expected one of {EXCHANGES}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
      raise ValueError(f"block_sizes={block_sizes!r} must be None or an attention.BlockSizes{_not_a(block_sizes)}")
    built, spec = _mesh_and_spec(mesh, shard_weights)
    if mesh is None:
      if spec.shard_weights:
        raise ValueError("shard_weights=True splits the weights over a mesh; pass a mesh of several "
                         "devices (e.g. mesh='U=2,R=2') or leave shard_weights off")
      distributed.check_mesh_spans_processes(None)
    else:
      distributed.check_equal_device_counts()  # per-process counts named before the total
      spec.check(device_count=spec.devices if built is not None else jax.device_count(),
                 platform=jax.default_backend())
      check_spec(spec, cfg_active=cfg_active, heads=heads, kv_heads=kv_heads)
      distributed.check_mesh_spans_processes(spec.devices)
      built = spec.build(jax.devices()) if built is None else built
    platform = jax.default_backend() if built is None else built.devices.flat[0].platform
    return cls(spec=spec, mesh=built, attention_implementation=attention_implementation,
               attention_backend=resolve_backend(attention_backend, platform), block_sizes=block_sizes,
               vae_parallel=vae_parallel, attention_exchange=attention_exchange)

  @classmethod
  def single(cls, attention_implementation: str = "auto", attention_backend: str = "auto") -> ParallelPlan:
    """One device (the first), no checks beyond the attention names."""
    return cls.build(None, heads=1, attention_implementation=attention_implementation,
                     attention_backend=attention_backend)

  # --- what the layers above ask of it ---

  @property
  def shard_weights(self) -> bool:
    """The transformer's block weights are split over the mesh and gathered a layer at a time."""
    return self.spec.shard_weights and self.mesh is not None

  @property
  def cfg_parallel(self) -> bool:
    """The cond and uncond halves of the batch run on the two halves of the devices (CFG=2)."""
    return self.mesh is not None and self.spec.cfg == 2

  @property
  def windows(self) -> int:
    """W: the context windows a forward runs at once, their rows split over the mesh's "windows"
    axis (cfg-major: `attention.mesh.batch_axis`); 1 without a mesh or without a windows split."""
    return 1 if self.mesh is None else self.spec.windows

  @property
  def replicated(self) -> jax.sharding.Sharding:
    """Where replicated arrays (latents, solver state, text states) live: the whole mesh, or the
    first device."""
    if self.mesh is None:
      return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(self.mesh, P())

  @property
  def decode_mesh(self) -> Mesh | None:
    """The mesh the VAE decodes over (`vae_parallel`), or None: one device."""
    return self.mesh if self.vae_parallel else None

  @property
  def placement(self) -> Any:
    """Identifies where the weights go under this plan (None: the first device); two plans with
    the same placement share placed weights."""
    if self.mesh is None:
      return None
    return (tuple(d.id for d in self.mesh.devices.flat), tuple(self.mesh.shape.items()), self.shard_weights)

  def describe(self) -> dict[str, Any]:
    """For settings and sidecars: the mesh (`MeshSpec.describe`, with its CFG, W, U, R; None on one
    device), the attention path and backend, and whether the decode is split."""
    return {"mesh": None if self.mesh is None else self.spec.describe(),
            "attention_implementation": self.attention_implementation,
            "attention_backend": self.attention_backend, "attention_exchange": self.attention_exchange,
            "vae_parallel": bool(self.vae_parallel and self.mesh is not None)}

  def __str__(self) -> str:
    return "one device" if self.mesh is None else str(self.spec)
