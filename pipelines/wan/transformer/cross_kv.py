"""The cross-attention keys and values of the conditioning: the text's, and with an image branch (Wan
2.1 I2V / FLF2V) the image's, of every block, computed once per (prompt, expert) before the
denoising loop (`TextKV`, `text_kv`).

Glossary (DESIGN.md section 1): Z layers, B rows (2B under classifier-free guidance), L text tokens,
P image tokens (J; 2J for FLF2V), J CLIP tokens per frame, I CLIP state width, N heads, H head dim,
D = N * H.

They depend on the conditioning and the weights only, never on the step: diffusers'
`WanAttnProcessor` projects `encoder_hidden_states` with `to_k` / `norm_k` / `to_v` and the image
states with `add_k_proj` / `norm_added_k` / `add_v_proj` inside every forward; computing them once
runs the same ops on the same values (bit-identical videos) and takes that work out of every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.transformer.sequence_layout import SequenceLayout
from pipelines.wan.transformer.config import WanTransformerConfig
from pipelines.wan.transformer.layers import cross_attention_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TextKV:
  """Every block's cross-attention keys and values of the conditioning (`text_kv`), in the model dtype.

  Attributes:
    k_ZBLNH, v_ZBLNH: the text's, [Z, B, L, N, H]; replicated over a mesh's sequence devices (rows
      split over "cfg" when the mesh splits the guidance, as the text states were).
    image_k_ZBPNH, image_v_ZBPNH: the image's (`add_k_proj`, `norm_added_k`, `add_v_proj` of the
      embedded CLIP states), [Z, B, P, N, H] laid out as the text's; None when not held (no image
      branch, or the forward is given the image states and computes them itself).
    image_in_text: the text K/V are of [image; text] (a transformer whose image tokens join the
      context, `config.image_in_context`: L counts the P image tokens first). Static.
    vace_k_VBLNH, vace_v_VBLNH: a VACE transformer's VACE blocks' K/V of the text, [V, B, L, N, H]
      laid out as the text's; None without VACE.
  """
  k_ZBLNH: jax.Array
  v_ZBLNH: jax.Array
  image_k_ZBPNH: jax.Array | None = None
  image_v_ZBPNH: jax.Array | None = None
  image_in_text: bool = dataclasses.field(default=False, metadata=dict(static=True))
  vace_k_VBLNH: jax.Array | None = None
  vace_v_VBLNH: jax.Array | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    """[Z, B, L, N, H] of the text's."""
    return tuple(self.k_ZBLNH.shape)

  @property
  def has_image(self) -> bool:
    """Whether the image's K/V are held (apart, or within the text's)."""
    return self.image_k_ZBPNH is not None or self.image_in_text


def check_image_states(config: WanTransformerConfig, image: jax.Array | None, batch: int) -> None:
  """Checks CLIP states for the transformer's image branch (None: no image states).

  Args:
    image: [B, J, I] (FLF2V: [2B, J, I], each video's first and last frame) or None.
    batch: B, the rows of the text / video.

  Raises:
    ValueError: image states for a transformer without an image branch, or of a shape that does not
      fit the config and the rows.
  """
  if image is None:
    return
  if not config.has_image_branch:
    raise ValueError("encoder_hidden_states_image given but this transformer has no image branch "
                     "(image_dim is None): pass None")
  rows = batch * (2 if config.pos_embed_seq_len is not None else 1)
  if image.ndim != 3 or image.shape[0] != rows or image.shape[2] != config.image_dim:
    raise ValueError(f"this transformer needs encoder_hidden_states_image [{rows}, J, image_dim="
                     f"{config.image_dim}] (CLIP penultimate states; FLF2V: two rows per video), got "
                     f"{image.shape}")
  if config.pos_embed_seq_len is not None and 2 * image.shape[1] != config.pos_embed_seq_len:
    raise ValueError(f"image states of {image.shape[1]} tokens per frame do not fit "
                     f"{config.pos_embed_seq_len=} (first + last frame)")


