"""Model configs inferred from weight shapes (single files carry no config), as diffusers'
`infer_diffusers_model_type` and ComfyUI's `comfy/model_detection.py` (`detect_unet_config`) do.

Every function takes the tensors' shapes under diffusers' key names (`layouts` renames the file's
keys first), reads no data and imports no JAX, so it runs on shape-only dicts at real sizes.

What the shapes fix and what they do not:
- transformer: D, C, patch and the output channels (`patch_embedding`, `proj_out`), the FFN width,
  the layers, the text and timestep widths, the CLIP image branch (Wan 2.1 I2V / FLF2V), the VACE
  blocks (one every num_layers / V blocks: Wan's `range(0, num_layers, 2)` for 1.3B, 5 for 14B).
  Not the heads: no weight shows them; every Wan has head dim H = 128, so N = D / 128 (ComfyUI's
  rule). A model with other heads needs its config (`config=`: a diffusers folder).
- VAE: the topology; not the latent statistics, which are not weights: Wan 2.1's for z_dim 16,
  Wan 2.2's for 48 (the only released VAEs), otherwise the config is needed.
- UMT5: everything (heads from the relative-position table [buckets, N]).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pipelines.storage.weights import CheckpointError
from pipelines.wan.transformer.config import WanTransformerConfig
from pipelines.wan.vae import config as vae_configs

Shapes = Mapping[str, tuple[int, ...]]
HEAD_DIM = 128  # every released Wan (DESIGN.md glossary: H)
_FIX = "pass config= a diffusers-format folder whose config.json files describe the model"


def _count(shapes: Shapes, prefix: str) -> int:
  found = {int(m[1]) for k in shapes if (m := re.match(rf"{re.escape(prefix)}\.(\d+)\.", k))}
  return max(found) + 1 if found else 0


def _need(shapes: Shapes, key: str, where: str, what: str) -> tuple[int, ...]:
  if key not in shapes:
    raise CheckpointError(f"{where!r}: no {key!r}, so its shapes match no Wan {what} config; {_FIX}")
  return tuple(shapes[key])


def transformer_config(shapes: Shapes, where: str = "the transformer") -> WanTransformerConfig:
  """The `WanTransformerConfig` of a transformer's diffusers-named shapes.

  Raises:
    CheckpointError: a key every Wan has is missing, or D is no multiple of 128.
  """
  d, c, *patch = _need(shapes, "patch_embedding.weight", where, "transformer")
  if d % HEAD_DIM:
    raise CheckpointError(f"{where!r}: model width D={d} is no multiple of the head dim {HEAD_DIM}, so its "
                          f"shapes match no Wan transformer config; {_FIX}")
  fields = dict(num_attention_heads=d // HEAD_DIM, attention_head_dim=HEAD_DIM, in_channels=c, patch_size=patch,
                out_channels=_need(shapes, "proj_out.weight", where, "transformer")[0] // (patch[0] * patch[1] * patch[2]),
                ffn_dim=_need(shapes, "blocks.0.ffn.net.0.proj.weight", where, "transformer")[0],
                num_layers=_count(shapes, "blocks"),
                text_dim=_need(shapes, "condition_embedder.text_embedder.linear_1.weight", where, "transformer")[1],
                freq_dim=_need(shapes, "condition_embedder.time_embedder.linear_1.weight", where, "transformer")[1],
                cross_attn_norm="blocks.0.norm2.weight" in shapes)
  image = shapes.get("condition_embedder.image_embedder.norm1.weight")
  if image is not None:
    fields.update(image_dim=image[0], added_kv_proj_dim=d if "blocks.0.attn2.add_k_proj.weight" in shapes else None)
    if "condition_embedder.image_embedder.pos_embed" in shapes:
      fields["pos_embed_seq_len"] = shapes["condition_embedder.image_embedder.pos_embed"][1]
  vace = _count(shapes, "vace_blocks")
  if vace:
    step = fields["num_layers"] // vace
    fields.update(vace_layers=tuple(range(0, step * vace, step)),
                  vace_in_channels=_need(shapes, "vace_patch_embedding.weight", where, "VACE")[1])
  try:
    return WanTransformerConfig(**fields)
  except ValueError as e:
    raise CheckpointError(f"{where!r}: its shapes match no Wan transformer config ({e}); {_FIX}") from e


def _stages(shapes: Shapes, residual: bool) -> tuple[int, list[int], list[bool]]:
  """(num_res_blocks, each stage's output width, each downsample's time conv) of the encoder."""
  if residual:  # Wan 2.2: encoder.down_blocks.i.resnets.j, i.downsampler
    stages = _count(shapes, "encoder.down_blocks")
    widths = [shapes[f"encoder.down_blocks.{i}.resnets.0.conv2.weight"][0] for i in range(stages)]
    times = [f"encoder.down_blocks.{i}.downsampler.time_conv.weight" in shapes for i in range(stages - 1)]
    return _count(shapes, "encoder.down_blocks.0.resnets"), widths, times
  widths, times, blocks, res = [], [], 0, None  # Wan 2.1: one flat list, a resampler ends a stage
  for k in range(_count(shapes, "encoder.down_blocks")):
    if f"encoder.down_blocks.{k}.resample.1.weight" in shapes:
      times.append(f"encoder.down_blocks.{k}.time_conv.weight" in shapes)
      res = blocks if res is None else res
      blocks = 0
    elif f"encoder.down_blocks.{k}.conv2.weight" in shapes:
      blocks += 1
      if blocks == 1:
        widths.append(0)
      widths[-1] = shapes[f"encoder.down_blocks.{k}.conv2.weight"][0]
    else:
      raise CheckpointError(f"encoder.down_blocks.{k}: an attention block (attn_scales) is not inferred; {_FIX}")
  return (blocks if res is None else res), widths, times


def vae_config(shapes: Shapes, where: str = "the VAE") -> vae_configs.WanVAEConfig:
  """The `WanVAEConfig` of a VAE's diffusers-named shapes.

  Raises:
    CheckpointError: a key every Wan VAE has is missing, a latent width without released
      statistics, or widths no config gives.
  """
  base, channels, *_ = _need(shapes, "encoder.conv_in.weight", where, "VAE")
  z = _need(shapes, "post_quant_conv.weight", where, "VAE")[0]
  stats = {16: (vae_configs.WAN21_LATENTS_MEAN, vae_configs.WAN21_LATENTS_STD),
           48: (vae_configs.WAN22_LATENTS_MEAN, vae_configs.WAN22_LATENTS_STD)}
  if z not in stats:
    raise CheckpointError(f"{where!r}: z_dim={z} latent channels; only Wan 2.1's 16 and Wan 2.2's 48 have known "
                          f"latent statistics; {_FIX}")
  residual = "encoder.down_blocks.0.resnets.0.conv1.weight" in shapes
  res_blocks, widths, times = _stages(shapes, residual)
  decoder = _need(shapes, "decoder.conv_out.weight", where, "VAE")[1]
  patch = 2 if channels == 12 else None
  try:
    return vae_configs.WanVAEConfig(
        base_dim=base, decoder_base_dim=None if decoder == base else decoder, z_dim=z,
        dim_mult=tuple(w // base for w in widths), num_res_blocks=res_blocks, temperal_downsample=tuple(times),
        latents_mean=stats[z][0], latents_std=stats[z][1], is_residual=residual, in_channels=channels,
        out_channels=channels, patch_size=patch, scale_factor_spatial=2 ** (len(widths) - 1) * (patch or 1),
        scale_factor_temporal=2 ** sum(times))
  except ValueError as e:
    raise CheckpointError(f"{where!r}: its shapes match no Wan VAE config ({e}); {_FIX}") from e


def umt5_config(shapes: Shapes, where: str = "the text encoder") -> Any:
  """The `UMT5Config` of an encoder's transformers-named shapes (`umt5.checkpoint_shapes`)."""
  from pipelines.wan.encoders.umt5 import UMT5Config  # here: the module imports JAX, this one does not

  vocab, width = _need(shapes, "shared.weight", where, "UMT5")
  buckets, heads = _need(shapes, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", where, "UMT5")
  inner = _need(shapes, "encoder.block.0.layer.0.SelfAttention.q.weight", where, "UMT5")[0]
  try:
    return UMT5Config(vocab_size=vocab, d_model=width, d_kv=inner // heads, num_heads=heads,
                      d_ff=_need(shapes, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight", where, "UMT5")[0],
                      num_layers=_count(shapes, "encoder.block"), relative_attention_num_buckets=buckets)
  except ValueError as e:
    raise CheckpointError(f"{where!r}: its shapes match no UMT5 config ({e}); {_FIX}") from e
