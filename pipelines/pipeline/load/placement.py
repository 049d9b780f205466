"""The pipeline's weights and where they are: the experts' states, the text encoder's weights, the VAE.

DESIGN.md section 2: replicated over the mesh, or with sharded weights the transformer's block
weights split over all its devices (`transformer.weight_shardings`) and the text encoder's large
weights too (`transformer.large_leaf_shardings`; otherwise it stays on one device, where it runs).

Under a memory plan that moves weights (`parallel.memory.MemoryPlan`), the text encoder and the
experts may leave the device between the stages that use them: the host keeps a numpy copy of each
(taken once; a changed expert, a fused LoRA, drops it), so leaving frees the device at once and
coming back is one upload. Weights only move in a one-process run with replicated weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pipelines.parallel import distributed
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan import vae as wan_vae
from pipelines.wan.encoders import UMT5Params
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

  def __init__(self, experts: Sequence[nnx.State], text_params: UMT5Params, vae: wan_vae.WanVAE):
    self._experts = list(experts)
    self.version = 0
    self.text_params = text_params
    self.text_mesh: Mesh | None = None
    self._vae = vae
    self.placement: Any = "unplaced"
    self._plan: ParallelPlan | None = None  # the plan the weights were placed for
    self._vae_placed: tuple[Any, wan_vae.WanVAE] | None = None
    self._text_host: UMT5Params | None = None  # numpy copies, taken when the weights first leave
    self._experts_host: list[nnx.State | None] = [None] * len(self._experts)
    self._experts_away: set[int] = set()  # experts whose device copy was dropped
    self._vae_host: wan_vae.WanVAE | None = None  # the VAE's numpy copy while it is off the device
    self._vae_where: list[Any] = []  # its leaves' placements then (`_placements`)

  @property
  def vae(self) -> wan_vae.WanVAE:
    return self._vae

  @vae.setter
  def vae(self, vae: wan_vae.WanVAE) -> None:
    """A new VAE (or the same moved by the caller) replaces any dropped one: `restore_vae` must not
    bring the old host copy back over it, nor `vae_on` serve the old one's replicas."""
    self._vae, self._vae_host, self._vae_where, self._vae_placed = vae, None, [], None

  @property
  def experts(self) -> list[nnx.State]:
    return self._experts

  @experts.setter
  def experts(self, states: Sequence[nnx.State]) -> None:
    self._experts = list(states)
    self._experts_host = [None] * len(self._experts)  # the host copies are of the old weights
    self._experts_away = set()
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
    self._experts = [_put(s, plan) for s in self._experts]
    self._experts_away = set()  # every expert is on the devices again
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
      states = [_put(s, self._plan) for s in states]
    self.experts = states

  def vae_on(self, mesh: Mesh) -> wan_vae.WanVAE:
    """The VAE's weights replicated over the decode's devices (`vae.row_mesh(mesh)`), placed once
    per device set."""
    rows = wan_vae.row_mesh(mesh)
    key = (id(self.vae), tuple(d.id for d in rows.devices.flat))
    if self._vae_placed is None or self._vae_placed[0] != key:
      self._vae_placed = (key, jax.device_put(self.vae, NamedSharding(rows, P())))
    return self._vae_placed[1]

  # --- weights that leave the device between stages (a memory plan's moves) ---

  def text_params_on(self, where: str) -> UMT5Params:
    """The text encoder's weights placed for an encode: "device" (the default device; uploaded from
    the host copy when dropped) or "host" (the CPU backend's first device, where the encode then runs).

    Raises: ValueError: an unknown `where`.
    """
    if where not in ("device", "host"):
      raise ValueError(f"where={where!r}; use 'device' or 'host'")
    target = jax.devices()[0] if where == "device" else jax.devices("cpu")[0]
    leaves = jax.tree.leaves(self.text_params)
    if all(isinstance(x, jax.Array) and x.devices() == {target} for x in leaves):
      return self.text_params
    if where == "device":
      self.text_params = _upload(self._host_text(), target)
      return self.text_params
    # The CPU backend's copy becomes the host copy (numpy views of it share its memory): one host
    # copy, not two. Its leaves replace the numpy ones one at a time (the list holds the only
    # references), so the host holds one extra leaf at most.
    leaves, treedef = jax.tree.flatten(self._host_text())
    self._text_host = self.text_params = None
    try:
      for i, leaf in enumerate(leaves):
        leaves[i] = jax.block_until_ready(jax.device_put(leaf, target))
    finally:  # numpy and CPU-backend leaves alike are a host copy
      self.text_params = self._text_host = treedef.unflatten(leaves)
    return self.text_params

  def drop_text(self) -> None:
    """Frees the text encoder's device memory (the host copy stays; `text_params_on` uploads it again)."""
    host = self._host_text()
    _delete_device_copies(self.text_params)
    self.text_params = host

  def _host_text(self) -> UMT5Params:
    if self._text_host is None:
      self._text_host = _to_numpy(self.text_params)
    return self._text_host

  def drop_experts(self, indices: Sequence[int]) -> None:
    """Frees the device memory of the experts `indices` (their host copies stay)."""
    for i in indices:
      if i in self._experts_away:
        continue
      if self._experts_host[i] is None:
        self._experts_host[i] = _to_numpy(self._experts[i])
      _delete_device_copies(self._experts[i])
      self._experts[i] = self._experts_host[i]
      self._experts_away.add(i)

  def restore_experts(self, indices: Sequence[int]) -> None:
    """Uploads the experts `indices` dropped before, where the last plan placed them."""
    for i in indices:
      if i not in self._experts_away:
        continue
      state = self._experts_host[i]
      self._experts[i] = _put(state, self._plan) if self._plan is not None else _upload(state, jax.devices()[0])
      self._experts_away.discard(i)

  def drop_vae(self) -> None:
    """Frees the VAE's device memory (its host copy stays, and each leaf's placement: `restore_vae`
    uploads it again as it was)."""
    if self._vae_host is not None:
      return
    host = _to_numpy(self.vae)
    self._vae_where = _placements(self.vae)
    self._vae_placed = None  # the decode's copy too
    _delete_device_copies(self.vae)
    self._vae, self._vae_host = host, host

  def restore_vae(self) -> None:
    """Uploads the VAE dropped before as it was placed (a no-op when it is there): a leaf committed to
    a device or sharding goes back there, an uncommitted one to the default device uncommitted, so
    that the decoder's programs lowered before the drop (`decoding.lower_decoder`, compiled ahead) are
    the ones the decode calls, not a second pair for committed arguments."""
    if self._vae_host is not None:
      self._vae, self._vae_host = _put_back(self._vae_host, self._vae_where), None

  def host_bytes(self) -> int:
    """Bytes of the weights held on the host now (numpy arrays and the CPU backend's; each once)."""
    trees = (self.text_params, self._text_host, self._experts, self._experts_host, self.vae, self._vae_host)
    held = {id(x): x for x in jax.tree.leaves(trees) if isinstance(x, np.ndarray)
            or (isinstance(x, jax.Array) and next(iter(x.devices())).platform == "cpu")}
    return int(sum(x.nbytes for x in held.values()))

  def bytes_of(self) -> dict[str, Any]:
    """Bytes of the weights by component: "text_encoder", "experts" (a tuple), "vae"."""
    return {"text_encoder": _nbytes(self.text_params), "experts": tuple(_nbytes(s) for s in self._experts),
            "vae": _nbytes(self.vae)}


