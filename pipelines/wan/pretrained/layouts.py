"""Which layout a weight file or a model folder is in: the one place that tells them apart.

Single files (`read_component`), by their key names, as diffusers' `infer_diffusers_model_type`
and ComfyUI's `model_detection` tell them apart:
- transformer: original Wan / ComfyUI names (`blocks.N.self_attn.q.weight`, `head.modulation`),
  with or without ComfyUI's `model.diffusion_model.` prefix (`original_names`), or diffusers'; a
  causal generator's training checkpoint (Self-Forcing, CausVid: `generator_ema` / `generator`,
  each key under `model.`; `weights.training_weights`);
- VAE: original Wan names (`encoder.conv1`, `decoder.middle.0.residual.0.gamma`; Wan 2.1 and 2.2,
  `vae.original_names`) or diffusers';
- text encoder: transformers' UMT5 names (`encoder.block.N.layer.0.SelfAttention.q.weight`, as
  ComfyUI stores `umt5_xxl_*.safetensors`) or Wan's own T5 names (`blocks.N.attn.q.weight`,
  `models_t5_umt5-xxl-enc-bf16.pth`; `umt5.official_keys`).
Files of other models (Flux, Stable Diffusion, a LoRA, ...) are named as such.

ComfyUI's "scaled" fp8 files (`comfy/ops.py`, `scaled_fp8` marker key): float8_e4m3fn weights, each
with a float32 `scale_weight` (newer files: `weight_scale`) of one value ([] or [1]: ComfyUI's) or one
per output row ([out] or [out, 1]: per-channel files); the weight is q * scale, row by row. The
scales are returned beside the tensors (`ComponentFile.scales`, broadcast to the weight's shape), the
fp8 tensors themselves stay memory-mapped; `scale_input` (activation scales) is not used.

Folders (`folder_layout`): a diffusers pipeline folder (model_index.json) or the official Wan
layout (`config.json` with Wan's own fields `dim`, `num_layers`, `model_type`, original-named
`diffusion_pytorch_model*.safetensors`, `Wan2.1_VAE.pth`, `models_t5_umt5-xxl-enc-bf16.pth`,
`google/umt5-xxl/`). No JAX.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipelines.storage import weights
from pipelines.wan.pretrained import inference
from pipelines.wan.transformer import original_names as transformer_names
from pipelines.wan.vae import original_names as vae_names

# ComfyUI's prefixes, and the `model.` of the generators of Self-Forcing's `WanDiffusionWrapper` (CausVid's alike).
COMFY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
DROPPED = ("scaled_fp8", ".scale_input", ".input_scale", "spiece_model")  # markers and unused activation scales
# (a key that shows a model, what to call it) for files of other models.
FOREIGN = (("double_blocks.", "a Flux / HunyuanVideo transformer"), ("input_blocks.", "a Stable Diffusion UNet"),
           ("joint_blocks.", "a Stable Diffusion 3 transformer"), ("lora_down", "a LoRA"), ("lora_A", "a LoRA"),
           ("transformer_blocks.", "a diffusers transformer of another model"),
           ("vision_model.", "a CLIP vision model"), ("visual.", "an open-clip model"))
KINDS = {"transformer": "the transformer", "vae": "the VAE", "text_encoder": "the text encoder"}
# What to pass for each kind, in the messages that refuse a file.
EXPECTED_FILES = {"transformer": "a Wan 2.1 / 2.2 diffusion model file (ComfyUI's models/diffusion_models/)",
                  "vae": "a Wan VAE file (wan_2.1_vae.safetensors or wan2.2_vae.safetensors)",
                  "text_encoder": "a UMT5-XXL encoder file (umt5_xxl_*.safetensors)"}


@dataclasses.dataclass(frozen=True)
class ComponentFile:
  """One component's tensors under the names our loaders read, still memory-mapped.

  Attributes:
    path: the file.
    kind: "transformer", "vae" or "text_encoder".
    layout: "wan" (original names), "diffusers", "transformers" (UMT5) or "wan-t5".
    tensors: loader key (diffusers' / transformers') -> tensor (`weights.TensorRef` or a numpy view).
    scales: loader key -> the scale of a scaled-fp8 weight (`row_scales`: float32, broadcast to the
      weight's checkpoint shape, a read-only view without copies; empty for other files). A reader
      lays it out as it lays out the weight (the same transposes and reshapes) and multiplies.
  """
  path: str
  kind: str
  layout: str
  tensors: dict[str, Any]
  scales: dict[str, np.ndarray]

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in self.tensors.items()}

  @property
  def fp8_scaled(self) -> bool:
    return bool(self.scales)


def open_file(path: str, kind: str) -> dict[str, Any]:
  """Every tensor of one weight file, memory-mapped (safetensors; `.pth` through torch).

  Raises:
    CheckpointError: a missing, truncated or unreadable file, named with the fix.
  """
  if not os.path.isfile(path):
    raise weights.CheckpointError(f"{kind}={path!r} does not exist; pass {EXPECTED_FILES[kind]}")
  if path.endswith(weights.PICKLE_SUFFIXES):
    return weights.open_torch_file(path)
  try:
    return weights.open_safetensors_file(path)
  except weights.CheckpointError as e:
    raise weights.CheckpointError(f"{kind}=: {e}; download it again (or convert it again)") from e


def _what(keys: list[str]) -> tuple[str, str] | None:
  """(kind, layout) of a key list, None when no Wan component's keys are there."""
  key_set = set(keys)
  if "head.modulation" in key_set or "blocks.0.self_attn.q.weight" in key_set:
    return "transformer", "wan"
  if "condition_embedder.time_proj.weight" in key_set:
    return "transformer", "diffusers"
  if "decoder.middle.0.residual.0.gamma" in key_set:
    return "vae", "wan"
  if "decoder.mid_block.resnets.0.norm1.gamma" in key_set:
    return "vae", "diffusers"
  if "encoder.block.0.layer.0.SelfAttention.q.weight" in key_set:
    return "text_encoder", "transformers"
  if "token_embedding.weight" in key_set and "blocks.0.attn.q.weight" in key_set:
    return "text_encoder", "wan-t5"
  return None


def _strip(raw: Mapping[str, Any]) -> dict[str, Any]:
  prefix = next((p for p in COMFY_PREFIXES if any(k.startswith(p + "patch_embedding") for k in raw)), None)
  return {k.removeprefix(prefix): v for k, v in raw.items()} if prefix else dict(raw)


def _check_kind(path: str, kind: str, found: tuple[str, str] | None, keys: list[str]) -> None:
  if found is not None and found[0] == kind:
    return
  if found is not None:
    what = f"{KINDS[found[0]]} of a Wan pipeline"
    fix = f"pass it as {found[0]}= (--{found[0].replace('_', '-')}) and here {EXPECTED_FILES[kind]}"
  else:
    hits = [(key, name) for marker, name in FOREIGN for key in keys if marker in key]
    what = (f"{hits[0][1]} (keys like {hits[0][0]!r})" if hits
            else f"no Wan component (keys like {sorted(keys)[:3]})")
    fix = f"pass {EXPECTED_FILES[kind]}"
  raise weights.CheckpointError(f"{kind}={path!r} holds {what}, not {KINDS[kind]} of a Wan model; {fix}")


def row_scales(key: str, scale: Any, weight_shape: tuple[int, ...] | None, where: str = "") -> np.ndarray:
  """A scaled-fp8 weight's scale as float32 broadcast to `weight_shape`: one value ([] or [1]) for every
  element, or one per output row ([out] or [out, 1]: weight[i, ...] = q[i, ...] * scale[i]).

  Args:
    key: the scale's key (without ComfyUI's prefix), for the message.
    scale: the scale tensor (any float dtype).
    weight_shape: the shape of the weight it scales (None: the file has no such weight).
    where: the file, for the message.

  Raises:
    CheckpointError (a ValueError): no weight, or a scale of any other shape; named with both shapes.
  """
  scale = np.asarray(scale, np.float32)
  if weight_shape is None:
    weight = key.rsplit(".", 1)[0] + ".weight"
    raise weights.CheckpointError(f"{where!r}: scale {key!r} has no weight {weight!r} beside it; the file is "
                                  "incomplete: download or convert it again")
  rows = weight_shape[0] if weight_shape else 1
  if scale.shape in ((), (1,)):
    per_row = scale.reshape(())
  elif weight_shape and scale.shape in ((rows,), (rows, 1)):
    per_row = scale.reshape(rows, *[1] * (len(weight_shape) - 1))
  else:
    raise weights.CheckpointError(
        f"{where!r}: scale {key!r} has the shape {scale.shape} and its weight's shape is {tuple(weight_shape)}: "
        f"a scale is one value ([] or [1]) or one per output row ([{rows}] or [{rows}, 1]); other scales (per "
        "block, per input channel) are not read here: pass a file with per-tensor or per-channel scales, or its "
        "bf16 / fp16 weights")
  return np.broadcast_to(per_row, tuple(weight_shape))


def _split_scales(raw: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(the tensors without markers and scales, weight key -> its scale broadcast to it: `row_scales`)."""
  tensors, scales = {}, {}
  for key, value in raw.items():
    if key.endswith(SCALE_SUFFIXES):
      weight = key.rsplit(".", 1)[0] + ".weight"
      scales[weight] = row_scales(key, value, tuple(raw[weight].shape) if weight in raw else None, where)
    elif not (key in DROPPED or key.endswith(DROPPED)):
      tensors[key] = value
  return tensors, scales


def read_component(path: str, kind: str, vae_config: Any = None) -> ComponentFile:
  """Opens one component file and renames its keys to the loader's (module docstring).

  Args:
    path: the file (.safetensors; .pth / .pt through torch).
    kind: what the caller wants from it: "transformer", "vae" or "text_encoder".
    vae_config: the `WanVAEConfig` when known (else inferred from the shapes: `inference.vae_config`).

  Raises:
    CheckpointError: missing, truncated or foreign files, named with the fix.
  """
  tensors, scales = _split_scales(_strip(open_file(path, kind)), path)
  keys = sorted(tensors)
  found = _what(keys)
  _check_kind(path, kind, found, keys)
  layout = found[1]
  rename = _renamer(kind, layout, {k: tuple(v.shape) for k, v in tensors.items()}, path, vae_config)
  out = {rename(k) or k: v for k, v in tensors.items()}
  return ComponentFile(path, kind, layout, out, {rename(k) or k: s for k, s in scales.items()})


def _renamer(kind: str, layout: str, shapes: dict[str, tuple[int, ...]], path: str, vae_config: Any):
  """key -> loader key (None: kept as it is, for the loader's check to report)."""
  if layout in ("diffusers", "transformers"):
    return lambda key: key
  if kind == "transformer":
    return transformer_names.diffusers_key
  if kind == "vae":
    if vae_config is None:
      vae_config = inference.vae_config({d: s for k, s in shapes.items() if (d := vae_names.encoder_key(k))}
                                        | _decoder_out(shapes), path)
    return {o: d for d, o in vae_names.original_keys(vae_config).items()}.get
  from pipelines.wan.encoders import umt5  # here: the module imports JAX, this one does not

  layers = 1 + max(int(m[1]) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k)))
  return {o: d for d, o in umt5.official_keys(layers).items()}.get


def _decoder_out(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
  return {"decoder.conv_out.weight": shapes["decoder.head.2.weight"]} if "decoder.head.2.weight" in shapes else {}


# --- folders ----------------------------------------------------------------------------------------

OFFICIAL_VAES = ("Wan2.1_VAE.pth", "Wan2.2_VAE.pth", "Wan2.1_VAE.safetensors", "Wan2.2_VAE.safetensors")
OFFICIAL_T5 = "models_t5_umt5-xxl-enc-bf16.pth"
OFFICIAL_TOKENIZER = os.path.join("google", "umt5-xxl")


def folder_layout(folder: str) -> str:
  """"diffusers" (model_index.json; also anything else, for `PipelineIndex.read` to refuse with its
  message) or "official" (Wan's own layout: a top config.json with Wan's `dim` and `model_type`)."""
  config = os.path.join(folder, "config.json")
  if os.path.isfile(os.path.join(folder, "model_index.json")) or not os.path.isfile(config):
    return "diffusers"
  raw = weights.read_json(config)
  return "official" if {"dim", "num_layers", "model_type"} <= set(raw) else "diffusers"


@dataclasses.dataclass(frozen=True)
class OfficialFolder:
  """A folder in the official Wan layout, its files found (nothing read but config.json).

  Attributes:
    folder: the folder.
    config: its config.json (Wan's `WanModel` fields: dim, num_heads, num_layers, model_type, ...).
    vae: the VAE file. text_encoder: the T5 file. tokenizer: the tokenizer folder.
  """
  folder: str
  config: dict[str, Any]
  vae: str
  text_encoder: str
  tokenizer: str

  @classmethod
  def read(cls, folder: str) -> OfficialFolder:
    """Raises:
      CheckpointError: a missing component file, a model type this layout does not load here.
    """
    config = weights.read_json(os.path.join(folder, "config.json"))
    if config.get("model_type") not in ("t2v", "ti2v", "vace"):
      raise weights.CheckpointError(
          f"{folder!r}: model_type={config.get('model_type')!r}; the official layout loads t2v, ti2v and vace "
          "models here (image-to-video needs its CLIP in diffusers' layout): convert the folder with diffusers' "
          "scripts/convert_wan_to_diffusers.py")
    vae = next((os.path.join(folder, n) for n in OFFICIAL_VAES if os.path.isfile(os.path.join(folder, n))), None)
    found = {"the VAE file (" + " or ".join(OFFICIAL_VAES[:2]) + ")": vae,
             f"the text encoder file {OFFICIAL_T5}": os.path.join(folder, OFFICIAL_T5),
             f"the tokenizer folder {OFFICIAL_TOKENIZER}/": os.path.join(folder, OFFICIAL_TOKENIZER)}
    for what, path in found.items():
      if path is None or not os.path.exists(path):
        raise weights.CheckpointError(f"{folder!r} (official Wan layout) is missing {what}; download it next to "
                                      "config.json as the official release holds it")
    return cls(folder, config, vae, found[f"the text encoder file {OFFICIAL_T5}"],
               found[f"the tokenizer folder {OFFICIAL_TOKENIZER}/"])

  @staticmethod
  def transformer_of(folder: str) -> ComponentFile:
    """The transformer's tensors of an official folder (every `*.safetensors`, an index's shards too)."""
    tensors, scales = _split_scales(_strip(weights.open_safetensors_folder(folder)), folder)
    _check_kind(folder, "transformer", _what(sorted(tensors)), sorted(tensors))
    return ComponentFile(folder, "transformer", "wan",
                         {transformer_names.diffusers_key(k) or k: v for k, v in tensors.items()},
                         {transformer_names.diffusers_key(k) or k: s for k, s in scales.items()})

  def heads(self) -> int:
    return int(self.config["num_heads"])
