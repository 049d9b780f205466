"""Model configs inferred from weight shapes (single files carry no config), as diffusers'
`infer_diffusers_model_type` and ComfyUI's `comfy/model_detection.py` (`detect_unet_config`) do.

Every function takes the tensors' shapes under diffusers' key names (`layouts` renames the file's
keys first) and reads no weights, so it runs on shape-only dicts at real sizes; the module imports
no JAX (matching imports `pretrained.tiny`, which does, and reads the shipped folders' JSON).

What the shapes fix and what they do not:
- transformer: D, C, patch and the output channels (`patch_embedding`, `proj_out`), the FFN width,
  the layers, the text and timestep widths, the CLIP image branch (Wan 2.1 I2V / FLF2V), the VACE
  blocks (one every num_layers / V blocks: Wan's `range(0, num_layers, 2)` for 1.3B, 5 for 14B).
  Not the heads: no weight shows them. So the shapes are matched against the known configs
  (`known_transformers`: the released ones, the random tiny model's and the shipped tiny folders'):
  a file whose every shape-fixed field is one of theirs is that model. A file of a released width D
  (1536, 3072, 5120) with other shapes (a fine-tune with other input channels) has that width's
  heads: every released Wan has head dim H = 128 (ComfyUI's rule). Anything else is refused: its
  heads would be a guess (a D = 128 model read as one head of 128 runs, and makes noise).
- VAE: the topology; not the latent statistics, which are not weights: the known VAE of the same
  topology gives them (`known_vaes`); a topology of none, or of several with different statistics
  (the two shipped tiny folders'), is refused.
- UMT5: everything (heads from the relative-position table [buckets, N]).
Every refusal names the shapes and the fix: the model's config (`CONFIG_FIX`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from pipelines.storage.weights import CheckpointError, read_config
from pipelines.wan.transformer.config import PRESETS, WanTransformerConfig
from pipelines.wan.vae import config as vae_configs

Shapes = Mapping[str, tuple[int, ...]]
HEAD_DIM = 128  # every released Wan (DESIGN.md glossary: H)
CONFIG_FIX = ("pass the model's config: --config FOLDER (CLI) or config=FOLDER (Python), a diffusers-format "
              "folder whose config.json files describe the model")


def _count(shapes: Shapes, prefix: str) -> int:
  found = {int(m[1]) for k in shapes if (m := re.match(rf"{re.escape(prefix)}\.(\d+)\.", k))}
  return max(found) + 1 if found else 0


def _need(shapes: Shapes, key: str, where: str, what: str) -> tuple[int, ...]:
  if key not in shapes:
    raise CheckpointError(f"{where!r}: no {key!r}, so its shapes match no Wan {what} config; {CONFIG_FIX}")
  return tuple(shapes[key])


def _shipped_folders() -> dict[str, str]:
  """name -> the shipped tiny pipeline folders (`pretrained.embedded`)."""
  from pipelines.wan.pretrained import embedded

  return {"tiny_default": embedded.TINY_DEFAULT_FOLDER, "tiny_i2v": embedded.TINY_I2V_FOLDER}


def known_transformers() -> dict[str, WanTransformerConfig]:
  """name -> every transformer config a single file's shapes are matched against: `PRESETS` (the
  released Wan models, and "tiny"), the random tiny model's ("tiny-random") and the shipped tiny
  folders' (read from their JSON)."""
  from pipelines.wan.pretrained import tiny

  folders = {name: WanTransformerConfig.from_dict(read_config(os.path.join(path, "transformer")))
             for name, path in _shipped_folders().items()}
  return {**PRESETS, "tiny-random": tiny.TINY_TRANSFORMER, **folders}


def known_vaes() -> dict[str, vae_configs.WanVAEConfig]:
  """name -> every VAE config a single file's shapes are matched against: `VAE_PRESETS` (the
  released Wan 2.1 and 2.2 VAEs, the tiny test topologies) and the shipped tiny folders'."""
  folders = {name: vae_configs.WanVAEConfig.from_diffusers(read_config(os.path.join(path, "vae")))
             for name, path in _shipped_folders().items()}
  return {**vae_configs.VAE_PRESETS, **folders}


def _transformer_fields(shapes: Shapes, where: str) -> dict[str, Any]:
  """Every `WanTransformerConfig` field the shapes fix, and D ("dim"): all but the heads."""
  d, c, *patch = _need(shapes, "patch_embedding.weight", where, "transformer")
  fields = dict(dim=d, in_channels=c, patch_size=tuple(patch),
                out_channels=_need(shapes, "proj_out.weight", where, "transformer")[0] // math.prod(patch),
                ffn_dim=_need(shapes, "blocks.0.ffn.net.0.proj.weight", where, "transformer")[0],
                num_layers=_count(shapes, "blocks"),
                text_dim=_need(shapes, "condition_embedder.text_embedder.linear_1.weight", where, "transformer")[1],
                freq_dim=_need(shapes, "condition_embedder.time_embedder.linear_1.weight", where, "transformer")[1],
                cross_attn_norm="blocks.0.norm2.weight" in shapes, image_dim=None, added_kv_proj_dim=None,
                pos_embed_seq_len=None, vace_layers=None)
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
  return fields


