"""Loading Wan from single files (ComfyUI's and the official release's) and from a folder in the
official Wan layout: `WanPipeline.from_single_file` (`SingleFileMixin`) and `pretrained_parts`, which
`from_pretrained` calls for any folder.

Which layout a file or a folder is in is told by `wan.pretrained.layouts` alone; configs that a single
file does not carry are inferred from its shapes (`wan.pretrained.inference`) or read from `config=`
(a diffusers folder, as diffusers' `from_single_file(config=...)`). The tensors stay memory-mapped
and go through the same loaders as a diffusers folder's (`load_transformer_state`, `vae_from_state`,
`umt5_from_state`): renamed, not copied.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pipelines.parallel.plan import ParallelPlan
from pipelines.pipeline.load import loading
from pipelines.wan import vae as wan_vae
from pipelines.wan.encoders import umt5_from_state
from pipelines.wan.pretrained import (GenerationDefaults, Sources, check_no_image_branch, folder_layout,
                                      read_sources)
from pipelines.wan.transformer import check_quantization, large_leaf_shardings, load_transformer_state

def source_parts(sources: Sources, dtype: str, vae_dtype: str, mesh: Any, shard_weights: bool,
                 progress: bool | None, quantize: str | None, *, image_to_video: bool = False
                 ) -> tuple[dict[str, Any], ParallelPlan | None]:
  """The `WanPipeline` constructor's keyword arguments from `sources` (as `loading.folder_parts`).

  Raises:
    weights.CheckpointError: a missing, truncated or foreign file, shapes no Wan config has.
    TokenizerNotFoundError: no tokenizer folder.
  """
  model_dtype, vae_dt = loading.dtype_of(dtype), loading.dtype_of(vae_dtype)
  # The config folder's own sampling defaults, as from_pretrained of it would take them (a bad file
  # refused before any weight loads); diffusers' where there is no config folder.
  defaults = GenerationDefaults() if sources.config is None else GenerationDefaults.read(sources.config)
  read = read_sources(sources)
  config = read.transformer_config
  check_no_image_branch(read)
  plan = None if mesh is None and not shard_weights else ParallelPlan.build(
      mesh, heads=config.num_attention_heads, shard_weights=shard_weights)
  mesh_built, sharded = (None, False) if plan is None else (plan.mesh, plan.shard_weights)
  expert = load_transformer_state(config, read.transformer.tensors, read.transformer.path, model_dtype,
                                  mesh=mesh_built, shard_weights=sharded, progress=progress, quantize=quantize,
                                  scales=read.transformer.scales)
  text = read.text_encoder
  text_encoder = umt5_from_state(
      read.text_encoder_config, text.tensors, text.path, dtype=model_dtype, progress=progress, scales=text.scales,
      shardings=functools.partial(large_leaf_shardings, mesh=mesh_built) if sharded else
      loading.text_encoder_shardings(read.text_encoder_config, model_dtype))
  vae = wan_vae.vae_from_state(read.vae_config, read.vae.tensors, read.vae.path, dtype=vae_dt, progress=progress,
                               scales=read.vae.scales)
  parts = dict(tokenizer=read.tokenizer, text_encoder=text_encoder, transformers=[expert], vae=vae,
               scheduler_config=read.scheduler_config, expand_timesteps=read.expand_timesteps,
               generation_defaults=defaults, name=os.path.abspath(sources.transformer))
  if image_to_video:
    parts.update(image_encoder=None, image_processor=None)
  return parts, plan


def pretrained_parts(folder: str, dtype: str, vae_dtype: str, mesh: Any, shard_weights: bool,
                     progress: bool | None, quantize: str | None, *, image_to_video: bool = False,
                     name: str | None = None) -> tuple[dict[str, Any], ParallelPlan | None]:
  """`from_pretrained`'s parts of a diffusers folder (`loading.folder_parts`, the pipeline named
  `name`) or of a folder in the official Wan layout (`folder_layout` tells which)."""
  if folder_layout(folder) == "diffusers":
    return loading.folder_parts(folder, dtype, vae_dtype, mesh, shard_weights, progress, quantize,
                                image_to_video=image_to_video, name=name)
  return source_parts(Sources.official(folder), dtype, vae_dtype, mesh, shard_weights, progress, quantize,
                      image_to_video=image_to_video)


def built(cls: type, parts: dict[str, Any], plan: ParallelPlan | None, quantize: str | None) -> Any:
  """The pipeline of `parts`, its weights where `plan` placed them, quantized as they were loaded."""
  pipe = cls(**parts)
  pipe.quantization = quantize
  if plan is not None:  # already where a call on this mesh wants them
    pipe.weights.placed_at(plan)
  return pipe


class SingleFileMixin:
  """`from_single_file` (diffusers' `FromSingleFileMixin`, for a whole pipeline's files)."""

  image_to_video = False

  @classmethod
  def from_single_file(cls, transformer: str, vae: str, text_encoder: str, tokenizer: str | None = None,
                       dtype: str = "float32", vae_dtype: str = "float32", *, config: str | None = None,
                       mesh: Any = None, shard_weights: bool = False, progress: bool | None = None,
                       quantize: str | None = None) -> Any:
    """Loads a Wan pipeline from one file per component, e.g. ComfyUI's
    (`wan2.1_t2v_1.3B_fp16.safetensors`, `wan_2.1_vae.safetensors`, `umt5_xxl_fp16.safetensors`).

    Args:
      transformer, vae, text_encoder: the files (.safetensors; .pth through torch); any layout
        `wan.pretrained.layouts` reads: original Wan / ComfyUI names (with or without
        `model.diffusion_model.`), ComfyUI's scaled fp8, diffusers / transformers names.
      tokenizer: a local folder with the google/umt5-xxl tokenizer (or a pipeline folder holding
        tokenizer/); required: no UMT5 tokenizer ships with this package.
      dtype, vae_dtype, mesh, shard_weights, progress: as `from_pretrained`.
      config: None (configs matched by the shapes to a released Wan model's or a shipped tiny one's,
        `wan.pretrained.inference`; the scheduler is diffusers' Wan folders' UniPC) or a local
        diffusers folder whose config.json files are used instead: needed for shapes of no known
        model (refused without it: the heads and the VAE's latent statistics are no weights).
      quantize: as `from_pretrained`; with "fp8" a scaled-fp8 file's block weights are placed as they
        are (1 byte a value, their scales, per tensor or per output row, as per-channel ones).
        Without it they are dequantized (q * scale, row by row) to `dtype`; an fp8 text encoder or
        VAE is always upcast to its dtype.

    Raises:
      weights.CheckpointError: a missing, truncated or foreign file, shapes that match no known Wan
        config without `config`, a scale of an unsupported shape.
      TokenizerNotFoundError: no tokenizer folder.
      ValueError: an unknown dtype or quantize mode, a mesh that does not fit.
    """
    check_quantization(quantize)
    sources = Sources(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, config=config)
    parts, plan = source_parts(sources, dtype, vae_dtype, mesh, shard_weights, progress, quantize,
                               image_to_video=cls.image_to_video)
    return built(cls, parts, plan, quantize)
