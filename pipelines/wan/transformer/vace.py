"""VACE (diffusers' `WanVACETransformer3DModel`): the context branch that turns a VACE context (the
given video's latents and its mask) into hints added to the video tokens after the `vace_layers`
blocks.

Glossary (DESIGN.md section 1): B batch, F / Hl / Wl latent frames / height / width, T video tokens
(T_padded under a mesh), D model width, Z layers, V = len(vace_layers) VACE blocks, Cv the VACE
context's channels (`vace_in_channels`, 96 for Wan 2.1: inactive and reactive latents 2 x 16, the
8 x 8 pixel mask 64).

Math (diffusers `transformer_wan_vace.py`): c = vace_patch_embedding(context) tokens, laid out as
the video tokens; c = proj_in(c) + x (x: the embedded video tokens, before block 0); then for each
VACE block i: c = block_i(c) (a `WanTransformerBlock` with its own weights: self-attention over the
context tokens with the video's RoPE, cross-attention to the text, feed-forward, the same
modulation by the timestep), hint_i = proj_out_i(c). The main blocks then run as usual and after
block vace_layers[i] the video tokens become x + hint_i * scale_i (in the model dtype, as
diffusers' `hidden_states + control_hint * scale` with `scale` cast to the transformer dtype).

The hints depend on the context, the text and the timestep, not on the main blocks, so they are
computed by one scan over the VACE blocks before the main scan (as diffusers computes them all
first) and held as [V, B, T_padded, D], sequence-sharded with the tokens; the main scan adds the
one of its layer (`hint_slots`). Padded token rows of the context are zero before the blocks, as
the video's; like the video's padded rows, what they become never reaches a valid token (padded
keys are masked, padded rows dropped before unpatchify).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan.transformer.config import WanTransformerConfig
from pipelines.wan.transformer.layers import Dense, WanBlock


class VaceBlock(WanBlock):
  """diffusers `WanVACETransformerBlock` less its input projection (block 0's `proj_in` is the
  model's `vace_proj_in`): a `WanBlock` on the context tokens and the output projection `proj_out`
  [D, D] that makes its hint. Built with a leading V axis on every array and scanned."""

  def __init__(self, params: Mapping[str, Any]):
    super().__init__(params)
    self.proj_out = Dense(**params["proj_out"])


def hint_slots(config: WanTransformerConfig) -> np.ndarray:
  """int32 [Z]: for each block, the index of the VACE hint added after it, -1 where none is."""
  slots = np.full(config.num_layers, -1, np.int32)
  slots[list(config.vace_layers)] = np.arange(len(config.vace_layers), dtype=np.int32)
  return slots


def check_control(config: WanTransformerConfig, control: Any, scale: Any, latents_shape: tuple[int, ...]) -> None:
  """Checks a forward's VACE context and scale against the transformer and the latents.

  Args:
    control: [B, Cv, F, Hl, Wl] (the latents' grid) or None.
    scale: [V] per-VACE-block scales, or None (ones).
    latents_shape: [B, C, F, Hl, Wl] of the forward's latents.

  Raises:
    ValueError: a context for a transformer without VACE, none for one with VACE, or a shape that
      does not fit (naming the expected shape).
  """
  if not config.has_vace:
    if control is not None or scale is not None:
      raise ValueError("control_hidden_states given but this transformer has no VACE blocks (vace_layers is None): "
                       "pass None")
    return
  b, _, f, h, w = latents_shape
  want = (b, config.vace_in_channels, f, h, w)
  if control is None or tuple(control.shape) != want:
    raise ValueError(f"this VACE transformer needs control_hidden_states {list(want)} (the VACE context on the "
                     f"latents' grid), got {None if control is None else list(control.shape)}")
  v = len(config.vace_layers)
  if scale is not None and tuple(scale.shape) != (v,):
    raise ValueError(f"control_hidden_states_scale must be [{v}] (one per VACE layer {list(config.vace_layers)}), "
                     f"got {list(scale.shape)}")


def vace_hints(model: Any, x_BTD: jax.Array, control: jax.Array, scale: jax.Array | None, context: Any
               ) -> jax.Array:
  """Every VACE block's hint times its scale, [V, B, T_padded, D] in the model dtype, sequence-sharded
  as the tokens (see the module docstring for the math).

  Args:
    model: a `WanTransformer` with VACE blocks.
    x_BTD: [B, T_padded, D] the embedded video tokens (`embed`'s, before block 0).
    control: [B, Cv, F, Hl, Wl] VACE context (cast to the model dtype).
    scale: [V] per-block scales (None: ones), cast to the model dtype as diffusers does.
    context: the forward's `ForwardContext` (its text K/V hold the VACE blocks' as `vace_k_VBLNH`).
  """
  layout, dtype = context.layout, model.dtype
  patches = jnp.pad(model.vace_patch_embedding.patches(control.astype(dtype)), ((0, 0), (0, layout.padding), (0, 0)))
  c_BTD = layout.constrain(model.vace_patch_embedding.project(layout.constrain(patches)))
  if layout.padding:
    c_BTD = jnp.where((jnp.arange(layout.padded_tokens) < layout.tokens)[:, None], c_BTD, 0)
  c_BTD = layout.constrain(model.vace_proj_in(c_BTD) + x_BTD)
  v = len(model.config.vace_layers)
  scale = jnp.ones((v,), dtype) if scale is None else scale.astype(dtype)
  kv = context.text_kv

  def body(c_BTD, layer):
    block, k_BLNH, v_BLNH, scale_i = layer
    block = layout.gathered(block)  # sharded weights: this layer's all-gather
    c_BTD = block(c_BTD, (k_BLNH, v_BLNH), context.time_proj, context.rope, config=model.config, layout=layout,
                  time_index=context.time_index)
    return c_BTD, layout.constrain(block.proj_out(c_BTD) * scale_i)

  _, hints_VBTD = jax.lax.scan(body, c_BTD, (model.vace_blocks, kv.vace_k_VBLNH, kv.vace_v_VBLNH, scale))
  return hints_VBTD

