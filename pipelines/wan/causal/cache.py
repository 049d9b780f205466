"""The KV cache of a causal (streaming) Wan transformer: which frames it holds and where.

Glossary (DESIGN.md section 1): Z layers, B batch, N heads, H head dim; a frame here is a latent
frame of `tokens_per_frame` video tokens. A stream makes `chunk_frames` latent frames at a time; each
chunk's queries attend to the chunk itself and to the cached keys and values of the frames made
before it, which every block layer holds in one `KVCache`.

Which frames a chunk sees is the rolling cache of Self-Forcing's `CausalWanSelfAttention.forward`
(guandeh17/Self-Forcing wan/modules/causal_model.py; its checkpoints' `local_attn_size` and
`sink_size`): with a window of W frames and s sink frames, the chunk starting at frame
t sees frames [0, s) and [max(s, t + c - W + s), t) of the past, c the chunk's frames; with no window
(global attention) every frame made. The reference keeps the W frames in a buffer it shifts left;
here the P = W - c past frames live in a ring of slots (the sink frames in slots 0..s-1, frame
f >= s in slot s + (f - s) mod (P - s)): the frame a new one overwrites is exactly the one the
reference evicts, the filled slots are always a prefix (a valid key count masks the rest), and
attention, a sum over keys, does not depend on their order. Keys are cached after RoPE, at their
absolute frame positions, as the reference does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class CacheWindow:
  """Which past frames a chunk attends to (module doc), static.

  Attributes:
    chunk_frames: c, latent frames made at a time (Self-Forcing's `num_frame_per_block`, 3).
    window_frames: W, the frames a chunk's attention spans, itself included (the checkpoint's
      `local_attn_size`), or None for global attention over every frame of the stream.
    sink_frames: s, the first frames kept for good (`sink_size`), 0 for none.

  Raises:
    ValueError: a window that cannot hold the chunk and the sink frames.
  """
  chunk_frames: int = 3
  window_frames: int | None = None
  sink_frames: int = 0

  def __post_init__(self):
    c, w, s = self.chunk_frames, self.window_frames, self.sink_frames
    if not isinstance(c, int) or c < 1:
      raise ValueError(f"chunk_frames must be an int >= 1, got {c!r}")
    if not isinstance(s, int) or s < 0:
      raise ValueError(f"sink_frames must be an int >= 0, got {s!r}")
    if w is not None and (not isinstance(w, int) or w < c + s):
      raise ValueError(f"window_frames={w!r} cannot hold a chunk of {c} frames and {s} sink frames: "
                       f"use a window of at least {c + s} frames, or None for global attention")

  def capacity(self, total_frames: int) -> int:
    """P, the past frames the cache holds for a stream of `total_frames` latent frames (every
    frame before the last chunk under global attention)."""
    if self.window_frames is None:
      return max(total_frames - self.chunk_frames, 0)
    return self.window_frames - self.chunk_frames

  def slot(self, frame: jax.Array, capacity: int) -> jax.Array:
    """int32 slot of `frame` in a cache of `capacity` frames (module doc); -1 where it is not kept."""
    s, ring = self.sink_frames, capacity - self.sink_frames
    if ring <= 0:
      return jnp.where(frame < min(s, capacity), frame, -1).astype(jnp.int32)
    return jnp.where(frame < s, frame, s + (frame - s) % ring).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Every block layer's cached keys (after RoPE) and values, and how many frames are in it.

  Attributes:
    k_ZBSNH, v_ZBSNH: [Z, B, P * tokens_per_frame, N, H] in the model dtype.
    frames: int32 [] frames made so far (the next chunk's first frame).
  """
  k_ZBSNH: jax.Array
  v_ZBSNH: jax.Array
  frames: jax.Array

  @classmethod
  def empty(cls, *, layers: int, batch: int, capacity: int, tokens_per_frame: int, heads: int, head_dim: int,
            dtype) -> "KVCache":
    """A cache of `capacity` frames holding none."""
    shape = (layers, batch, capacity * tokens_per_frame, heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

  @property
  def capacity_tokens(self) -> int:
    return self.k_ZBSNH.shape[2]

  def valid_tokens(self, tokens_per_frame: int) -> jax.Array:
    """int32 [] tokens of the filled slots (a prefix: module doc)."""
    return jnp.minimum(self.frames * tokens_per_frame, self.capacity_tokens)

  def nbytes(self) -> int:
    return self.k_ZBSNH.nbytes + self.v_ZBSNH.nbytes


def write_chunk(cache: KVCache, k_ZBTNH: jax.Array, v_ZBTNH: jax.Array, window: CacheWindow,
                tokens_per_frame: int) -> KVCache:
  """The cache with one chunk's keys and values written at its frames' slots, `frames` advanced.

  Args:
    cache: the cache before the chunk (its `frames` is the chunk's first frame).
    k_ZBTNH, v_ZBTNH: [Z, B, c * tokens_per_frame, N, H] the chunk's keys (after RoPE) and values of
      every layer, from its clean pass (Self-Forcing's context pass), in the cache's dtype.

  Returns:
    The new `KVCache` (jit-friendly; a frame whose slot is -1 is not written).
  """
  capacity = cache.capacity_tokens // tokens_per_frame
  k, v = cache.k_ZBSNH, cache.v_ZBSNH
  for i in range(window.chunk_frames if capacity else 0):
    slot = window.slot(cache.frames + i, capacity)
    start, rows = jnp.maximum(slot, 0) * tokens_per_frame, slice(i * tokens_per_frame, (i + 1) * tokens_per_frame)
    k = _put(k, k_ZBTNH[:, :, rows], start, slot >= 0)
    v = _put(v, v_ZBTNH[:, :, rows], start, slot >= 0)
  return KVCache(k, v, cache.frames + window.chunk_frames)


def _put(cache_ZBSNH: jax.Array, frame_ZBTNH: jax.Array, start: jax.Array, keep: jax.Array) -> jax.Array:
  """cache_ZBSNH with frame_ZBTNH written at token `start` of axis 2 where `keep`, else unchanged."""
  here = jax.lax.dynamic_slice_in_dim(cache_ZBSNH, start, frame_ZBTNH.shape[2], axis=2)
  return jax.lax.dynamic_update_slice_in_dim(cache_ZBSNH, jnp.where(keep, frame_ZBTNH, here), start, axis=2)
