"""Building a `WanPipeline`'s parts: from a diffusers-format folder (a local one, or a Hugging Face Hub
repo's snapshot: `locate`), or the embedded tiny models."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pipelines.parallel.plan import ParallelPlan
from pipelines.storage import weights
from pipelines.wan import schedulers, vae as wan_vae
from pipelines.wan.encoders import (UMT5_PRESETS, UMT5Config, abstract_umt5_params, default_tokenizer, init_umt5_params,
                                    load_clip_vision, load_tokenizer, load_umt5)
from pipelines.wan.pretrained import (TINY_SCHEDULER, TINY_SEED, TINY_TRANSFORMER, GenerationDefaults, HubSnapshot,
                                      PipelineIndex,
                                      download_snapshot, hub_id)
from pipelines.wan.transformer import init_transformer, large_leaf_shardings, load_transformer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str) -> jnp.dtype:
  """"float32" / "bfloat16" as a JAX dtype.

  Raises:
    ValueError: any other name.
  """
  if name not in DTYPES:
    raise ValueError(f"dtype={name!r} is not supported; use one of {sorted(DTYPES)}")
  return DTYPES[name]


def locate(model: str, *, revision: str | None = None, token: str | bool | None = None,
           cache_dir: str | None = None, local_files_only: bool = False,
           image_to_video: bool | None = None) -> tuple[str, str, HubSnapshot | None]:
  """(local folder, the pipeline's name, the Hub snapshot or None) of a `from_pretrained` model: a
  folder as it is (named by its absolute path), or a Hub id `org/name[@revision]` downloaded where
  not cached (`pretrained.download_snapshot`; named by its repo id). `image_to_video`: the class
  loading it (None: either), checked against the repo's model_index.json before any weight is
  downloaded.

  Raises:
    ValueError: a revision both in the id and as `revision`, or a repo of the other class.
    weights.CheckpointError: see `pretrained.download_snapshot`.
  """
  parsed = hub_id(model)
  if parsed is None:
    return model, os.path.abspath(model), None
  repo_id, asked = parsed
  if asked is not None and revision is not None and asked != revision:
    raise ValueError(f"{model!r} names revision {asked!r} and revision={revision!r} another; give one")

  def check_index(index: dict[str, Any]) -> None:
    if image_to_video is not None:
      check_class(repo_id, index.get("_class_name") == "WanImageToVideoPipeline",
                  index.get("expand_timesteps") is True, image_to_video)

  snapshot = download_snapshot(repo_id, asked or revision, token=token, cache_dir=cache_dir,
                               local_files_only=local_files_only, check_index=check_index)
  return snapshot.folder, repo_id, snapshot


def check_class(where: str, folder_image_to_video: bool, expand_timesteps: bool, image_to_video: bool) -> None:
  """A folder or repo loads with the class of its model_index.json `_class_name` (a TI2V one with either).

  Raises:
    ValueError: a text-to-video folder for the image-to-video class or the other way round.
  """
  if folder_image_to_video != image_to_video and not expand_timesteps:
    want, other = (("WanImageToVideoPipeline", "WanPipeline") if folder_image_to_video
                   else ("WanPipeline", "WanImageToVideoPipeline"))
    raise ValueError(f"{where!r} is a {want} folder (model_index.json _class_name); load it with "
                     f"{want}.from_pretrained, not {other}")


def folder_parts(folder: str, dtype: str, vae_dtype: str, mesh: Any, shard_weights: bool,
                 progress: bool | None, quantize: str | None = None, *, image_to_video: bool = False,
                 name: str | None = None) -> tuple[dict[str, Any], ParallelPlan | None]:
  """The `WanPipeline` constructor's keyword arguments read from `folder`, and the plan the weights
  were placed for (None: the first device). `WanPipeline.from_pretrained` documents the arguments;
  `image_to_video`: the caller is `WanImageToVideoPipeline` (its parts add `image_encoder` and
  `image_processor`, None for Wan 2.2 I2V A14B); `name`: the pipeline's (None: the folder's
  absolute path).

  Raises:
    ValueError: a text-to-video folder for the image-to-video class or the other way round.
    ValueError: an unknown dtype, or a mesh that does not fit the devices or heads.
    weights.CheckpointError: see `PipelineIndex.read`, `PipelineIndex.check_weights` and the loaders.
    tokenizer.TokenizerNotFoundError: no tokenizer/ folder.
  """
  model_dtype, vae_dt = dtype_of(dtype), dtype_of(vae_dtype)
  index = PipelineIndex.read(folder)
  check_class(folder, index.image_to_video, index.expand_timesteps, image_to_video)
  plan = None
  if mesh is not None or shard_weights:
    plan = ParallelPlan.build(mesh, heads=index.transformer.num_attention_heads, shard_weights=shard_weights)
  index.check_weights()  # a truncated last file fails now, not after loading the others
  scheduler_config = schedulers.scheduler_config_from_dict(weights.read_json(
      os.path.join(folder, "scheduler", "scheduler_config.json"), "the scheduler/ folder needs scheduler_config.json"))
  defaults = GenerationDefaults.read(folder)  # a bad file refused before any weight loads
  names = index.experts
  if index.has_transformer_2 and index.boundary_ratio is None and names == ("transformer",):
    warnings.warn(f"{folder!r} has transformer_2/ but no boundary_ratio: diffusers never runs it; "
                  "it is not loaded", stacklevel=3)
  mesh_built, sharded = (None, False) if plan is None else (plan.mesh, plan.shard_weights)
  experts = [load_transformer(os.path.join(folder, n), model_dtype, mesh=mesh_built, shard_weights=sharded,
                              progress=progress, quantize=quantize) for n in names]
  text_folder = os.path.join(folder, "text_encoder")
  text_shardings = (functools.partial(large_leaf_shardings, mesh=mesh_built) if sharded else
                    text_encoder_shardings(UMT5Config.from_dict(weights.read_config(text_folder)), model_dtype))
  text_encoder = load_umt5(text_folder, dtype=model_dtype, shardings=text_shardings, progress=progress)
  parts = dict(tokenizer=load_tokenizer(folder), text_encoder=text_encoder, transformers=experts,
               vae=wan_vae.load_vae(os.path.join(folder, "vae"), dtype=vae_dt, progress=progress),
               scheduler_config=scheduler_config, boundary_ratio=index.boundary_ratio,
               expand_timesteps=index.expand_timesteps, generation_defaults=defaults,
               name=os.path.abspath(folder) if name is None else name)
  if image_to_video:
    parts.update(image_encoder=None, image_processor=None)
    if index.image_encoder:
      parts.update(image_encoder=load_clip_vision(os.path.join(folder, "image_encoder")),
                   image_processor=load_image_processor(os.path.join(folder, "image_processor")))
  return parts, plan


def text_encoder_shardings(config: UMT5Config, dtype: Any) -> Any:
  """Where a text encoder is loaded when its weights are not sharded: None (the default device) when
  they fit beside what the device already holds (`memory_stats()["bytes_in_use"]`, the transformer
  loaded first) within `memory.device_budget`, else a function giving every leaf the host CPU's
  device: the memory plan uploads them for each encode, or runs the encoder there. A CPU backend, or
  a run of several processes, always gets None."""
  from pipelines.parallel.memory import device_budget

  budget = device_budget()
  if budget is None or jax.process_count() > 1:
    return None
  need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_umt5_params(config, dtype=dtype)))
  if (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0) + need <= budget:
    return None
  host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  return lambda params: jax.tree.map(lambda _: host, params)


def load_image_processor(folder: str) -> Any:
  """transformers' `CLIPImageProcessor` of an `image_processor/` folder (without torchvision it is
  transformers' PIL implementation, `CLIPImageProcessorPil`; the same pixels).

  Raises:
    weights.CheckpointError: no preprocessor_config.json.
  """
  if not os.path.isfile(os.path.join(folder, "preprocessor_config.json")):
    raise weights.CheckpointError(f"{folder!r} has no preprocessor_config.json (the CLIP image processor)")
  import transformers
  from transformers.utils import logging as transformers_logging

  verbosity = transformers_logging.get_verbosity()
  transformers_logging.set_verbosity_error()  # its note that torchvision is absent (the PIL one is used)
  try:
    return transformers.CLIPImageProcessor.from_pretrained(folder)
  finally:
    transformers_logging.set_verbosity(verbosity)


def tiny_random_parts(dtype: str, vae_dtype: str = "float32") -> dict[str, Any]:
  """The constructor's keyword arguments of the random-weight tiny model (`wan.pretrained.tiny`)."""
  model_dtype = dtype_of(dtype)
  te_config = UMT5_PRESETS["tiny"]
  return dict(tokenizer=default_tokenizer(),
              text_encoder=(te_config, init_umt5_params(te_config, TINY_SEED, dtype=model_dtype)),
              transformers=[init_transformer(TINY_TRANSFORMER, TINY_SEED, model_dtype)],
              vae=wan_vae.init_vae(wan_vae.VAE_PRESETS["tiny"], jax.random.key(TINY_SEED),
                                   dtype=dtype_of(vae_dtype)),
              scheduler_config=TINY_SCHEDULER, name="tiny-random")


def check_parts(text_config: UMT5Config, transformers: Sequence[Any], vae: wan_vae.WanVAE,
                 boundary_ratio: float | None) -> None:
  """Raises ValueError unless the parts fit together (one or two experts of one config)."""
  if len(transformers) not in (1, 2) or (len(transformers) == 2) != (boundary_ratio is not None):
    raise ValueError(f"need one transformer, or two with a boundary_ratio; got {len(transformers)=} "
                     f"{boundary_ratio=}")
  configs = {t.config for t in transformers}
  if len(configs) != 1:
    raise ValueError(f"both experts must share one config, got {configs}")
  config = transformers[0].config
  if text_config.d_model != config.text_dim:
    raise ValueError(f"text encoder d_model={text_config.d_model} != transformer text_dim={config.text_dim}")
  if vae.config.z_dim != config.out_channels:
    raise ValueError(f"VAE z_dim={vae.config.z_dim} != transformer out_channels={config.out_channels}")