def _described(fields: Mapping[str, Any]) -> str:
  return ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


def transformer_config(shapes: Shapes, where: str = "the transformer",
                       heads: int | None = None) -> WanTransformerConfig:
  """The `WanTransformerConfig` of a transformer's diffusers-named shapes (module docstring).

  Args:
    shapes: diffusers key -> shape.
    where: the file, for messages.
    heads: the heads when known (an official folder's config.json `num_heads`); None: matched.

  Raises:
    CheckpointError: a key every Wan has is missing, shapes that match no known config (nor a
      released width), or that match known configs that differ; named with the shapes and the fix.
  """
  fields = _transformer_fields(shapes, where)
  if heads is None:
    exact = {n: c for n, c in known_transformers().items() if all(getattr(c, k) == v for k, v in fields.items())}
    if len(set(exact.values())) > 1:
      raise CheckpointError(f"{where!r}: its shapes ({_described(fields)}) are those of {' and of '.join(exact)}, "
                            f"whose configs differ; {CONFIG_FIX}")
    if exact:
      return next(iter(exact.values()))
    released = {c.num_attention_heads for c in PRESETS.values()
                if c.attention_head_dim == HEAD_DIM and c.dim == fields["dim"]}
    if len(released) != 1:
      raise CheckpointError(
          f"{where!r}: its shapes ({_described(fields)}) match no released Wan transformer nor a shipped tiny one, "
          f"and no weight shows the heads (D = heads x head dim); {CONFIG_FIX}")
    heads = released.pop()
  d = fields.pop("dim")
  try:
    return WanTransformerConfig(num_attention_heads=heads, attention_head_dim=d // heads, **fields)
  except ValueError as e:
    raise CheckpointError(f"{where!r}: its shapes match no Wan transformer config ({e}); {CONFIG_FIX}") from e


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
      raise CheckpointError(f"encoder.down_blocks.{k}: an attention block (attn_scales) is not inferred; "
                            f"{CONFIG_FIX}")
  return (blocks if res is None else res), widths, times


def _vae_topology(shapes: Shapes, where: str) -> dict[str, Any]:
  """Every `WanVAEConfig` field the shapes fix: all but the latent statistics (and `dropout`)."""
  base, channels, *_ = _need(shapes, "encoder.conv_in.weight", where, "VAE")
  z = _need(shapes, "post_quant_conv.weight", where, "VAE")[0]
  residual = "encoder.down_blocks.0.resnets.0.conv1.weight" in shapes
  res_blocks, widths, times = _stages(shapes, residual)
  decoder = _need(shapes, "decoder.conv_out.weight", where, "VAE")[1]
  patch = 2 if channels == 12 else None
  return dict(base_dim=base, decoder_base_dim=None if decoder == base else decoder, z_dim=z,
              dim_mult=tuple(w // base for w in widths), num_res_blocks=res_blocks, attn_scales=(),
              temperal_downsample=tuple(times), is_residual=residual, in_channels=channels, out_channels=channels,
              patch_size=patch, scale_factor_spatial=2 ** (len(widths) - 1) * (patch or 1),
              scale_factor_temporal=2 ** sum(times))


def vae_config(shapes: Shapes, where: str = "the VAE") -> vae_configs.WanVAEConfig:
  """The `WanVAEConfig` of a VAE's diffusers-named shapes: the known VAE of that topology (module
  docstring), its latent statistics included.

  Raises:
    CheckpointError: a key every Wan VAE has is missing, a topology no known VAE has, or one that
      known VAEs with different latent statistics share; named with the shapes and the fix.
  """
  topology = _vae_topology(shapes, where)
  found = {n: c for n, c in known_vaes().items() if all(getattr(c, k) == v for k, v in topology.items())}
  if not found:
    raise CheckpointError(f"{where!r}: its shapes ({_described(topology)}) match no released Wan VAE nor a shipped "
                          f"tiny one, and the latent statistics are no weights; {CONFIG_FIX}")
  if len({(c.latents_mean, c.latents_std) for c in found.values()}) > 1:
    raise CheckpointError(f"{where!r}: its shapes ({_described(topology)}) are the VAE of {' and of '.join(found)}, "
                          f"whose latent statistics differ (they are no weights); {CONFIG_FIX}")
  return next(iter(found.values()))


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
    raise CheckpointError(f"{where!r}: its shapes match no UMT5 config ({e}); {CONFIG_FIX}") from e
