"""The pipeline's weights and where they are: the experts' states, the text encoder's weights, the VAE.

DESIGN.md section 2: replicated over the mesh, or with sharded weights the transformer's block
weights split over all its devices (`transformer.weight_shardings`) and the text encoder's large
weights too (`transformer.large_leaf_shardings`; otherwise it stays on one device, where it runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipelines.parallel import distributed
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan import vae as wan_vae
from pipelines.wan.encoders import umt5
from pipelines.wan.transformer import large_leaf_shardings, weight_shardings


class PlacedWeights:
  """The model's arrays, moved only when a call runs somewhere else.

  Attributes:
    experts: the experts' `nnx.State`s; assigning new ones (a fused LoRA) bumps `version`.
    version: counts weight changes (the fingerprint is recomputed after one).
    text_params: the text encoder's weights.
    text_mesh: the mesh the text encoder's weights are sharded over, or None (one device).
    vae: the VAE (on the default device; `vae_on(mesh)` replicates it over a decode's devices).
  """

  def __init__(self, experts: Sequence[nnx.State], text_params: umt5.Params, vae: wan_vae.WanVAE):
    self._experts = list(experts)
    self.version = 0
    self.text_params = text_params
    self.text_mesh: Mesh | None = None
    self.vae = vae
    self.placement: Any = "unplaced"
    self._plan: ParallelPlan | None = None  # the plan the weights were placed for
    self._vae_placed: tuple[Any, wan_vae.WanVAE] | None = None

  @property
  def experts(self) -> list[nnx.State]:
    return self._experts

  @experts.setter
  def experts(self, states: Sequence[nnx.State]) -> None:
    self._experts = list(states)
    self.version += 1

  def placed_at(self, plan: ParallelPlan) -> None:
    """Records that the weights already are where `plan` wants them (loaded straight there)."""
    self.placement = plan.placement
    self._plan = plan
    self.text_mesh = plan.mesh if plan.shard_weights else None

  def place(self, plan: ParallelPlan) -> None:
    """Puts the weights where `plan` runs them (a no-op when they are there already)."""
    if self.placement == plan.placement:
      return
    self._experts = [distributed.put_sharded(s, weight_shardings(s, plan.mesh, plan.shard_weights))
                     for s in self._experts]
    if plan.shard_weights:
      self.text_params = distributed.put_sharded(self.text_params,
                                                 large_leaf_shardings(self.text_params, plan.mesh))
      self.text_mesh = plan.mesh
    elif self.text_mesh is not None:  # back to one device
      self.text_params = jax.device_put(self.text_params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
      self.text_mesh = None
    self.placement = plan.placement
    self._plan = plan

  def replace_experts(self, states: Sequence[nnx.State]) -> None:
    """New expert states (other arrays: quantized weights) put where the current ones are placed
    (`weight_shardings` of the new leaves under the last plan; as given when never placed)."""
    if self._plan is not None:
      states = [distributed.put_sharded(s, weight_shardings(s, self._plan.mesh, self._plan.shard_weights))
                for s in states]
    self.experts = states

  def vae_on(self, mesh: Mesh) -> wan_vae.WanVAE:
    """The VAE's weights replicated over the decode's devices (`vae.row_mesh(mesh)`), placed once
    per device set."""
    rows = wan_vae.row_mesh(mesh)
    key = (id(self.vae), tuple(d.id for d in rows.devices.flat))
    if self._vae_placed is None or self._vae_placed[0] != key:
      self._vae_placed = (key, jax.device_put(self.vae, NamedSharding(rows, P())))
    return self._vae_placed[1]
