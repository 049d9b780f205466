"""Where the transformer's video tokens live during one forward, built from a `ParallelPlan`.

Glossary (DESIGN.md section 1): B batch, T video tokens, L text tokens, N heads, H head dim,
U / R Ulysses / ring degrees.

On one device the tokens stay whole; under a mesh they are padded to a multiple of U * R and
sharded over ("ring", "ulysses") for the whole forward, the batch split over "cfg" when the mesh
has a guidance split, and over ("cfg", "windows") when it has a windows axis (`attention.mesh.batch_axis`;
DESIGN.md section 2). Self-attention is `attention.usp_attention` with the
valid token count as `kv_valid_len`; cross-attention is `attention.cross_attention` (local per
shard) against replicated text K/V.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import attention
from attention.mesh import SEQUENCE_AXES, MeshSpec, batch_axis, sequence_spec
from pipelines.parallel.plan import ParallelPlan


def padded_tokens(mesh: Mesh | None, tokens: int) -> int:
  """T rounded up to a multiple of the mesh's sequence devices U * R (T itself without a mesh).

  Raises:
    ValueError: a mesh without the mesh axes.
  """
  if mesh is None:
    return tokens
  shards = MeshSpec.of(mesh).sequence_devices
  return -(-tokens // shards) * shards


class SequenceLayout:
  """Where the video tokens live: one device (plan without a mesh) or sharded over
  ("ring", "ulysses"), the batch split over `attention.mesh.batch_axis` ("cfg", and "windows" when
  the mesh has that axis).

  Attributes:
    plan: the `ParallelPlan` it was built from.
    mesh: the plan's (cfg, ring, ulysses) or (cfg, windows, ring, ulysses) mesh, or None.
    tokens: T, the valid token count.
    padded_tokens: T rounded up to a multiple of U * R (== T without a mesh).
    gather_weights: the block weights arrive sharded over the mesh (`ParallelPlan.shard_weights`)
      and are gathered one layer at a time inside the layer scan.
    implementation: the attention path ("auto" | "lse" | "fixed_m").
    backend: the attention kernels' backend ("xla" | "pallas"), resolved by the plan.
    block_sizes: the attention kernels' `BlockSizes`, or None for their defaults.
  """

  def __init__(self, plan: ParallelPlan, tokens: int):
    if not isinstance(plan, ParallelPlan):
      raise ValueError(f"plan must be a pipelines.parallel.plan.ParallelPlan, got {type(plan).__name__}")
    self.plan = plan
    self.mesh = plan.mesh
    self.tokens = tokens
    self.implementation = plan.attention_implementation
    self.backend = plan.attention_backend
    self.exchange = plan.attention_exchange
    self.block_sizes = plan.block_sizes
    self.gather_weights = plan.shard_weights
    self.padded_tokens = padded_tokens(plan.mesh, tokens)

  @property
  def padding(self) -> int:
    return self.padded_tokens - self.tokens

  def constrain(self, x: jax.Array) -> jax.Array:
    """Pins axis 1 (tokens) of [B, T, ...] to the sequence sharding (and axis 0 to the row split
    over cfg / windows); a no-op without a mesh."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, sequence_spec(self.mesh)))

  def constrain_rows(self, x: jax.Array, axis: int = 0) -> jax.Array:
    """Pins the batch axis (`axis`) of a per-row array ([B, ...]: text states, time embeddings;
    [Z, B, ...]: text K/V) to the row split over cfg / windows (`batch_axis`), replicated
    otherwise; a no-op without a mesh."""
    if self.mesh is None:
      return x
    spec = P(*([None] * axis), batch_axis(self.mesh))
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def gathered(self, block: Any) -> Any:
    """One layer's weights, replicated (an all-gather of each sharded leaf) when the weights are
    sharded; as given otherwise."""
    if not self.gather_weights:
      return block
    replicated = NamedSharding(self.mesh, P())
    return jax.tree.map(lambda w: jax.lax.with_sharding_constraint(w, replicated), block)

  def constrain_table(self, x: jax.Array) -> jax.Array:
    """Pins axis 0 (tokens) of a [T, H/2] RoPE table to the sequence sharding."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(SEQUENCE_AXES, None)))

  def kv_valid_len(self, batch: int) -> jax.Array | None:
    """int32 [B] valid key count when tokens were padded, else None."""
    return jnp.full((batch,), self.tokens, jnp.int32) if self.padding else None

  def self_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_valid_len: jax.Array | None = None
                     ) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, N, H] (S == T but for a causal stream's cached keys) -> [B, T, N, H]:
    local attention, or USP over the mesh.

    q arrives pre-scaled by H^-1/2 * log2(e) (applied by the q producer in fp32
    before its one rounding), so the base-2 kernels use it as is. `kv_valid_len` (int32 [B]) masks
    the keys at positions >= it; None for the layout's own (the padded tokens', if any).
    """
    if kv_valid_len is None:
      kv_valid_len = self.kv_valid_len(q.shape[0])
    if self.mesh is None:
      return attention.local_attention(q, k, v, kv_valid_len=kv_valid_len, implementation=self.implementation,
                                       q_prescaled=True, block_sizes=self.block_sizes, backend=self.backend)
    return attention.usp_attention(q, k, v, mesh=self.mesh, kv_valid_len=kv_valid_len,
                                   implementation=self.implementation, q_prescaled=True,
                                   block_sizes=self.block_sizes, backend=self.backend, exchange=self.exchange)

  def cross_attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [B, T, N, H] (sequence-sharded), k/v [B, L, N, H] (replicated) -> [B, T, N, H], no mask.

    q arrives pre-scaled by H^-1/2 * log2(e), as in `self_attention`."""
    if self.mesh is None:
      return attention.local_attention(q, k, v, implementation=self.implementation, q_prescaled=True,
                                       block_sizes=self.block_sizes, backend=self.backend)
    return attention.cross_attention(q, k, v, mesh=self.mesh, implementation=self.implementation, q_prescaled=True,
                                     block_sizes=self.block_sizes, backend=self.backend)
