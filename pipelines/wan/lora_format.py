"""LoRA files: finding and reading them, and the original Wan key format converted to diffusers'.

Formats (safetensors only, a file or a folder holding one): diffusers / peft keys
(`transformer.blocks.{i}.attn1.to_q.lora_A.weight`, peft `LoraConfig` JSON under the
`lora_adapter_metadata` key), and the original Wan format (`diffusion_model.blocks.{i}.self_attn.q.
lora_down.weight`, `.alpha`), converted as diffusers' `_convert_non_diffusers_wan_lora_to_diffusers`
does. What the keys mean for the transformer, and the fusing, are in `lora`, which re-exports these
names. Arrays are numpy on the host: nothing here touches a device.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipelines.storage import weights

# diffusers' file name for `save_lora_weights` (loaders/lora_base.py LORA_WEIGHT_NAME_SAFE) and its
# safetensors metadata key (LORA_ADAPTER_METADATA_KEY).
LORA_WEIGHT_NAME_SAFE = "pytorch_lora_weights.safetensors"
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"
TRANSFORMER_PREFIX = "transformer."
WAN_PREFIX = "diffusion_model."


# --- reading ---------------------------------------------------------------------------------------

def lora_file(path: str | os.PathLike, weight_name: str | None = None) -> str:
  """The safetensors file of a LoRA: `path` itself, or the one in a folder.

  A folder must hold `weight_name` when given (diffusers' argument), else
  `pytorch_lora_weights.safetensors` (diffusers' name) or exactly one `*.safetensors` file.

  Raises:
    weights.CheckpointError: no such file or folder, a pickle-format file (`.bin`, `.pt`, ...;
      unpickling can execute code), not a `.safetensors` file, or a folder holding none or several.
  """
  path = os.fspath(path)
  if weight_name is not None:
    if not os.path.isdir(path):
      raise weights.CheckpointError(f"weight_name={weight_name!r} needs a folder, but {path!r} is not one")
    path = os.path.join(path, weight_name)
  if os.path.isdir(path):
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if LORA_WEIGHT_NAME_SAFE in names:
      return os.path.join(path, LORA_WEIGHT_NAME_SAFE)
    if len(names) == 1:
      return os.path.join(path, names[0])
    if names:
      raise weights.CheckpointError(
          f"LoRA folder {path!r} holds several safetensors files {names}; pass the file itself or "
          "weight_name=")
    pickles = [n for n in sorted(os.listdir(path)) if n.endswith(weights.PICKLE_SUFFIXES)]
    note = (f" (only pickle files {pickles}, refused: unpickling can execute code; convert them to "
            "safetensors)") if pickles else ""
    raise weights.CheckpointError(f"LoRA folder {path!r} has no *.safetensors file{note}")
  if not os.path.isfile(path):
    raise weights.CheckpointError(f"LoRA weights {path!r}: no such file or folder")
  if path.endswith(weights.PICKLE_SUFFIXES):
    raise weights.CheckpointError(
        f"LoRA weights {path!r} are a pickle file, refused (unpickling can execute code); convert "
        "them to safetensors")
  if not path.endswith(".safetensors"):
    raise weights.CheckpointError(f"LoRA weights {path!r} must be a .safetensors file")
  return path


def read_lora(source: str | os.PathLike | Mapping[str, Any], weight_name: str | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any] | None, str]:
  """Reads a LoRA's tensors and its diffusers adapter metadata.

  Args:
    source: a safetensors file, a folder holding one (see `lora_file`), or a state dict of numpy /
      JAX / torch arrays (as diffusers' `load_lora_weights` accepts).
    weight_name: the file's name inside the folder `source` (diffusers' argument).

  Returns:
    (key -> float32 numpy array, the parsed `lora_adapter_metadata` JSON or None, a name for
    messages).

  Raises:
    weights.CheckpointError: see `lora_file`; a truncated or corrupt file; metadata that is not
      JSON.
  """
  if isinstance(source, Mapping):
    return {str(k): _float32(v) for k, v in source.items()}, None, "the given state dict"
  from safetensors import SafetensorError, safe_open

  path = lora_file(source, weight_name)
  state = {}
  try:
    with safe_open(path, framework="numpy") as f:
      header = f.metadata() or {}
      for key in f.keys():
        state[key] = _float32(f.get_tensor(key))
  except (SafetensorError, OSError, ValueError) as e:
    raise weights.CheckpointError(f"cannot read LoRA {path!r} (truncated or corrupt?): {e}") from e
  raw = header.get(LORA_ADAPTER_METADATA_KEY)
  try:
    metadata = json.loads(raw) if raw else None
  except json.JSONDecodeError as e:
    raise weights.CheckpointError(f"{path!r}: {LORA_ADAPTER_METADATA_KEY} is not JSON: {e}") from e
  return state, metadata, path


def _float32(value: Any) -> np.ndarray:
  if hasattr(value, "detach"):  # torch, without importing it (bf16 has no numpy dtype there)
    value = value.detach().float().cpu().numpy()
  return np.asarray(value, np.float32)


# --- the original Wan format -> diffusers --------------------------------------------------------

def _alpha_scales(rank: int, alpha: float) -> tuple[float, float]:
  """diffusers' `get_alpha_scales`: alpha / rank split into (down, up) factors, powers of two moved
  from up to down until down * 2 >= up."""
  scale_down, scale_up = alpha / rank, 1.0
  while scale_down * 2 < scale_up:
    scale_down *= 2
    scale_up /= 2
  return scale_down, scale_up


def convert_wan_to_diffusers(state: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
  """The original Wan key format (`diffusion_model.*`) as diffusers' keys (`transformer.*`).

  A numpy port of diffusers' `_convert_non_diffusers_wan_lora_to_diffusers` for the text-to-video
  layers: blocks' self_attn / cross_attn q, k, v, o -> attn1 / attn2 to_q, to_k, to_v, to_out.0;
  ffn.0 / ffn.2 -> ffn.net.0.proj / ffn.net.2; time_projection.1 -> condition_embedder.time_proj;
  head.head -> proj_out; {text,time}_embedding.{0,2} -> condition_embedder.{text,time}_embedder.
  linear_{1,2}. `lora_down`/`lora_A` -> lora_A, `lora_up`/`lora_B` -> lora_B, `diff_b` ->
  lora_B.bias; `alpha` folds alpha / rank into lora_A and lora_B (scaling 1 afterwards); a
  `head.head.diff` full delta becomes lora_A with an identity lora_B. Norm `.diff` / `.diff_b` keys
  are dropped (diffusers: they are zeros), as are time_projection bias deltas without a weight.

  Returns:
    (converted state, the keys left unconverted: image-to-video layers, unknown names, other
    `.diff` full deltas; the caller refuses or warns).
  """
  rest = {k.removeprefix(WAN_PREFIX): v for k, v in state.items()}
  down_name = "lora_A" if any("lora_A" in k for k in rest) else "lora_down"
  up_name = "lora_B" if any("lora_B" in k for k in rest) else "lora_up"
  out: dict[str, np.ndarray] = {}
  has_time_weight = any(k.startswith("time_projection") and k.endswith(".weight") for k in rest)
  for key in list(rest):
    if (key.endswith((".diff", ".diff_b")) and "norm" in key) or (
        "time_projection" in key and not has_time_weight):
      rest.pop(key)

  def move(theirs: str, ours: str, alpha: bool = True) -> None:
    down_key, up_key = f"{theirs}.{down_name}.weight", f"{theirs}.{up_name}.weight"
    if down_key in rest:
      out[f"{ours}.lora_A.weight"] = rest.pop(down_key)
    if up_key in rest:
      out[f"{ours}.lora_B.weight"] = rest.pop(up_key)
    if alpha and f"{theirs}.alpha" in rest and f"{ours}.lora_A.weight" in out:
      scale_down, scale_up = _alpha_scales(out[f"{ours}.lora_A.weight"].shape[0],
                                           float(rest.pop(f"{theirs}.alpha").reshape(-1)[0]))
      out[f"{ours}.lora_A.weight"] = out[f"{ours}.lora_A.weight"] * np.float32(scale_down)
      if f"{ours}.lora_B.weight" in out:
        out[f"{ours}.lora_B.weight"] = out[f"{ours}.lora_B.weight"] * np.float32(scale_up)
    if f"{theirs}.diff_b" in rest:
      out[f"{ours}.lora_B.bias"] = rest.pop(f"{theirs}.diff_b")

  blocks = sorted({int(k.split(".")[1]) for k in rest if re.match(r"blocks\.\d+\.", k)})
  for i in blocks:
    for theirs, ours in (("self_attn", "attn1"), ("cross_attn", "attn2")):
      for o, c in zip(("q", "k", "v", "o"), ("to_q", "to_k", "to_v", "to_out.0")):
        move(f"blocks.{i}.{theirs}.{o}", f"blocks.{i}.{ours}.{c}")
    for o, c in (("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2")):
      move(f"blocks.{i}.{o}", f"blocks.{i}.{c}")
  # diffusers converts these without alpha handling (an alpha here is left over, so refused).
  move("time_projection.1", "condition_embedder.time_proj", alpha=False)
  move("head.head", "proj_out", alpha=False)
  if "head.head.diff" in rest:  # lightx2v distill LoRAs: a full delta, identity up
    diff = rest.pop("head.head.diff")
    out["proj_out.lora_A.weight"] = diff
    out["proj_out.lora_B.weight"] = np.eye(diff.shape[0], dtype=np.float32)
  for theirs, ours in (("text_embedding", "text_embedder"), ("time_embedding", "time_embedder")):
    for b, c in ((0, 1), (2, 2)):
      move(f"{theirs}.{b}", f"condition_embedder.{ours}.linear_{c}", alpha=False)
  left = sorted(WAN_PREFIX + k for k in rest)
  return {TRANSFORMER_PREFIX + k: v for k, v in out.items()}, left
