"""A causal Wan stream: latent chunks made one after another, each attending to a KV cache of the
frames before it, as in Self-Forcing's `CausalInferencePipeline.inference` (guandeh17/Self-Forcing
pipeline/causal_inference.py).

Glossary (DESIGN.md section 1): B batch, C latent channels, c chunk frames, Hl / Wl latent height /
width, Z layers.

For each chunk: noise, then the schedule's few steps (`schedule.ChunkSchedule`), each a forward of
the chunk against the cache (`forward.chunk_forward`), the clean estimate noised again between
steps; the last estimate is the chunk; one more forward of it at the context timestep writes its
keys and values into the cache (`cache.write_chunk`). Given latent frames to start from (video
extension; I2V with the first frame's latent), each of their chunks only fills the cache. Every
chunk's programs are the same (fixed shapes, the chunk's position a traced value): compiled once.

Noise: chunk k's starting noise is `chunk_noise(key, k, 0)`, the draw before its step i (i >= 1)
`chunk_noise(key, k, i)`; a test feeds the same draws to the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from attention.mesh import SEQUENCE_AXES, MeshSpec
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.causal.cache import CacheWindow, KVCache, write_chunk
from pipelines.wan.causal.forward import MAX_FRAMES, check_chunk, chunk_forward
from pipelines.wan.causal.schedule import ChunkSchedule
from pipelines.wan.transformer import TextKV, WanTransformer, text_kv


def chunk_noise(key: jax.Array, chunk: int, step: int, shape: tuple[int, ...]) -> jax.Array:
  """float32 standard normal draw of `shape` [B, C, c, Hl, Wl] for chunk `chunk` (0-based, the
  given frames' chunks not counted) before its step `step` (0: the starting noise)."""
  return jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, chunk), step), shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class CausalStream:
  """One stream's fixed parts: the model, where it runs, its window and schedule.

  Attributes:
    model: a `WanTransformer` (text-to-video, no VACE) with causal weights.
    window: which past frames a chunk sees (`CacheWindow`).
    schedule: each chunk's denoising (`ChunkSchedule`).
    plan: where it runs (None: one device).
  """
  model: WanTransformer
  window: CacheWindow = CacheWindow()
  schedule: ChunkSchedule = ChunkSchedule()
  plan: ParallelPlan | None = None

  def latents(self, text: Any, *, num_chunks: int, latent_size: tuple[int, int], key: jax.Array,
              initial_latents: jax.Array | None = None, text_at: Mapping[int, Any] | None = None
              ) -> Iterator[jax.Array]:
    """Yields each chunk's clean latents float32 [B, C, c, Hl, Wl] as it is made.

    Args:
      text: [B, L, text_dim] text states or their `TextKV`.
      num_chunks: chunks to make (>= 1).
      latent_size: (Hl, Wl).
      key: the stream's noise key (`chunk_noise`).
      initial_latents: None, or [B, C, F0, Hl, Wl] latent frames to continue (F0 a multiple of c),
        which fill the cache first (they are not yielded).
      text_at: {chunk k: text states or `TextKV`} the prompt from chunk k on (an interactive stream:
        the cross-attention reads the new text, the cache keeps every frame made, as Self-Forcing's
        demo switches prompts), or None.

    Raises:
      ValueError: a bad chunk count, initial latents of another size or a length not a multiple of
        the chunk, more frames than the RoPE reaches (`forward.MAX_FRAMES`), and `check_chunk`'s,
        all before any compute.
    """
    graphdef, params = nnx.split(self.model)
    config, c = self.model.config, self.window.chunk_frames
    given = self._given_chunks(initial_latents, latent_size)
    if not isinstance(num_chunks, int) or num_chunks < 1:
      raise ValueError(f"num_chunks must be an int >= 1, got {num_chunks!r}")
    total = (given + num_chunks) * c
    if total > MAX_FRAMES:
      raise ValueError(f"{total} latent frames are more than a stream's RoPE reaches ({MAX_FRAMES})")
    batch = _rows(text)
    if any(_rows(later) != batch for later in (text_at or {}).values()):
      raise ValueError(f"text_at's texts must have the stream's {batch} rows")
    shape = (batch, config.in_channels, c, *latent_size)
    tokens_per_frame = check_chunk(self.model, shape, self.plan) // c
    where = (self.plan or ParallelPlan.single()).replicated
    kv = self._kv(graphdef, params, text, where)
    cache = _empty_cache(layers=config.num_layers, batch=batch, capacity=self.window.capacity(total),
                         tokens_per_frame=tokens_per_frame, heads=config.num_attention_heads,
                         head_dim=config.attention_head_dim, dtype=jnp.dtype(self.model.dtype))
    cache_where = cache_sharding(self.plan, cache.capacity_tokens)
    cache = jax.device_put(cache, cache_where)
    step = functools.partial(_chunk_step, graphdef, window=self.window, tokens_per_frame=tokens_per_frame,
                             plan=self.plan, where=where, cache_where=cache_where)
    context_t = self.schedule.context_noise
    for i in range(given):
      _, cache = step(params, initial_latents[:, :, i * c:(i + 1) * c], context_t, 0.0, kv, cache, write=True)
    timesteps, sigmas = self.schedule.timesteps(), self.schedule.sigmas()
    for chunk in range(num_chunks):
      if chunk in (text_at or {}):
        kv = self._kv(graphdef, params, text_at[chunk], where)
      x = chunk_noise(key, chunk, 0, shape)
      for i, (t, sigma) in enumerate(zip(timesteps, sigmas)):
        x0 = step(params, x, float(t), float(sigma), kv, cache, write=False)
        if i + 1 < len(timesteps):
          x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * chunk_noise(key, chunk, i + 1, shape)
      _, cache = step(params, x0, context_t, 0.0, kv, cache, write=True)
      yield x0

  def _kv(self, graphdef, params, text: Any, where: jax.sharding.Sharding) -> TextKV:
    """The text's `TextKV`, where the steps read it. Every array a step takes (and the cache it
    returns) lives where the plan keeps replicated arrays: one placement from the first chunk on,
    so each step compiles once."""
    kv = text if isinstance(text, TextKV) else _text_kv(graphdef, params, jnp.asarray(text), plan=self.plan)
    return jax.device_put(kv, where)

  def _given_chunks(self, initial_latents: jax.Array | None, latent_size: tuple[int, int]) -> int:
    if initial_latents is None:
      return 0
    c, shape = self.window.chunk_frames, tuple(initial_latents.shape)
    if len(shape) != 5 or shape[3:] != tuple(latent_size) or shape[2] % c:
      raise ValueError(f"initial_latents must be [B, C, F0, {latent_size[0]}, {latent_size[1]}] with F0 a multiple "
                       f"of the chunk's {c} frames, got shape {shape}")
    return shape[2] // c