def text_kv(model: Any, encoder_hidden_states: jax.Array, plan: ParallelPlan | None = None,
            encoder_hidden_states_image: jax.Array | None = None) -> TextKV:
  """Every block's cross-attention keys and values of the text (the text embedder, diffusers'
  `condition_embedder.text_embedder`, then `cross_attention_kv` of each block) and, given CLIP
  states, of the image (the image embedder, then each block's `add_k_proj`, `norm_added_k`,
  `add_v_proj`), by one layer scan.

  A denoising loop computes them once per (prompt, expert) and passes them to `transformer.forward`
  at every step instead of the text (and image) states: the same ops on the same values as inside
  each forward (what `forward` does when given the states), one call instead of one per step. No
  collective: the conditioning is replicated and cross-attention is local; with sharded weights
  each layer's are gathered, as in `run_blocks`.

  Args:
    model: a `transformer.WanTransformer`.
    encoder_hidden_states: [B, L, text_dim] text-encoder states; cast to the model dtype.
    plan: where it runs (static under jit), None for one device.
    encoder_hidden_states_image: [B, J, I] CLIP penultimate states (FLF2V: [2B, J, I]) for a
      transformer with an image branch, or None (then no image K/V are held).

  Returns:
    `TextKV`: text [Z, B, L, N, H] (and image [Z, B, P, N, H]; a VACE transformer's VACE blocks'
    [V, B, L, N, H]) in the model dtype.

  Raises:
    ValueError: text states that are not [B, L, text_dim]; image states as `check_image_states`.
  """
  config = model.config
  text = encoder_hidden_states
  if text.ndim != 3 or text.shape[2] != config.text_dim:
    raise ValueError(f"encoder_hidden_states must be [B, L, text_dim={config.text_dim}], got {text.shape=}")
  image = encoder_hidden_states_image
  check_image_states(config, image, text.shape[0])
  layout = SequenceLayout(ParallelPlan.single() if plan is None else plan, 1)
  text_BLD = layout.constrain_rows(model.condition_embedder.text_embedder(text.astype(model.dtype)))
  image_BPD = None if image is None else _embed_image(model, layout, image)
  if image_BPD is not None and config.image_in_context:  # diffusers: concat([image, text]) as the context
    context = layout.constrain_rows(jnp.concatenate([image_BPD, text_BLD], axis=1))
    return TextKV(*_scan_kv(model.blocks.attn2, config, layout, context, None), image_in_text=True)
  vace = {}
  if config.has_vace:  # the VACE blocks attend to the same text with their own projections
    vace = dict(zip(("vace_k_VBLNH", "vace_v_VBLNH"), _scan_kv(model.vace_blocks.attn2, config, layout, text_BLD, None)))
  return TextKV(*_scan_kv(model.blocks.attn2, config, layout, text_BLD, image_BPD), **vace)


def image_kv(model: Any, kv: TextKV, encoder_hidden_states_image: jax.Array, plan: ParallelPlan | None = None
             ) -> TextKV:
  """`kv` (text K/V, no image's) with the image's K/V of every block added (what `text_kv` adds
  given the image states; `transformer.forward` calls it when given held text K/V and image states).

  Args:
    model: a `transformer.WanTransformer` with an image branch.
    kv: its `TextKV` [Z, B, L, N, H] without image K/V.
    encoder_hidden_states_image: [B, J, I] (FLF2V: [2B, J, I]) CLIP penultimate states.
    plan: where it runs (static under jit), None for one device.

  Raises:
    ValueError: `kv` holds image K/V already; image states as `check_image_states`.
  """
  if kv.has_image:
    raise ValueError("these K/V hold the image's already")
  if model.config.image_in_context:
    raise ValueError("this transformer attends the image tokens as part of the text context (image_dim without "
                     "added_kv_proj_dim): compute its K/V with text_kv(..., encoder_hidden_states_image=...)")
  check_image_states(model.config, encoder_hidden_states_image, kv.shape[1])
  layout = SequenceLayout(ParallelPlan.single() if plan is None else plan, 1)
  image_k, image_v = _scan_kv(model.blocks.attn2, model.config, layout, None,
                              _embed_image(model, layout, encoder_hidden_states_image))
  return dataclasses.replace(kv, image_k_ZBPNH=image_k, image_v_ZBPNH=image_v)


def _embed_image(model: Any, layout: SequenceLayout, image: jax.Array) -> jax.Array:
  """[B, P, D] embedded CLIP states (diffusers' `condition_embedder.image_embedder`), replicated."""
  return layout.constrain_rows(model.condition_embedder.image_embedder(image.astype(model.dtype)))


def _scan_kv(attn2: Any, config: WanTransformerConfig, layout: SequenceLayout, text_BLD: jax.Array | None,
             image_BPD: jax.Array | None) -> list[jax.Array]:
  """One layer scan over the stacked cross-attentions `attn2` (the blocks' or the VACE blocks'):
  [text k, text v] of the text states and [image k, image v] of the image states that are given,
  each [Z or V, B, L or P, N, H] in the model dtype."""

  def body(_, attn):
    attn = layout.gathered(attn)  # sharded weights: this layer's all-gather
    pairs = [((attn.to_k, attn.to_v, attn.norm_k), text_BLD),
             ((attn.add_k_proj, attn.add_v_proj, attn.norm_added_k), image_BPD)]
    kv = [cross_attention_kv(to_k, to_v, norm_k[...], s, heads=config.num_attention_heads, eps=config.eps)
          for (to_k, to_v, norm_k), s in pairs if s is not None]
    return None, tuple(layout.constrain_rows(a) for pair in kv for a in pair)

  _, out = jax.lax.scan(body, None, attn2)
  return [layout.constrain_rows(a, axis=1) for a in out]