def _put(state: nnx.State, plan: ParallelPlan) -> nnx.State:
  """An expert's weights where `plan` runs them (replicated, or its block weights sharded)."""
  shardings = weight_shardings(state, plan.mesh, plan.shard_weights)
  return _upload(state, shardings) if jax.process_count() == 1 else distributed.put_sharded(state, shardings)


def _upload(tree: Any, where: Any) -> Any:
  """`jax.device_put(tree, where)` (`where`: a device, or a sharding per leaf), one leaf at a time,
  each transfer finished before the next starts. A whole tree's put may stage a host copy of every
  leaf at once (measured on XLA:CPU: the CPU backend's copy of the 11.4 GB UMT5-XXL made beside the
  numpy one); here the host stages one leaf at most."""
  if isinstance(where, (jax.Device, jax.sharding.Sharding)):
    return jax.tree.map(lambda x: jax.block_until_ready(jax.device_put(x, where)), tree)
  return jax.tree.map(lambda x, s: jax.block_until_ready(jax.device_put(x, s)), tree, where)


def _placements(tree: Any) -> list[Any]:
  """Each leaf's sharding where the array is committed to it, else None (uncommitted: JAX may move
  it to a computation's devices), in `jax.tree.leaves` order."""
  return [x.sharding if isinstance(x, jax.Array) and x.committed else None for x in jax.tree.leaves(tree)]


def _put_back(tree: Any, placements: list[Any]) -> Any:
  """`tree`'s leaves uploaded one at a time (as `_upload`) to `_placements`' shardings; None: the
  default device, uncommitted (`jax.device_put` without a device)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [jax.block_until_ready(jax.device_put(x, where))
                                      for x, where in zip(leaves, placements, strict=True)])


def _nbytes(tree: Any) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def _to_numpy(tree: Any) -> Any:
  """A pytree's arrays as numpy on the host (one device-to-host copy each)."""
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _delete_device_copies(tree: Any) -> None:
  """Deletes the device buffers of a pytree's jax arrays now (not when the last reference goes).
  Arrays on the CPU backend are left to the garbage collector: the host copy (`np.asarray` of such
  an array) may share their buffer."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not x.is_deleted() and next(iter(x.devices())).platform != "cpu":
      x.delete()
