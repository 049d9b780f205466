"""Reading diffusers / transformers checkpoint folders with safetensors, and nothing else.

A model folder (`transformer/`, `text_encoder/`, `vae/`) holds `config.json` and either one
`*.safetensors` file or several with a `*.safetensors.index.json` that maps each key to its file.
Pickle formats (`.bin`, `.pt`, `.pth`, `.ckpt`) are refused: unpickling can execute arbitrary code.

Every loader in `pipelines/` goes through `read_config`, `read_safetensors_folder` and
`check_state_dict`, so that missing, unexpected and mis-shaped keys are reported together in one
error instead of one at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
  """A checkpoint folder is missing, unsafe, corrupt or does not fit the model."""


def read_json(path: str, why: str = "") -> dict[str, Any]:
  """Reads one JSON file of a model folder.

  Raises:
    CheckpointError: the file is missing (the message adds `why`) or not valid JSON.
  """
  if not os.path.isfile(path):
    raise CheckpointError(f"{path!r} is missing" + (f"; {why}" if why else ""))
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path!r} is not valid JSON: {e}") from e


def read_config(folder: str) -> dict[str, Any]:
  """Reads `folder/config.json`.

  Raises:
    CheckpointError: the folder or its config.json is missing or not valid JSON.
  """
  if not os.path.isdir(folder):
    raise CheckpointError(f"checkpoint folder {folder!r} does not exist or is not a directory")
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"{folder!r} has no config.json; expected a diffusers/transformers model folder")
  return read_json(path)


def safetensors_files(folder: str) -> list[str]:
  """Lists the safetensors files of a model folder (via the index when there is one).

  Raises:
    CheckpointError: no safetensors file (and a clear note when only pickle files are present),
      or an index that names files that are not there.
  """
  if not os.path.isdir(folder):
    raise CheckpointError(f"checkpoint folder {folder!r} does not exist or is not a directory")
  names = sorted(os.listdir(folder))
  indexes = [n for n in names if n.endswith(".safetensors.index.json")]
  if indexes:
    if len(indexes) > 1:
      raise CheckpointError(f"{folder!r} has several safetensors indexes {indexes}; keep one")
    index_path = os.path.join(folder, indexes[0])
    try:
      with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index_path!r} is not a valid safetensors index: {e!r}") from e
    files = sorted(set(weight_map.values()))
    missing = [n for n in files if not os.path.isfile(os.path.join(folder, n))]
    if missing:
      raise CheckpointError(f"{index_path!r} names files that are missing: {missing}")
    return [os.path.join(folder, n) for n in files]
  files = [n for n in names if n.endswith(".safetensors")]
  if files:
    return [os.path.join(folder, n) for n in files]
  pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
  if pickles:
    raise CheckpointError(
        f"{folder!r} holds only pickle-format weights {pickles}; pickle files can execute code when "
        "loaded, so they are refused. Convert them to safetensors (e.g. diffusers/transformers "
        "`save_pretrained(..., safe_serialization=True)`) and retry.")
  raise CheckpointError(f"{folder!r} has no *.safetensors weights")


def read_safetensors_folder(folder: str) -> dict[str, np.ndarray]:
  """Reads every tensor of a model folder into host numpy arrays (bf16 stays bf16 via ml_dtypes).

  Raises:
    CheckpointError: see `safetensors_files`; a file that is truncated or corrupt; a key that
      appears in two files.
  """
  from safetensors import SafetensorError
  from safetensors.numpy import load_file

  state: dict[str, np.ndarray] = {}
  for path in safetensors_files(folder):
    try:
      tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"cannot read {path!r} (truncated or corrupt safetensors file?): {e}") from e
    dup = sorted(set(tensors) & set(state))
    if dup:
      raise CheckpointError(f"keys {dup[:5]} appear in more than one file of {folder!r}")
    state.update(tensors)
  return state


def check_state_dict(
    state: Mapping[str, Any], expected_shapes: Mapping[str, tuple[int, ...]], *, where: str
) -> None:
  """Raises one CheckpointError listing every missing, unexpected and mis-shaped key.

  Args:
    state: checkpoint key -> array (anything with `.shape`).
    expected_shapes: checkpoint key -> the shape the model needs, in checkpoint layout.
    where: folder or model name, for the message.
  """
  missing = sorted(set(expected_shapes) - set(state))
  unexpected = sorted(set(state) - set(expected_shapes))
  mismatched = sorted(
      f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected_shapes[k])}"
      for k in set(state) & set(expected_shapes)
      if tuple(state[k].shape) != tuple(expected_shapes[k]))
  if missing or unexpected or mismatched:
    parts = []
    if missing:
      parts.append(f"missing keys ({len(missing)}): {missing}")
    if unexpected:
      parts.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
    if mismatched:
      parts.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
    raise CheckpointError(f"checkpoint {where!r} does not fit the model config:\n  " + "\n  ".join(parts))
