"""Writing a diffusers-format Wan pipeline folder (the inverse of `WanPipeline.from_pretrained`).

Layout, as diffusers' `WanPipeline.save_pretrained` writes it (safetensors only):
  model_index.json
  transformer/{config.json, diffusion_pytorch_model.safetensors}   (WanTransformer3DModel)
  vae/{config.json, diffusion_pytorch_model.safetensors}           (AutoencoderKLWan)
  text_encoder/{config.json, model.safetensors}                    (transformers UMT5EncoderModel)
  tokenizer/                                                       (the tokenizer's save_pretrained)
  scheduler/scheduler_config.json                                  (UniPCMultistepScheduler, flow)
Weights go back to the checkpoint (PyTorch) layouts the loaders read: the key maps are the loaders'
own (`transformer.checkpoint_layout`, `umt5.checkpoint_shapes`, `vae.to_jax_layout`),
inverted here, so a folder written here loads with `WanPipeline.from_pretrained` bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from pipelines.wan import schedulers, vae as wan_vae
from pipelines.wan.encoders import umt5
from pipelines.wan.pretrained.generation_defaults import FILE as generation_defaults_file, GenerationDefaults
from pipelines.wan.transformer import checkpoint_layout, WanTransformer

DIFFUSERS_VERSION = "0.33.0"


def write_json(data: Mapping[str, Any], path: str) -> None:
  with open(path, "w") as f:
    json.dump(data, f, indent=2, sort_keys=True)
    f.write("\n")


def _save_tensors(state: Mapping[str, np.ndarray], path: str) -> None:
  from safetensors.numpy import save_file
  save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in state.items()}, path,
            metadata={"format": "pt"})


def transformer_state_dict(model: WanTransformer) -> dict[str, np.ndarray]:
  """diffusers `WanTransformer3DModel` state dict (float32 numpy, torch layouts) of `model`."""
  tree = nnx.to_pure_dict(nnx.state(model))
  out = {}
  for key, _, path, layer, kind in checkpoint_layout(model.config):
    value = tree
    for name in path:
      value = value[name]
    value = np.asarray(value, np.float32)
    if layer is not None:
      value = value[layer]
    match kind:
      case "linear":
        value = value.T
      case "conv3d":
        value = value.transpose(4, 3, 0, 1, 2)  # [pt, ph, pw, C, D] -> [D, C, pt, ph, pw]
      case "table":
        value = value[None]
    out[key] = value
  return out


def vae_state_dict(vae: wan_vae.WanVAE) -> dict[str, np.ndarray]:
  """diffusers `AutoencoderKLWan` state dict (float32 numpy, torch layouts) of `vae`."""
  shapes = vae.config.param_shapes()
  out = {}
  for key, shape in shapes.items():
    value = np.asarray(vae.params[key], np.float32)
    if key.endswith(".gamma"):
      value = value.reshape(shape)
    elif key.endswith(".weight"):
      value = value.transpose(4, 3, 0, 1, 2)  # [kt, kh, kw, I, O] -> [O, I, kt, kh, kw]
      if len(shape) == 4:  # Conv2d: the leading time axis of length 1 goes
        value = value[:, :, 0]
    out[key] = value.reshape(shape)
  return out


def umt5_state_dict(config: umt5.UMT5Config, params: umt5.UMT5Params) -> dict[str, np.ndarray]:
  """transformers `UMT5EncoderModel` state dict (float32 numpy, torch layouts)."""
  c = config
  out = {"shared.weight": np.asarray(params["embedding"], np.float32),
         "encoder.final_layer_norm.weight": np.asarray(params["final_norm"], np.float32)}
  for name, stacked in params["layers"].items():
    stacked = np.asarray(stacked, np.float32)
    for i in range(c.num_layers):
      w = stacked[i]
      if name in ("q", "k", "v"):  # [D, N, H] -> [N*H, D]
        w = w.reshape(c.d_model, c.num_heads * c.d_kv).T
      elif name == "o":  # [N, H, D] -> [D, N*H]
        w = w.reshape(c.num_heads * c.d_kv, c.d_model).T
      elif name in ("wi_0", "wi_1", "wo"):
        w = w.T
      out[umt5.block_keys(i)[name]] = w
  return out


def umt5_config_dict(config: umt5.UMT5Config) -> dict[str, Any]:
  """transformers `UMT5Config` JSON for the encoder (the keys `UMT5Config.from_dict` reads, plus
  what transformers needs to build `UMT5EncoderModel`)."""
  return dataclasses.asdict(config) | {
      "model_type": "umt5", "architectures": ["UMT5EncoderModel"], "dense_act_fn": "gelu_new",
      "is_gated_act": True, "is_encoder_decoder": True, "num_decoder_layers": config.num_layers,
      "tie_word_embeddings": False, "scalable_attention": True, "torch_dtype": "float32",
      "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0, "dropout_rate": 0.0,
      "initializer_factor": 1.0, "use_cache": True}


def scheduler_config_dict(config: schedulers.UniPCConfig) -> dict[str, Any]:
  """diffusers `UniPCMultistepScheduler` config in flow mode (what `UniPCConfig.from_config` reads)."""
  return dataclasses.asdict(config) | {
      "_class_name": "UniPCMultistepScheduler", "_diffusers_version": DIFFUSERS_VERSION,
      "disable_corrector": list(config.disable_corrector), "use_flow_sigmas": True,
      "prediction_type": "flow_prediction", "predict_x0": True, "thresholding": False,
      "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
      "use_dynamic_shifting": False, "beta_schedule": "linear", "beta_start": 0.0001,
      "beta_end": 0.02, "timestep_spacing": "linspace", "steps_offset": 0, "rescale_betas_zero_snr": False,
      "sample_max_value": 1.0, "dynamic_thresholding_ratio": 0.995, "trained_betas": None,
      "time_shift_type": "exponential"}


def write_configs(folder: str, *, transformer: Any, vae: Any, text_encoder: umt5.UMT5Config, tokenizer: Any,
                  scheduler_config: Any, expand_timesteps: bool = False) -> None:
  """Every JSON file of a diffusers Wan folder (one expert) and its tokenizer/, beside weights
  written in the component folders (by `save_pipeline` or `convert`)."""
  for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
    os.makedirs(os.path.join(folder, name), exist_ok=True)
  write_json({"_class_name": "WanTransformer3DModel", "_diffusers_version": DIFFUSERS_VERSION,
              "added_kv_proj_dim": None, "image_dim": None, "pos_embed_seq_len": None,
              **transformer.to_dict()}, os.path.join(folder, "transformer", "config.json"))
  vae_config = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(vae).items()}
  write_json({"_class_name": "AutoencoderKLWan", "_diffusers_version": DIFFUSERS_VERSION, **vae_config},
             os.path.join(folder, "vae", "config.json"))
  write_json(umt5_config_dict(text_encoder), os.path.join(folder, "text_encoder", "config.json"))
  tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
  write_json(scheduler_config_dict(scheduler_config), os.path.join(folder, "scheduler", "scheduler_config.json"))
  write_json({"_class_name": "WanPipeline", "_diffusers_version": DIFFUSERS_VERSION,
              "scheduler": ["diffusers", "UniPCMultistepScheduler"],
              "text_encoder": ["transformers", "UMT5EncoderModel"],
              "tokenizer": ["transformers", getattr(tokenizer, "transformers_class", type(tokenizer).__name__)],
              "transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None],
              "vae": ["diffusers", "AutoencoderKLWan"], "boundary_ratio": None, "expand_timesteps": expand_timesteps},
             os.path.join(folder, "model_index.json"))


def save_pipeline(folder: str, *, transformer: WanTransformer,
                  text_encoder: tuple[umt5.UMT5Config, umt5.UMT5Params], vae: wan_vae.WanVAE,
                  tokenizer: Any, scheduler_config: schedulers.UniPCConfig,
                  generation_defaults: GenerationDefaults | None = None) -> str:
  """Writes a diffusers-format Wan 2.1 text-to-video folder (one expert), float32 safetensors.

  Args:
    folder: created if missing; existing component files are overwritten.
    transformer, text_encoder, vae: the models (any dtype; written as float32).
    tokenizer: a transformers tokenizer (its `save_pretrained` writes tokenizer/).
    scheduler_config: the UniPC (flow) settings.
    generation_defaults: the model's own sampling defaults, written as generation_defaults.json
      (None: none written; the folder then keeps diffusers' defaults).

  Returns:
    `folder`.
  """
  for name in ("transformer", "vae", "text_encoder"):
    os.makedirs(os.path.join(folder, name), exist_ok=True)
  _save_tensors(transformer_state_dict(transformer),
                os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors"))
  _save_tensors(vae_state_dict(vae), os.path.join(folder, "vae", "diffusion_pytorch_model.safetensors"))
  te_config, te_params = text_encoder
  _save_tensors(umt5_state_dict(te_config, te_params), os.path.join(folder, "text_encoder", "model.safetensors"))
  write_configs(folder, transformer=transformer.config, vae=vae.config, text_encoder=te_config, tokenizer=tokenizer,
                scheduler_config=scheduler_config)
  if generation_defaults is not None:
    write_json(generation_defaults.to_dict(), os.path.join(folder, generation_defaults_file))
  return folder
