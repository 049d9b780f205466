"""LoRA files: finding and reading them (safetensors only, a file or a folder holding one), with
diffusers' peft `LoraConfig` JSON under the `lora_adapter_metadata` key and a digest of the bytes.

The key layouts are `convert`'s; what the keys mean for the transformer, and the fusing, are
`fuse`'s (the `lora` package names all three's public names). Arrays are numpy on the host: nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipelines.storage import weights

# diffusers' file name for `save_lora_weights` (loaders/lora_base.py LORA_WEIGHT_NAME_SAFE) and its
# safetensors metadata key (LORA_ADAPTER_METADATA_KEY).
LORA_WEIGHT_NAME_SAFE = "pytorch_lora_weights.safetensors"
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"


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


@dataclasses.dataclass(frozen=True)
class LoraSource:
  """A LoRA read once (`load_lora`).

  Attributes:
    state: key -> float32 numpy array.
    metadata: the parsed `lora_adapter_metadata` JSON, or None.
    where: a name for messages (the file, or "the given state dict").
    sha256: `lora_digest` of the source (hex), from the same read of the file.
  """
  state: dict[str, np.ndarray]
  metadata: dict[str, Any] | None
  where: str
  sha256: str


def load_lora(source: str | os.PathLike | Mapping[str, Any], weight_name: str | None = None) -> LoraSource:
  """Reads a LoRA's tensors, its diffusers adapter metadata and its digest in one read of the file:
  the file is opened and memory-mapped once (`weights.map_safetensors_file`), its bytes hashed and
  its tensors converted from the same map (`read_lora` and `lora_digest` together read it twice).

  Args:
    source: a safetensors file, a folder holding one (see `lora_file`), or a state dict of numpy /
      JAX / torch arrays (as diffusers' `load_lora_weights` accepts).
    weight_name: the file's name inside the folder `source` (diffusers' argument).

  Returns:
    `LoraSource` (float32 tensors, metadata or None, name for messages, SHA-256 hex).

  Raises:
    weights.CheckpointError: see `lora_file`; a truncated or corrupt file; metadata that is not
      JSON.
  """
  if isinstance(source, Mapping):
    return LoraSource({str(k): _float32(v) for k, v in source.items()}, None, "the given state dict",
                      lora_digest(source))
  return _read_file(lora_file(source, weight_name), digest=True)


def read_lora(source: str | os.PathLike | Mapping[str, Any], weight_name: str | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any] | None, str]:
  """Reads a LoRA's tensors and its diffusers adapter metadata (`load_lora` without the digest).

  Returns:
    (key -> float32 numpy array, the parsed `lora_adapter_metadata` JSON or None, a name for
    messages).

  Raises:
    as `load_lora`.
  """
  if isinstance(source, Mapping):
    return {str(k): _float32(v) for k, v in source.items()}, None, "the given state dict"
  read = _read_file(lora_file(source, weight_name), digest=False)
  return read.state, read.metadata, read.where


def _read_file(path: str, *, digest: bool) -> LoraSource:
  """One safetensors LoRA file through one memory map: tensors as float32, metadata, and (with
  `digest`) the SHA-256 of the mapped bytes ("" without)."""
  mapped = weights.map_safetensors_file(path)
  sha256 = hashlib.sha256(mapped.buffer).hexdigest() if digest else ""
  state = {key: _float32(ref.array()) for key, ref in mapped.tensors.items()}
  raw = mapped.metadata.get(LORA_ADAPTER_METADATA_KEY)
  try:
    metadata = json.loads(raw) if raw else None
  except json.JSONDecodeError as e:
    raise weights.CheckpointError(f"{path!r}: {LORA_ADAPTER_METADATA_KEY} is not JSON: {e}") from e
  return LoraSource(state, metadata, path, sha256)


def _float32(value: Any) -> np.ndarray:
  if hasattr(value, "detach"):  # torch, without importing it (bf16 has no numpy dtype there)
    value = value.detach().float().cpu().numpy()
  return np.asarray(value, np.float32)


def lora_digest(source: str | os.PathLike | Mapping[str, Any], weight_name: str | None = None) -> str:
  """SHA-256 (hex) of a LoRA: of the safetensors file's bytes, or of a state dict's sorted keys and
  float32 values. For sidecars and the resume identity (a changed file is a different LoRA).

  Raises:
    weights.CheckpointError: see `lora_file`.
  """
  h = hashlib.sha256()
  if isinstance(source, Mapping):
    for key in sorted(map(str, source)):
      value = _float32(source[key])
      h.update(f"{key}:{value.shape}".encode())
      h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()
  return weights.file_sha256(lora_file(source, weight_name))
