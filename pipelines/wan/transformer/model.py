"""Wan video transformer (diffusers' `WanTransformer3DModel`) in Flax NNX, sequence-parallel.

Glossary (DESIGN.md section 1): B batch, C latent channels, F / Hl / Wl latent frames / height /
width, T video tokens = (F/pt) * (Hl/ph) * (Wl/pw), L text tokens, N heads, H head dim,
D = N * H, E ffn width, Z layers, U / R Ulysses / ring degrees.

Order of ops and dtypes are those of diffusers (models/transformers/transformer_wan.py) loaded
with `torch_dtype=dtype`: every parameter is in `dtype` except the `_keep_in_fp32_modules` ones
(`time_embedder`, both `scale_shift_table`s, the cross-attention `norm2` affine), which stay fp32,
so the timestep MLP, all AdaLN modulation and every LayerNorm run in fp32 and are rounded to
`dtype` where diffusers calls `type_as`. Linear layers accumulate in fp32 and round once.

Where it runs is one `pipelines.parallel.plan.ParallelPlan` (None: one device), from which each
forward builds its `SequenceLayout` (pipelines/wan/transformer/sequence_layout.py). Sequence parallelism
(DESIGN.md section 2): with a mesh, the video tokens are padded to a multiple
of U * R and constrained to `P(None, ("ring", "ulysses"), None)` for the whole forward; every
token-wise op runs on the local chunk; self-attention is `attention.usp_attention` with the valid
token count as `kv_valid_len` (padded keys masked), cross-attention is `attention.cross_attention`
(local per shard) against replicated text K/V (no mask: diffusers' Wan cross-attention uses none),
computed by `text_kv` for every block at once (with the image's K/V for Wan 2.1 I2V / FLF2V): the
pipeline calls it once per (prompt, expert) before the loop and passes the `TextKV` to every step
in place of the text (and image) states,
and padded rows are dropped before unpatchify. RoPE rows are global positions (the padded table is
sharded with the tokens). The blocks' weights are stacked on a leading Z axis and run by one
`lax.scan`, so the block is traced and compiled once whatever the depth. `forward` is `embed`
(patch and condition embeddings, RoPE), `run_blocks` (any range of blocks) and `unembed` (output
norm, projection, unpatchify), so a step cache (pipelines/wan/step_cache/forward.py) can run block 0 and
blocks 1..Z-1 apart without a second copy of the block.

The layers live in `layers`, the parameter tree and its fp32 policy in `config`, the weights'
placement on a mesh in `weight_placement`; the `transformer` package names their public names.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

import producers
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.transformer.cross_kv import TextKV, check_image_states, image_kv, text_kv
from pipelines.wan.transformer.sequence_layout import SequenceLayout
from pipelines.wan.transformer.timesteps import TokenTimesteps, select_levels
from pipelines.wan.transformer.config import (WanTransformerConfig, keeps_fp32, param_shapes)
from pipelines.wan.transformer.layers import (ConditionEmbedder, Dense, PatchEmbedding, WanBlock)
from pipelines.wan.transformer.vace import VaceBlock, check_control, hint_slots, vace_hints


class WanTransformer(nnx.Module):
  """diffusers `WanTransformer3DModel` (text- or image-to-video) as an NNX module; run it with `forward`.

  Parameter tree (our layout; `loading` maps diffusers keys onto it):
    patch_embedding.{kernel [pt, ph, pw, C, D], bias [D]}
    condition_embedder.{time_embedder.linear_1 [freq_dim, D], time_embedder.linear_2 [D, D],
      time_proj [D, 6D], text_embedder.linear_1 [text_dim, D], text_embedder.linear_2 [D, D]}
    blocks.{attn1, attn2}.{to_q, to_k, to_v, to_out} [Z, D, D], .{norm_q, norm_k} [Z, D],
      blocks.norm2.{weight, bias} [Z, D] (when cross_attn_norm), blocks.ffn.proj_in [Z, D, E],
      blocks.ffn.proj_out [Z, E, D], blocks.scale_shift_table [Z, 6, D]
    scale_shift_table [2, D], proj_out [D, C_out * pt * ph * pw]
    with an image branch (`config.has_image_branch`): condition_embedder.image_embedder.{norm1 [I],
      proj_in [I, I], proj_out [I, D], norm2 [D], pos_embed [P, I] (FLF2V)} and
      blocks.attn2.{add_k_proj, add_v_proj} [Z, D, D], blocks.attn2.norm_added_k [Z, D]
    with VACE (`config.has_vace`, `transformer.vace`): vace_patch_embedding.{kernel [pt, ph, pw, Cv, D],
      bias [D]}, vace_proj_in [D, D] (diffusers' `vace_blocks.0.proj_in`) and vace_blocks: the
      blocks' tree with a leading V axis plus proj_out [V, D, D]
  (every Dense has .kernel [I, O] and .bias [O]).
  """

  def __init__(self, config: WanTransformerConfig, params: Mapping[str, Any]):
    self.config = config
    self.patch_embedding = PatchEmbedding(**params["patch_embedding"])
    self.condition_embedder = ConditionEmbedder(params["condition_embedder"])
    self.blocks = WanBlock(params["blocks"])
    self.scale_shift_table = nnx.Param(params["scale_shift_table"])  # fp32 [2, D]
    self.proj_out = Dense(**params["proj_out"])
    vace = config.has_vace
    self.vace_patch_embedding = PatchEmbedding(**params["vace_patch_embedding"]) if vace else None
    self.vace_proj_in = Dense(**params["vace_proj_in"]) if vace else None
    self.vace_blocks = VaceBlock(params["vace_blocks"]) if vace else None

  @property
  def dtype(self) -> jnp.dtype:
    """The activation dtype (that of every parameter not kept in fp32)."""
    return self.patch_embedding.kernel.dtype


def _check_inputs(config: WanTransformerConfig, latents, timestep, text) -> None:
  if latents.ndim != 5 or latents.shape[1] != config.in_channels:
    raise ValueError(f"latents must be [B, C={config.in_channels}, F, Hl, Wl], got {latents.shape=}")
  batch = latents.shape[0]
  grid = latents.shape[2:]
  if any(n % p for n, p in zip(grid, config.patch_size)):
    raise ValueError(f"latent grid (F, Hl, Wl)={grid} must be divisible by {config.patch_size=}")
  tokens_grid = tuple(n // p for n, p in zip(grid, config.patch_size))
  if max(tokens_grid) > config.rope_max_seq_len:
    raise ValueError(f"token grid {tokens_grid} exceeds {config.rope_max_seq_len=} (diffusers' RoPE table)")
  tokens = math.prod(tokens_grid)
  if timestep.shape not in ((batch,), (batch, tokens)):
    raise ValueError(f"timestep must be [B]=[{batch}] or per token [B, T]=[{batch}, {tokens}] (diffusers' "
                     f"Wan 2.2 TI2V `expand_timesteps`), got {timestep.shape=}")
  if isinstance(timestep, TokenTimesteps) and (timestep.levels.ndim != 2 or timestep.levels.shape[0] != batch):
    raise ValueError(f"TokenTimesteps.levels must be [B={batch}, K], got {timestep.levels.shape}")
  if isinstance(text, TextKV):
    heads = config.num_attention_heads
    want = (config.num_layers, batch, text.shape[2], heads, config.dim // heads)
    if text.shape != want or text.v_ZBLNH.shape != text.k_ZBLNH.shape:
      raise ValueError(f"text K/V must be [Z, B, L, N, H]={want}, got {text.shape} (compute them with "
                       "text_kv of this model and these rows)")
    vace = None if text.vace_k_VBLNH is None else tuple(text.vace_k_VBLNH.shape)
    if config.has_vace and vace != (len(config.vace_layers), *want[1:]):
      raise ValueError(f"text K/V of a VACE transformer must hold its VACE blocks' [V, B, L, N, H]="
                       f"{[len(config.vace_layers), *want[1:]]}, got {vace} (compute them with text_kv of this model)")
    image = None if text.image_k_ZBPNH is None else (text.image_k_ZBPNH.shape, text.image_v_ZBPNH.shape)
    if image is not None and (image[0] != image[1] or image[0][:2] != want[:2] or image[0][3:] != want[3:]):
      raise ValueError(f"image K/V must be [Z, B, P, N, H] with (Z, B)={want[:2]} and (N, H)={want[3:]}, "
                       f"got {image} (compute them with text_kv of this model and these rows)")
  elif text.ndim != 3 or text.shape[0] != batch or text.shape[2] != config.text_dim:
    raise ValueError(f"encoder_hidden_states must be [B={batch}, L, text_dim={config.text_dim}], "
                     f"got {text.shape=}")


@dataclasses.dataclass(frozen=True)
class ForwardContext:
  """What every block of one forward needs besides the video tokens (built by `embed`).

  Attributes:
    text_kv: every block's text keys and values, and the image's for a transformer with an image
      branch (`TextKV`, replicated).
    time_proj: [B, 1, 6, D] (one timestep per video), [B, T_padded, 6, D] (per token, sharded like
      the tokens) or [B, K, 6, D] (per level, with `time_index`) timestep projection in the model dtype.
    temb: [B, 1, D], [B, T_padded, D] or [B, K, D] timestep embedding in the model dtype (the output
      norm's modulation), laid out as `time_proj`.
    rope: (cos, sin) float32 [T, H/2] at the tokens' global positions (padded rows: cos 1, sin 0).
    layout: where the tokens live and how attention runs (`SequenceLayout` of the call's plan: mesh,
      valid and padded counts, attention settings).
    latent_shape: (B, C, F, Hl, Wl) of the input latents.
    hints_VBTD: a VACE transformer's scaled hints [V, B, T_padded, D] in the model dtype
      (`vace.vace_hints`, sequence-sharded), None without VACE.
    time_index: int32 [B, T_padded] each token's level (sharded like the tokens) when the timestep
      was a `TokenTimesteps`, else None.
  """
  text_kv: TextKV
  time_proj: jax.Array
  temb: jax.Array
  rope: tuple[jax.Array, jax.Array]
  layout: SequenceLayout
  latent_shape: tuple[int, ...]
  hints_VBTD: jax.Array | None = None
  time_index: jax.Array | None = None

  def per_token(self, values: jax.Array) -> jax.Array:
    """A modulation [B, 1 or T_padded or K, ...] from `time_proj` / `temb` as the tokens read it:
    with `time_index` each token's level selected (`timesteps.select_levels`), else as it is."""
    return values if self.time_index is None else select_levels(values, self.time_index)


def _check_image(config: WanTransformerConfig, image: jax.Array | None, text: Any, batch: int) -> None:
  held = isinstance(text, TextKV) and text.has_image
  if held and image is not None:
    raise ValueError("encoder_hidden_states_image given with a TextKV that holds the image K/V already: "
                     "pass one of them (encoder_hidden_states_image=None to use the held K/V)")
  if config.has_image_branch and image is None and not held:
    raise ValueError(f"this transformer needs encoder_hidden_states_image [B, J, image_dim={config.image_dim}] "
                     "(CLIP penultimate states) or a TextKV holding the image K/V (text_kv with the image states)")
  if not config.has_image_branch and held:
    raise ValueError("the TextKV holds image K/V but this transformer has no image branch")
  check_image_states(config, image, batch)


def embed(model: WanTransformer, latents: jax.Array, timestep: jax.Array, encoder_hidden_states: Any,
          plan: ParallelPlan | None = None, encoder_hidden_states_image: jax.Array | None = None, *,
          control_hidden_states: jax.Array | None = None, control_hidden_states_scale: jax.Array | None = None,
          first_frame: jax.Array | int = 0, rope_frames: int | None = None) -> tuple[jax.Array, ForwardContext]:
  """The part of `forward` before the blocks: patch embedding, time embedding, RoPE table, the
  text K/V (`text_kv`) unless given, the image K/V (I2V) unless the given `TextKV` holds them, and a
  VACE transformer's hints (`vace.vace_hints`).

  Args: as `forward`, and for a chunk of a longer video (a causal stream, `pipelines.wan.causal`):
    first_frame: the latents' first frame's position on RoPE's frame axis (an int or a traced int32
      scalar; 0 for a whole video).
    rope_frames: frames RoPE's frame axis covers (static; None: the latents' own), at least
      first_frame + F.

  Returns:
    x_BTD: [B, T_padded, D] video tokens in the model dtype, T padded to a multiple of U * R with
      zero rows and sequence-sharded under a mesh; and the `ForwardContext` of the blocks.

  Raises:
    ValueError: as `forward`.
  """
  config = model.config
  _check_inputs(config, latents, timestep, encoder_hidden_states)
  _check_image(config, encoder_hidden_states_image, encoder_hidden_states, latents.shape[0])
  check_control(config, control_hidden_states, control_hidden_states_scale, latents.shape)
  dtype = model.dtype
  _, _, f, h, w = latents.shape
  pt, ph, pw = config.patch_size
  grid = (f // pt, h // ph, w // pw)
  layout = SequenceLayout(ParallelPlan.single() if plan is None else plan, math.prod(grid))

  # Token rows are cut from the (replicated) latents, padded and sharded before they are embedded:
  # each device projects only its own tokens. Padded rows are zero tokens.
  patches = layout.constrain(jnp.pad(model.patch_embedding.patches(latents.astype(dtype)),
                                     ((0, 0), (0, layout.padding), (0, 0))))
  x_BTD = layout.constrain(model.patch_embedding.project(patches))
  if layout.padding:
    x_BTD = layout.constrain(jnp.where((jnp.arange(layout.padded_tokens) < layout.tokens)[:, None], x_BTD, 0))
  temb, time_proj, time_index = _time(model, layout, timestep, dtype)
  kv, image = encoder_hidden_states, encoder_hidden_states_image
  if not isinstance(kv, TextKV):
    kv = text_kv(model, kv, plan, image)
  elif image is not None:  # text K/V held, the image's made here
    kv = image_kv(model, kv, image, plan)
  # Padded rows get cos 1, sin 0 and zero tokens; padded keys are masked via kv_valid_len.
  rope_grid = grid if rope_frames is None else (rope_frames, *grid[1:])
  cos, sin = producers.wan_rope_table(rope_grid, config.attention_head_dim, start=first_frame * grid[1] * grid[2],
                                      length=layout.padded_tokens)
  rope = (layout.constrain_table(cos), layout.constrain_table(sin))
  context = ForwardContext(text_kv=kv, time_proj=time_proj, temb=temb, rope=rope,
                           layout=layout, latent_shape=tuple(latents.shape), time_index=time_index)
  if config.has_vace:
    hints = vace_hints(model, x_BTD, control_hidden_states, control_hidden_states_scale, context)
    context = dataclasses.replace(context, hints_VBTD=hints)
  return x_BTD, context


def _time(model: WanTransformer, layout: SequenceLayout, timestep: Any, dtype: Any
          ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """(temb [B, 1 or T_padded or K, D], time_proj [B, 1 or T_padded or K, 6, D]) in the model `dtype`,
  and the tokens' level index int32 [B, T_padded] for a `TokenTimesteps` (else None).

  A `TokenTimesteps` is embedded per level (replicated, [B, K]); its index is padded (padded rows
  level 0) and pinned to the tokens' sharding.

  A per-token timestep [B, T] is padded to T_padded and pinned to the tokens' sharding before
  anything is computed from it, so every device embeds only its own tokens' timesteps: the
  per-token embedding and modulation (T x 7D values per video) are never built whole on a device,
  and nothing token-sized is gathered (tests/pipelines/wan/conditioning/test_ti2v.py reads the compiled step). Padded rows
  get timestep 0 (their tokens are dropped before unpatchify).
  """
  embedder = model.condition_embedder
  if isinstance(timestep, TokenTimesteps):
    index = layout.constrain(jnp.pad(timestep.index.astype(jnp.int32), ((0, 0), (0, layout.padding))))
    temb, time_proj = embedder(timestep.levels, dtype=dtype, freq_dim=model.config.freq_dim)
    return layout.constrain_rows(temb), layout.constrain_rows(time_proj), index
  per_token = timestep.ndim == 2
  if per_token:
    timestep = layout.constrain(jnp.pad(timestep, ((0, 0), (0, layout.padding))))
  temb, time_proj = embedder(timestep, dtype=dtype, freq_dim=model.config.freq_dim)
  if per_token:
    return layout.constrain(temb), layout.constrain(time_proj), None
  return layout.constrain_rows(temb[:, None]), layout.constrain_rows(time_proj[:, None]), None


def run_blocks(model: WanTransformer, x_BTD: jax.Array, context: ForwardContext, start: int = 0,
               stop: int | None = None) -> jax.Array:
  """Blocks start..stop-1 (Python slice bounds, static) on x, by one `lax.scan` over their weights.

  `run_blocks(m, x, c)` runs every block (what `forward` does); a step cache runs block 0 with
  `stop=1` and the rest with `start=1` (pipelines/wan/step_cache/forward.py), the same scanned block.

  Args:
    x_BTD: [B, T_padded, D] in the model dtype (from `embed` or a previous `run_blocks`).
    context: from `embed` on the same call.

  Returns:
    [B, T_padded, D] in the model dtype, sequence-sharded under a mesh.

  Raises:
    ValueError: an empty or out-of-range block range.
  """
  layers = model.config.num_layers
  stop = layers if stop is None else stop
  if not 0 <= start < stop <= layers:
    raise ValueError(f"blocks {start}..{stop - 1} are not a non-empty range of the {layers} blocks")
  kv, hints = context.text_kv, context.hints_VBTD
  slots = None if hints is None else jnp.asarray(hint_slots(model.config))
  per_layer = (model.blocks, kv.k_ZBLNH, kv.v_ZBLNH, kv.image_k_ZBPNH, kv.image_v_ZBPNH, slots)
  if (start, stop) != (0, layers):
    per_layer = jax.tree.map(lambda a: a[start:stop], per_layer)  # the Z axis of every stacked array

  def body(x_BTD, layer):
    block, k_BLNH, v_BLNH, image_k_BPNH, image_v_BPNH, slot = layer
    block = context.layout.gathered(block)  # sharded weights: this layer's all-gather
    image_kv = None if image_k_BPNH is None else (image_k_BPNH, image_v_BPNH)
    x_BTD = block(x_BTD, (k_BLNH, v_BLNH), context.time_proj, context.rope, config=model.config,
                  layout=context.layout, image_kv=image_kv, time_index=context.time_index)
    if slot is not None:  # VACE: after a vace layer's block, its hint (diffusers: x + hint * scale)
      hint_BTD = jax.lax.dynamic_index_in_dim(hints, jnp.maximum(slot, 0), keepdims=False)
      x_BTD = context.layout.constrain(jnp.where(slot >= 0, x_BTD + hint_BTD, x_BTD))
    return x_BTD, None

  x_BTD, _ = jax.lax.scan(body, x_BTD, per_layer)
  return x_BTD


def unembed(model: WanTransformer, x_BTD: jax.Array, context: ForwardContext) -> jax.Array:
  """The part of `forward` after the blocks: output norm, projection, padded rows dropped, unpatchify.

  Args:
    x_BTD: [B, T_padded, D] in the model dtype (the last block's output).

  Returns:
    [B, C_out, F, Hl, Wl] in the model dtype.
  """
  config = model.config
  b, _, f, h, w = context.latent_shape
  pt, ph, pw = config.patch_size
  grid = (f // pt, h // ph, w // pw)
  # Output norm (fp32 modulation from the fp32 table + temb), projection, unpatchify.
  mod = model.scale_shift_table[...][None, None] + context.temb[:, :, None].astype(jnp.float32)
  shift, scale = context.per_token(mod[:, :, 0]), context.per_token(mod[:, :, 1])  # fp32 [B, 1 or T_padded, D]
  x_BTD = producers.layernorm_adaln(x_BTD, scale, shift, eps=config.eps)
  x_BTP = model.proj_out(x_BTD)[:, : context.layout.tokens]  # P = pt * ph * pw * C_out
  x = x_BTP.reshape(b, *grid, pt, ph, pw, config.out_channels)
  x = x.transpose(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C_out, F/pt, pt, Hl/ph, ph, Wl/pw, pw]
  return x.reshape(b, config.out_channels, f, h, w)


def forward(model: WanTransformer, latents: jax.Array, timestep: jax.Array,
            encoder_hidden_states: Any, plan: ParallelPlan | None = None,
            encoder_hidden_states_image: jax.Array | None = None, *,
            control_hidden_states: jax.Array | None = None,
            control_hidden_states_scale: jax.Array | None = None) -> jax.Array:
  """Noise (flow) prediction of diffusers' `WanTransformer3DModel.forward`. Jit-friendly.

  `embed`, then every block (`run_blocks`), then `unembed`.

  Args:
    model: a `WanTransformer` (from `load_transformer` or `init_transformer`).
    latents: [B, C, F, Hl, Wl]; cast to the model dtype (diffusers' pipeline feeds
      `latents.to(transformer_dtype)`). F, Hl, Wl divisible by the patch size.
    timestep: [B] diffusion timesteps (0..1000, fractional allowed), or [B, T] one per token in
      (f, h, w) token order (diffusers' 2-D timestep of Wan 2.2 TI2V, `expand_timesteps`): the
      time embedding and every AdaLN modulation are then per token, sharded with the tokens; or
      the same per-token timesteps as a `TokenTimesteps` (a few levels and each token's level:
      the same values, embedded per level, modulations selected per token inside each block).
    encoder_hidden_states: [B, L, text_dim] text-encoder states (cast to the model dtype), or their
      `TextKV` from `text_kv` (computed once per prompt: the same result, none of the text work;
      with an image branch it may hold the image K/V too, then `encoder_hidden_states_image` is None).
    plan: where and how it runs (static under jit; frozen and hashable), None for
      `ParallelPlan.single()` (one device, "auto" attention). With a mesh the forward runs
      sequence-parallel over U * R devices, the batch split over the cfg axis and, when the mesh
      has one, the windows axis, cfg-major (C * W must divide B);
      `plan.attention_implementation` ("auto": fixed-m where the mesh-uniform gate
      admits it, else LSE; "lse" or "fixed_m" forced, NaN where the gate rejects),
      `plan.attention_backend` and `plan.block_sizes` apply to every self- and cross-attention;
      with `plan.shard_weights` the stacked block weights arrive sharded over the mesh (FSDP /
      ZeRO-3, `weight_shardings`) and each layer's are all-gathered inside the layer scan.
    encoder_hidden_states_image: [B, J, image_dim] CLIP penultimate states (FLF2V: [2B, J,
      image_dim], each video's first and last frame) for a transformer with an image branch
      (Wan 2.1 I2V / FLF2V) unless `encoder_hidden_states` holds their K/V, else None. Embedded,
      projected to every block's image K/V (`cross_kv.image_kv`) and attended by the
      cross-attention beside the text (replicated, local).
    control_hidden_states: [B, Cv, F, Hl, Wl] the VACE context (`vace_in_channels` on the latents'
      grid) for a transformer with VACE blocks (`config.vace_layers`), else None; diffusers' name.
    control_hidden_states_scale: [V] one scale per VACE block (diffusers' `conditioning_scale`), or
      None for ones.

  Returns:
    [B, C_out, F, Hl, Wl] in the model dtype.

  Raises:
    ValueError: shapes that do not fit the config, or a plan that is not a `ParallelPlan`.
  """
  x_BTD, context = embed(model, latents, timestep, encoder_hidden_states, plan, encoder_hidden_states_image,
                         control_hidden_states=control_hidden_states,
                         control_hidden_states_scale=control_hidden_states_scale)
  return unembed(model, run_blocks(model, x_BTD, context), context)


def _map_with_path(fn, tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
  """Applies fn(path, leaf) to every non-dict leaf of a nested dict."""
  return {k: _map_with_path(fn, v, (*path, k)) if isinstance(v, Mapping) else fn((*path, k), v)
          for k, v in tree.items()}


def build_transformer(config: WanTransformerConfig, params: Mapping[str, Any],
                      dtype: jnp.dtype = jnp.float32) -> WanTransformer:
  """Builds the module from a nested dict of arrays in our layout, casting per diffusers' policy.

  Every array is cast to `dtype` except those under `KEEP_IN_FP32`, which become fp32; a
  `qwix.QArray` (a kernel quantized at load) is kept as it is.

  Raises:
    ValueError: an array's shape differs from `param_shapes(config)` (names all of them).
  """
  shapes = param_shapes(config)
  bad = []

  def cast(path, shape):
    value = _lookup(params, path)
    if value is None or tuple(value.shape) != tuple(shape):
      bad.append(f"{'.'.join(path)}: got {None if value is None else tuple(value.shape)}, want {shape}")
      return None
    if isinstance(value, qwix.QArray):  # quantized at load (`loading`): kept as it is
      return value
    return jnp.asarray(value, jnp.float32 if keeps_fp32(path) else dtype)

  arrays = _map_with_path(cast, shapes)
  if bad:
    raise ValueError(f"parameters do not fit {config}:\n  " + "\n  ".join(bad))
  return WanTransformer(config, arrays)


def _lookup(tree: Mapping[str, Any], path: tuple[str, ...]):
  for key in path:
    if not isinstance(tree, Mapping) or key not in tree:
      return None
    tree = tree[key]
  return tree


def init_transformer(config: WanTransformerConfig, seed: int = 0, dtype: jnp.dtype = jnp.float32, *,
                     on_device: bool = False) -> WanTransformer:
  """Random initialisation with torch's defaults (what diffusers gives before loading weights).

  Linear / Conv3d kernels and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)); RMSNorm / LayerNorm
  gains 1, biases 0; scale_shift_tables ~ N(0, 1) / sqrt(D) (diffusers' init). Drawn in fp32
  with numpy on the host (no per-parameter XLA compiles: those cost ~10 s for the tiny config on
  CPU) and cast as in `build_transformer`; with `on_device`, drawn by jax.random on the default
  device instead and cast there, the stacked [Z, ...] kernels one block's row at a time
  (`_device_draw`), so the device holds the cast model and one row's fp32 draw and the host holds
  nothing (the same distributions, other values: seconds for 5 B values on an accelerator, where
  numpy takes about a minute).
  """
  shapes = param_shapes(config)
  rng = np.random.default_rng(seed)
  key, leaf_index = (jax.random.key(seed) if on_device else None), itertools.count()

  def draw(path, shape):
    kind, scale = _init_rule(config, shapes, path)
    if kind in ("ones", "zeros"):
      return (np.ones if kind == "ones" else np.zeros)(shape, np.float32)
    if on_device:
      target = jnp.float32 if keeps_fp32(path) else dtype
      return _device_draw(jax.random.fold_in(key, next(leaf_index)), scale, kind=kind, shape=tuple(shape),
                          dtype=jnp.dtype(target))
    if kind == "normal":
      return rng.standard_normal(shape, np.float32) / np.float32(scale)
    value = rng.random(shape, np.float32)
    value *= np.float32(2 * scale)
    value -= np.float32(scale)
    return value

  def draw_and_cast(path, shape):
    # Cast leaf by leaf so that at most one fp32 host copy is alive at a time (1.3B: 5 GB fp32).
    return jnp.asarray(draw(path, shape), jnp.float32 if keeps_fp32(path) else dtype)

  params = _map_with_path(draw_and_cast, shapes)
  return build_transformer(config, params, dtype)


@functools.partial(jax.jit, static_argnames=("kind", "shape", "dtype"))
def _device_draw(key: jax.Array, scale: float, *, kind: str, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
  """One parameter drawn by jax.random in fp32 and cast to `dtype` on the device: N(0, 1) / scale
  ("normal") or U(-scale, scale) ("uniform"). A stacked kernel (3 or more axes, [Z, I, O] or
  [Z, ...]) is drawn one row of its first axis at a time inside the program (`lax.map` writes each
  cast row into the output), so its temporaries are one row's fp32 draw, not the whole leaf's
  (TI2V-5B's FFN kernels: 5.3 GB in fp32 beside a 10 GB model on a 16 GB chip)."""
  def one(k, row_shape):
    if kind == "normal":
      return (jax.random.normal(k, row_shape, jnp.float32) / scale).astype(dtype)
    return jax.random.uniform(k, row_shape, jnp.float32, -scale, scale).astype(dtype)

  if len(shape) < 3:
    return one(key, shape)
  return jax.lax.map(lambda i: one(jax.random.fold_in(key, i), shape[1:]), jnp.arange(shape[0]))


def _init_rule(config: WanTransformerConfig, shapes: Mapping[str, Any], path: tuple[str, ...]) -> tuple[str, float]:
  """torch's default init of parameter `path`: ("normal", d: N(0, 1) / d), ("uniform", bound:
  U(-bound, bound)), ("ones", 0) or ("zeros", 0)."""
  if path[-1] == "scale_shift_table":
    return "normal", math.sqrt(config.dim)
  if path[-1] in ("norm_q", "norm_k", "norm_added_k") or path[-1] == "weight":
    return "ones", 0.0  # RMSNorm / LayerNorm gains
  if path[-2] in ("norm1", "norm2") or path[-1] == "pos_embed":
    return "zeros", 0.0
  # Dense / Conv kernel [..., I, O] ([pt, ph, pw, C, D]) or its bias, sharing its fan-in.
  fan_in = {"patch_embedding": config.in_channels * config.patch_volume,
            "vace_patch_embedding": config.vace_in_channels * config.patch_volume}
  kernel_shape = _lookup(shapes, (*path[:-1], "kernel"))
  return "uniform", 1.0 / math.sqrt(fan_in.get(path[0], kernel_shape[-2]))


def count_params(model: WanTransformer) -> int:
  """Total number of parameters."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
