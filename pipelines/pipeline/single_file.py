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

import dataclasses
import functools
import os
from typing import Any

from pipelines.parallel.plan import ParallelPlan
from pipelines.pipeline import loading
from pipelines.storage import weights
from pipelines.wan import schedulers, vae as wan_vae
from pipelines.wan.encoders import TokenizerNotFoundError, load_tokenizer, umt5
from pipelines.wan.pretrained import inference, layouts
from pipelines.wan.transformer import (WanTransformerConfig, large_leaf_shardings, load_transformer_state,
                                       quantization)

TOKENIZER_FIX = ("pass tokenizer= a local folder holding the google/umt5-xxl tokenizer (e.g. the tokenizer/ folder of "
                 "Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or the google/umt5-xxl/ folder of the official release)")


@dataclasses.dataclass(frozen=True)
class Sources:
  """Where a pipeline's parts come from: the component files and what configures them.

  Attributes:
    transformer, vae, text_encoder: the component files (`layouts.read_component`); the official
      layout's transformer is its folder.
    tokenizer: a tokenizer folder, or a pipeline folder holding tokenizer/.
    config: None (configs inferred from the shapes) or a diffusers folder whose JSON files are read.
    heads: the transformer's heads when known (the official config.json's `num_heads`).
  """
  transformer: str
  vae: str
  text_encoder: str
  tokenizer: str | None
  config: str | None = None
  heads: int | None = None


def _tokenizer(path: str | None) -> Any:
  if path is None:
    raise TokenizerNotFoundError(f"tokenizer=None: no UMT5 tokenizer ships with this package; {TOKENIZER_FIX}")
  if not os.path.isdir(path):
    raise TokenizerNotFoundError(f"tokenizer={path!r} is not a folder; {TOKENIZER_FIX}")
  if os.path.isdir(os.path.join(path, "tokenizer")):
    return load_tokenizer(path)
  import transformers
  return transformers.AutoTokenizer.from_pretrained(path)


def _configs(sources: Sources, transformer: layouts.ComponentFile) -> tuple[WanTransformerConfig, Any, Any]:
  """(transformer config, VAE config or None (inferred when read), scheduler config)."""
  if sources.config is not None:
    folder = sources.config
    return (WanTransformerConfig.from_dict(weights.read_config(os.path.join(folder, "transformer"))),
            wan_vae.WanVAEConfig.from_diffusers(weights.read_config(os.path.join(folder, "vae"))),
            schedulers.scheduler_config_from_dict(weights.read_json(os.path.join(folder, "scheduler",
                                                                                  "scheduler_config.json"))))
  config = inference.transformer_config(transformer.shapes, transformer.path)
  if sources.heads is not None:
    config = dataclasses.replace(config, num_attention_heads=sources.heads,
                                 attention_head_dim=config.dim // sources.heads)
  # diffusers' Wan folders: flow shift 3.0 (Wan 2.1), 5.0 for Wan 2.2 TI2V-5B (48 latent channels)
  return config, None, schedulers.UniPCConfig(flow_shift=5.0 if config.in_channels == 48 else 3.0)


def source_parts(sources: Sources, dtype: str, vae_dtype: str, mesh: Any, shard_weights: bool,
                 progress: bool | None, quantize: str | None, *, image_to_video: bool = False
                 ) -> tuple[dict[str, Any], ParallelPlan | None]:
  """The `WanPipeline` constructor's keyword arguments from `sources` (as `loading.folder_parts`).

  Raises:
    weights.CheckpointError: a missing, truncated or foreign file, shapes no Wan config has.
    TokenizerNotFoundError: no tokenizer folder.
  """
  model_dtype, vae_dt = loading.dtype_of(dtype), loading.dtype_of(vae_dtype)
  tokenizer = _tokenizer(sources.tokenizer)
  transformer = (layouts.OfficialFolder.transformer_of(sources.transformer) if os.path.isdir(sources.transformer)
                 else layouts.read_component(sources.transformer, "transformer"))
  config, vae_config, scheduler_config = _configs(sources, transformer)
  vae = layouts.read_component(sources.vae, "vae", vae_config)
  text = layouts.read_component(sources.text_encoder, "text_encoder")
  if config.has_image_branch:
    raise weights.CheckpointError(
        f"{transformer.path!r} is a Wan 2.1 image-to-video transformer (CLIP image branch); its CLIP vision "
        "encoder does not load from a single file here: use a diffusers folder (WanImageToVideoPipeline.from_pretrained)")
  plan = None if mesh is None and not shard_weights else ParallelPlan.build(
      mesh, heads=config.num_attention_heads, shard_weights=shard_weights)
  mesh_built, sharded = (None, False) if plan is None else (plan.mesh, plan.shard_weights)
  expert = load_transformer_state(config, transformer.tensors, transformer.path, model_dtype, mesh=mesh_built,
                                  shard_weights=sharded, progress=progress, quantize=quantize,
                                  scales=transformer.scales)
  text_config = inference.umt5_config(text.shapes, text.path)
  text_encoder = umt5.umt5_from_state(
      text_config, text.tensors, text.path, dtype=model_dtype, progress=progress, scales=text.scales,
      shardings=functools.partial(large_leaf_shardings, mesh=mesh_built) if sharded else None)
  vae_config = vae_config or inference.vae_config(vae.shapes, vae.path)
  parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, transformers=[expert],
               vae=wan_vae.vae_from_state(vae_config, vae.tensors, vae.path, dtype=vae_dt, progress=progress),
               scheduler_config=scheduler_config, expand_timesteps=config.in_channels == 48 and vae_config.z_dim == 48,
               name=os.path.abspath(sources.transformer))
  if image_to_video:
    parts.update(image_encoder=None, image_processor=None)
  return parts, plan


def pretrained_parts(folder: str, dtype: str, vae_dtype: str, mesh: Any, shard_weights: bool,
                     progress: bool | None, quantize: str | None, *, image_to_video: bool = False
                     ) -> tuple[dict[str, Any], ParallelPlan | None]:
  """`from_pretrained`'s parts of a diffusers folder (`loading.folder_parts`) or of a folder in the
  official Wan layout (`layouts.folder_layout` tells which)."""
  if layouts.folder_layout(folder) == "diffusers":
    return loading.folder_parts(folder, dtype, vae_dtype, mesh, shard_weights, progress, quantize,
                                image_to_video=image_to_video)
  official = layouts.OfficialFolder.read(folder)
  sources = Sources(transformer=folder, vae=official.vae, text_encoder=official.text_encoder,
                    tokenizer=official.tokenizer, heads=official.heads())
  return source_parts(sources, dtype, vae_dtype, mesh, shard_weights, progress, quantize,
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
      config: None (configs from the shapes, `wan.pretrained.inference`; the scheduler is diffusers'
        Wan folders' UniPC) or a local diffusers folder whose config.json files are used instead.
      quantize: as `from_pretrained`; with "fp8" a scaled-fp8 file's block weights are placed as they
        are (1 byte a value, their per-tensor scales as per-channel ones). Without it they are
        dequantized (q * scale) to `dtype`; an fp8 text encoder is always upcast to `dtype`.

    Raises:
      weights.CheckpointError: a missing, truncated or foreign file, shapes that match no Wan config.
      TokenizerNotFoundError: no tokenizer folder.
      ValueError: an unknown dtype or quantize mode, a mesh that does not fit.
    """
    quantization.check_mode(quantize)
    sources = Sources(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, config=config)
    parts, plan = source_parts(sources, dtype, vae_dtype, mesh, shard_weights, progress, quantize,
                               image_to_video=cls.image_to_video)
    return built(cls, parts, plan, quantize)
