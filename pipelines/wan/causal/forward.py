"""One forward of a causal Wan transformer on one chunk of latent frames, attending to its KV cache.

Glossary (DESIGN.md section 1): B batch, C latent channels, c chunk frames, Hl / Wl latent height /
width, T the chunk's video tokens, S the cache's tokens, Z layers, N heads, H head dim.

The Wan transformer's own `embed`, block and `unembed` (pipelines/wan/transformer/model.py), with
two changes, as Self-Forcing's `CausalWanModel._forward_inference` makes them: RoPE at the chunk's
absolute frame positions (the frame axis starts at the chunk's first frame), and each block's
self-attention over the chunk's keys followed by the cache's (`cache.KVCache`: the past frames the
window keeps, valid ones a prefix), so one valid key count masks the empty slots and one compiled
program serves every chunk. The chunk's keys (after RoPE) and values of every layer come back for
the cache. Under a mesh the chunk's tokens are sequence-sharded as in any forward; their count must
split evenly over U * R (no padded rows between the chunk's keys and the cache's).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.causal.cache import KVCache
from pipelines.wan.transformer import SequenceLayout, WanTransformer, model as wan_transformer, padded_tokens

MAX_FRAMES = 4096  # latent frames a stream's RoPE reaches (16,384 video frames: 17 min at 16 fps)


def check_chunk(model: WanTransformer, latent_shape: tuple[int, ...], plan: ParallelPlan | None) -> int:
  """T, the chunk's tokens, after checking the model and the chunk fit a causal stream.

  Raises:
    ValueError: a VACE transformer, a temporal patch other than 1, or tokens that do not split
      evenly over the mesh's U * R devices (naming a chunk size or mesh that does).
  """
  config = model.config
  if config.has_vace:
    raise ValueError("a causal stream runs a text-to-video transformer; this one has VACE blocks")
  pt, ph, pw = config.patch_size
  if pt != 1:
    raise ValueError(f"a causal stream needs a temporal patch of 1 (Wan 2.1 / 2.2), got patch_size={config.patch_size}")
  _, _, f, h, w = latent_shape
  tokens = f * (h // ph) * (w // pw)
  mesh = None if plan is None else plan.mesh
  if padded_tokens(mesh, tokens) != tokens:
    raise ValueError(f"a chunk of {f} latent frames at {h}x{w} has {tokens} tokens, which do not split evenly over "
                     f"the mesh's {padded_tokens(mesh, 1)} sequence devices: choose U * R dividing {tokens}")
  return tokens


def chunk_forward(model: WanTransformer, latents: jax.Array, timestep: jax.Array, text: Any, cache: KVCache,
                  plan: ParallelPlan | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Flow prediction of one chunk, and its keys and values for the cache. Jit-friendly.

  Args:
    model: a `WanTransformer` without VACE blocks.
    latents: [B, C, c, Hl, Wl] the chunk (cast to the model dtype).
    timestep: [B] the chunk's timestep (0..1000).
    text: [B, L, text_dim] text states or their `TextKV` (`transformer.text_kv`, once per prompt).
    cache: the past frames' keys and values; `cache.frames` is the chunk's first frame, whose
      RoPE position the chunk starts at.
    plan: where it runs (None: one device).

  Returns:
    (flow [B, C_out, c, Hl, Wl] in the model dtype, k_ZBTNH, v_ZBTNH [Z, B, T, N, H] the chunk's keys
    after RoPE and values of every layer).

  Raises:
    ValueError: as `check_chunk`, or as `transformer.forward` for shapes that do not fit the model.
  """
  tokens = check_chunk(model, latents.shape, plan)
  x_BTD, context = wan_transformer.embed(model, latents, timestep, text, plan, first_frame=cache.frames,
                                         rope_frames=MAX_FRAMES)
  per_frame = tokens // latents.shape[2]
  valid = jnp.full((latents.shape[0],), tokens, jnp.int32) + cache.valid_tokens(per_frame)
  x_BTD, k_ZBTNH, v_ZBTNH = _run_blocks(model, x_BTD, context, cache, valid)
  return wan_transformer.unembed(model, x_BTD, context), k_ZBTNH, v_ZBTNH


def _run_blocks(model: WanTransformer, x_BTD: jax.Array, context: wan_transformer.ForwardContext, cache: KVCache,
                valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Every block by one layer scan, each self-attention over [chunk keys; cache keys] with `valid`
  (int32 [B]) keys, the chunk's own K/V collected per layer."""
  kv = context.text_kv
  layout: SequenceLayout = context.layout
  per_layer = (model.blocks, kv.k_ZBLNH, kv.v_ZBLNH, kv.image_k_ZBPNH, kv.image_v_ZBPNH, cache.k_ZBSNH, cache.v_ZBSNH)

  def body(x_BTD, layer):
    block, k_BLNH, v_BLNH, image_k_BPNH, image_v_BPNH, cached_k, cached_v = layer
    block = layout.gathered(block)
    made = []

    def attend(q_BTNH, k_BTNH, v_BTNH):
      made.append((k_BTNH, v_BTNH))
      keys, values = jnp.concatenate([k_BTNH, cached_k], 1), jnp.concatenate([v_BTNH, cached_v], 1)
      return layout.self_attention(q_BTNH, keys, values, kv_valid_len=valid)

    image_kv = None if image_k_BPNH is None else (image_k_BPNH, image_v_BPNH)
    x_BTD = block(x_BTD, (k_BLNH, v_BLNH), context.time_proj, context.rope, config=model.config, layout=layout,
                  image_kv=image_kv, time_index=context.time_index, attend=attend)
    return x_BTD, made[0]

  x_BTD, (k_ZBTNH, v_ZBTNH) = jax.lax.scan(body, x_BTD, per_layer)
  return x_BTD, k_ZBTNH, v_ZBTNH


def cache_bytes(model: WanTransformer, *, batch: int, capacity_frames: int, tokens_per_frame: int) -> int:
  """Bytes of a `KVCache` of `capacity_frames` frames for this model (keys and values, every layer)."""
  config = model.config
  return 2 * math.prod((config.num_layers, batch, capacity_frames * tokens_per_frame, config.num_attention_heads,
                        config.attention_head_dim)) * jnp.dtype(model.dtype).itemsize
