"""Writers of the tiny models in the single-file and official layouts (the loaders' key maps inverted),
for the tests of `wan.pretrained` and `pipeline.single_file`."""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from pipelines.wan.encoders import umt5
from pipelines.wan.pretrained import saving
from pipelines.wan.transformer import QUANTIZED_LINEARS, wan_key
from pipelines.wan.vae import original_keys

COMFY_PREFIX = "model.diffusion_model."


def pipeline_states(pipe) -> dict[str, dict[str, np.ndarray]]:
  """The diffusers / transformers state dicts (float32, torch layouts) of a pipeline's components."""
  return {"transformer": saving.transformer_state_dict(nnx.merge(pipe._graphdef, pipe._experts[0])),
          "vae": saving.vae_state_dict(pipe.vae),
          "text_encoder": saving.umt5_state_dict(pipe.text_encoder_config, pipe._text_params)}


def comfy_transformer(state: dict[str, np.ndarray], prefix: str = COMFY_PREFIX) -> dict[str, np.ndarray]:
  return {prefix + wan_key(k): v for k, v in state.items()}


def comfy_vae(state: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
  names = original_keys(config)
  return {names[k]: v for k, v in state.items()}


def official_t5(state: dict[str, np.ndarray], config: umt5.UMT5Config) -> dict[str, np.ndarray]:
  names = umt5.official_keys(config.num_layers)
  return {names[k]: v for k, v in state.items()}


# A scale's shape in a scaled-fp8 file: one value ("[]", ComfyUI's; "[1]") or one per output row.
SCALE_FORMS = ("[]", "[1]", "[out]", "[out, 1]")


def fp8_scaled(value: np.ndarray, form: str = "[]") -> tuple[np.ndarray, np.ndarray]:
  """(float8_e4m3fn q, float32 scale in `form`) of a float32 weight [out, ...]: the scale is absmax / 448
  of the tensor ("[]", "[1]") or of each output row ("[out]", "[out, 1]"), as ComfyUI's quantizers."""
  tiny = np.finfo(np.float32).tiny
  rows = np.abs(value.reshape(len(value), -1)).max(axis=1)
  scale = (np.maximum(rows, tiny) if form in ("[out]", "[out, 1]") else np.float32(max(rows.max(), tiny))) / 448.0
  scale = np.asarray(scale, np.float32)
  q = (value / scale.reshape(-1, *[1] * (value.ndim - 1))).astype(ml_dtypes.float8_e4m3fn)
  return q, scale.reshape({"[]": (), "[1]": (1,), "[out]": (-1,), "[out, 1]": (-1, 1)}[form])


def dequantized(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """q * scale in float32, the scale per output row when it has more than one value (written here
  independently of the loaders)."""
  scale = np.asarray(scale, np.float32)
  per_row = scale.reshape(-1, *[1] * (q.ndim - 1)) if scale.size > 1 else scale.reshape(())
  return q.astype(np.float32) * per_row


def with_fp8_scales(named: dict[str, np.ndarray], quantized, form: str = "[]",
                    suffix: str = "scale_weight") -> dict[str, np.ndarray]:
  """`named` (a file's names) with every weight for which `quantized(name, value)` holds as float8_e4m3fn
  q and its float32 scale of `form` under `X.{suffix}` (ComfyUI: `scale_weight`; newer: `weight_scale`)."""
  out = {}
  for name, value in named.items():
    if quantized(name, value):
      out[name], out[name[:-len("weight")] + suffix] = fp8_scaled(value, form)
    else:
      out[name] = value
  return out


def without_fp8_scales(file_state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A scaled-fp8 file's state dequantized (`dequantized`), its scales and marker dropped: the float32
  file that the scaled one stands for."""
  suffixes = (".scale_weight", ".weight_scale")
  scales = {k.rsplit(".", 1)[0] + ".weight": v for k, v in file_state.items() if k.endswith(suffixes)}
  return {k: dequantized(v, scales[k]) if k in scales else v for k, v in file_state.items()
          if not (k.endswith(suffixes) or k.endswith("scaled_fp8"))}


def scaled_fp8(state: dict[str, np.ndarray], prefix: str = COMFY_PREFIX, form: str = "[]",
               suffix: str = "scale_weight") -> dict[str, np.ndarray]:
  """ComfyUI's scaled fp8 of a diffusers-named transformer state, in Wan names: every block Linear
  weight as float8_e4m3fn q with a float32 scale (`fp8_scaled`: per tensor by default, as ComfyUI's
  files), the rest as it is, and the `scaled_fp8` marker."""
  linears = {".".join(p) for p in QUANTIZED_LINEARS}
  diffusers = {"attn1.to_q": "attn1.to_q", "attn1.to_k": "attn1.to_k", "attn1.to_v": "attn1.to_v",
               "attn1.to_out": "attn1.to_out.0", "attn2.to_q": "attn2.to_q", "attn2.to_k": "attn2.to_k",
               "attn2.to_v": "attn2.to_v", "attn2.to_out": "attn2.to_out.0", "ffn.proj_in": "ffn.net.0.proj",
               "ffn.proj_out": "ffn.net.2"}
  modules = {diffusers[n] for n in linears}
  names = {prefix + wan_key(key): key for key in state}

  def quantized(name: str, _) -> bool:
    key = names[name]
    inner = key.split(".", 2)[2] if key.startswith("blocks.") else ""
    return inner.endswith(".weight") and inner[:-len(".weight")] in modules

  out = {prefix + "scaled_fp8": np.zeros(0, ml_dtypes.float8_e4m3fn)}
  return out | with_fp8_scales({prefix + wan_key(k): v for k, v in state.items()}, quantized, form, suffix)


def scaled_fp8_umt5(state: dict[str, np.ndarray], form: str = "[]",
                    suffix: str = "scale_weight") -> dict[str, np.ndarray]:
  """A UMT5 encoder's transformers-named state with its Linear weights and the embedding in scaled fp8."""
  linear = re.compile(r"\.(q|k|v|o|wi_0|wi_1|wo)\.weight$")
  return with_fp8_scales(state, lambda name, _: name == "shared.weight" or bool(linear.search(name)), form, suffix)


def scaled_fp8_vae(state: dict[str, np.ndarray], config, form: str = "[]",
                   suffix: str = "scale_weight") -> dict[str, np.ndarray]:
  """A VAE's diffusers-named state in original Wan names, its conv weights in scaled fp8."""
  return with_fp8_scales(comfy_vae(state, config), lambda name, v: name.endswith(".weight") and v.ndim >= 4,
                         form, suffix)


def write(state: dict[str, np.ndarray], path: str) -> str:
  save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, path)
  return path


def write_single_files(pipe, base: str) -> dict:
  """`pipe` as a diffusers folder and as ComfyUI single files under `base`: {"folder", "transformer",
  "vae", "text_encoder", "states"} (paths; the float32 state dicts)."""
  folder = saving.save_pipeline(os.path.join(base, "folder"), transformer=nnx.merge(pipe._graphdef, pipe._experts[0]),
                                text_encoder=(pipe.text_encoder_config, pipe._text_params), vae=pipe.vae,
                                tokenizer=pipe.tokenizer, scheduler_config=pipe.scheduler_config)
  states = pipeline_states(pipe)
  return dict(folder=folder, states=states,
              transformer=write(comfy_transformer(states["transformer"]), os.path.join(base, "t.safetensors")),
              vae=write(comfy_vae(states["vae"], pipe.vae.config), os.path.join(base, "v.safetensors")),
              text_encoder=write(states["text_encoder"], os.path.join(base, "umt5.safetensors")))


def write_official(pipe, folder: str, tokenizer_folder: str) -> str:
  """The official Wan layout of `pipe` (the .pth parts with torch.save)."""
  import shutil

  import torch

  states = pipeline_states(pipe)
  os.makedirs(folder)
  c = pipe.transformer_config
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"_class_name": "WanModel", "dim": c.dim, "num_heads": c.num_attention_heads, "num_layers": c.num_layers,
               "ffn_dim": c.ffn_dim, "freq_dim": c.freq_dim, "in_dim": c.in_channels, "out_dim": c.out_channels,
               "eps": c.eps, "model_type": "t2v", "text_len": 512}, f)
  write({wan_key(k): v for k, v in states["transformer"].items()},
        os.path.join(folder, "diffusion_pytorch_model.safetensors"))
  torch.save({k: torch.from_numpy(np.array(v)) for k, v in
              comfy_vae(states["vae"], pipe.vae.config).items()}, os.path.join(folder, "Wan2.1_VAE.pth"))
  torch.save({k: torch.from_numpy(np.array(v)) for k, v in
              official_t5(states["text_encoder"], pipe.text_encoder_config).items()},
             os.path.join(folder, "models_t5_umt5-xxl-enc-bf16.pth"))
  shutil.copytree(tokenizer_folder, os.path.join(folder, "google", "umt5-xxl"))
  return folder