def cache_sharding(plan: ParallelPlan | None, capacity_tokens: int) -> KVCache:
  """Where a `KVCache` lives (a `KVCache` of shardings): on one device, that device; on a mesh its
  tokens split over the ring x Ulysses devices, as USP splits a sequence (each device holds
  1 / (U R) of the cache), or replicated when they do not divide evenly; `frames` replicated."""
  plan = plan or ParallelPlan.single()
  if plan.mesh is None or capacity_tokens % MeshSpec.of(plan.mesh).sequence_devices:
    return KVCache(plan.replicated, plan.replicated, plan.replicated)
  split = NamedSharding(plan.mesh, P(None, None, SEQUENCE_AXES))
  return KVCache(split, split, plan.replicated)


def _rows(text: Any) -> int:
  return text.k_ZBLNH.shape[1] if isinstance(text, TextKV) else text.shape[0]


def _chunk_step_body(graphdef, params, latents, timestep, sigma, kv, cache, *, window, tokens_per_frame, plan, write,
                     cache_where):
  """One forward of a chunk: x0 float32 = latents - sigma * flow, and when `write` (x0, the cache with
  the chunk written). A denoising step returns no cache: an output cache is a second copy of it on the
  device (measured on a v5e at 480p: 4.8 GiB more, out of memory)."""
  model = nnx.merge(graphdef, params)
  batch = latents.shape[0]
  flow, k, v = chunk_forward(model, latents, jnp.full((batch,), timestep, jnp.float32), kv, cache, plan)
  x0 = latents.astype(jnp.float32) - sigma * flow.astype(jnp.float32)
  if not write:
    return x0
  cache = write_chunk(cache, k, v, window, tokens_per_frame)
  if plan is not None and plan.mesh is not None:
    cache = jax.lax.with_sharding_constraint(cache, cache_where)
  return x0, cache


def _text_kv_body(graphdef, params, text, *, plan):
  return text_kv(nnx.merge(graphdef, params), text, plan)


_text_kv = jax.jit(_text_kv_body, static_argnums=0, static_argnames=("plan",))


_empty_cache = jax.jit(KVCache.empty, static_argnames=("layers", "batch", "capacity", "tokens_per_frame", "heads",
                                                      "head_dim", "dtype"))
_STATIC = ("window", "tokens_per_frame", "plan", "write", "cache_where")
_chunk_step_jit = jax.jit(_chunk_step_body, static_argnums=0, static_argnames=_STATIC)
# The cache write updates the cache in place: its input buffers are given to the output (no second copy).
_cache_write_jit = jax.jit(_chunk_step_body, static_argnums=0, static_argnames=_STATIC, donate_argnames=("cache",))


def _chunk_step(graphdef, params, latents, timestep, sigma, kv, cache, *, window: CacheWindow, tokens_per_frame: int,
                plan: ParallelPlan | None, where: jax.sharding.Sharding, cache_where: KVCache,
                write: bool) -> jax.Array | tuple[jax.Array, KVCache]:
  """`_chunk_step_body` jitted; a write donates `cache` (the caller's cache is consumed)."""
  jitted = _cache_write_jit if write else _chunk_step_jit
  return jitted(graphdef, params, jax.device_put(latents, where), np.float32(timestep), np.float32(sigma),
                kv, cache, window=window, tokens_per_frame=tokens_per_frame, plan=plan, write=write,
                cache_where=cache_where)
