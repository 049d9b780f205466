"""Reading diffusers / transformers checkpoint folders with safetensors, and nothing else.

A model folder (`transformer/`, `text_encoder/`, `vae/`) holds `config.json` and either one
`*.safetensors` file or several with a `*.safetensors.index.json` that maps each key to its file.
Pickle formats (`.bin`, `.pt`, `.pth`, `.ckpt`) are refused: unpickling can execute arbitrary code.

Every loader in `pipelines/` goes through `read_config`, `read_safetensors_folder` and
`check_state_dict`, so that missing, unexpected and mis-shaped keys are reported together in one
error instead of one at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
  """A checkpoint folder is missing, unsafe, corrupt or does not fit the model."""


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
  """SHA-256 (hex) of a file's bytes, read in `chunk`-byte pieces (1 MiB: constant memory for any
  size). Reads the whole file: a 28 GB transformer takes minutes on a slow disk, so a caller hashes a
  file once and keeps the digest (`generate`'s run record keeps it with the file's size and mtime)."""
  import hashlib

  h = hashlib.sha256()
  with open(path, "rb") as f:
    for piece in iter(lambda: f.read(chunk), b""):
      h.update(piece)
  return h.hexdigest()


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


# safetensors dtype names (https://github.com/huggingface/safetensors, format spec) -> numpy.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclasses.dataclass(frozen=True)
class TensorRef:
  """One tensor of a safetensors file, memory-mapped and not read until used.

  Attributes:
    path: the file.
    key: its name in the file.
    shape: its shape.
    dtype: its numpy dtype (bfloat16 / float8 via ml_dtypes).
    buffer: the file's read-only memory map.
    offset: the tensor's first byte in the file.
  """
  path: str
  key: str
  shape: tuple[int, ...]
  dtype: np.dtype
  buffer: Any = dataclasses.field(repr=False, compare=False)
  offset: int = 0

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def array(self) -> np.ndarray:
    """A read-only numpy view of the mapped file (no copy; pages are read when touched)."""
    count = int(np.prod(self.shape, dtype=np.int64))
    return np.frombuffer(self.buffer, self.dtype, count, self.offset).reshape(self.shape)

  def __array__(self, dtype=None, copy=None):
    array = self.array()
    return array if dtype is None else array.astype(dtype)


def open_safetensors_file(path: str) -> dict[str, TensorRef]:
  """Memory-maps one safetensors file and lists its tensors without reading their data
  (`map_safetensors_file` without the metadata and the map)."""
  return map_safetensors_file(path).tensors


@dataclasses.dataclass(frozen=True)
class MappedSafetensors:
  """One safetensors file mapped into memory once (`map_safetensors_file`).

  Attributes:
    tensors: key -> `TensorRef` (views of `buffer`, read when used).
    metadata: the header's `__metadata__` (str -> str; empty when absent).
    buffer: the whole file's read-only memory map (header included), e.g. to hash its bytes in the
      same pass that reads them.
  """
  tensors: dict[str, TensorRef]
  metadata: dict[str, str]
  buffer: Any = dataclasses.field(repr=False, compare=False)


def map_safetensors_file(path: str) -> MappedSafetensors:
  """Memory-maps one safetensors file (one open, one map) and lists its tensors without reading their data.

  The format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
  {key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data,
  offsets relative to its start. Checked here as the reference reader does: every tensor's byte
  range matches its shape and dtype and lies inside the file, and the ranges tile the data section.

  Raises:
    CheckpointError: unreadable, truncated or corrupt file, or a dtype numpy cannot hold.
  """
  import mmap

  import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy)

  def bad(why: str) -> CheckpointError:
    return CheckpointError(f"cannot read {path!r} (truncated or corrupt safetensors file?): {why}")

  try:
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      if size < 8:
        raise bad(f"{size} bytes")
      header_len = int.from_bytes(f.read(8), "little")
      if header_len > size - 8:
        raise bad(f"header of {header_len} bytes in a file of {size}")
      header = json.loads(f.read(header_len))
      buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  except (OSError, ValueError, UnicodeDecodeError) as e:
    raise bad(repr(e)) from e
  if not isinstance(header, dict):
    raise bad("the header is not a JSON object")
  metadata = header.get("__metadata__") or {}
  if not isinstance(metadata, dict):
    raise bad("__metadata__ is not a JSON object")
  start = 8 + header_len
  refs: dict[str, TensorRef] = {}
  spans = []
  for key, info in header.items():
    if key == "__metadata__":
      continue
    try:
      name = _SAFETENSORS_DTYPES[info["dtype"]]
      dtype = np.dtype(getattr(ml_dtypes, name) if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
                       else name)
      shape = tuple(int(d) for d in info["shape"])
      begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
      raise bad(f"tensor {key!r} has a bad header entry {info!r}") from e
    ref = TensorRef(path, key, shape, dtype, buffer, start + begin)
    if end - begin != ref.nbytes or begin < 0 or start + end > size:
      raise bad(f"tensor {key!r} {shape} {info['dtype']} has bytes [{begin}, {end}) of a "
                f"{size - start}-byte data section")
    spans.append((begin, end))
    refs[key] = ref
  spans.sort()
  if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (spans and spans[0][0] != 0):
    raise bad("tensor byte ranges overlap or leave gaps")
  return MappedSafetensors(tensors=refs, metadata=metadata, buffer=buffer)


# Where training checkpoints keep the weights to run, first found first: Lightning's `state_dict`,
# and the generator of Self-Forcing / CausVid / Causal-Forcing (`generator_ema`, its EMA, as their
# `inference.py --use_ema` reads it; else `generator`).
TRAINING_WRAPPERS = ("state_dict", "generator_ema", "generator")


def training_weights(state: dict) -> dict:
  """The weights inside a training checkpoint's dict (`TRAINING_WRAPPERS`), else `state` itself."""
  return next((state[key] for key in TRAINING_WRAPPERS if isinstance(state.get(key), dict)), state)


def open_torch_file(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a PyTorch `.pth` / `.pt` file (the official Wan release's VAE and T5; a training
  checkpoint's weights, `training_weights`) as numpy views of the memory-mapped file:
  `torch.load(weights_only=True, mmap=True)` (weights only: no code runs).

  Raises:
    CheckpointError: torch is not installed (naming the fixes), or the file cannot be read.
  """
  try:
    import torch
  except ImportError as e:
    raise CheckpointError(
        f"{path!r} is a PyTorch file; reading it needs torch (`pip install torch`), or convert the folder once "
        "where torch is installed: `python -m pipelines.wan.pretrained.convert SRC DST`") from e
  import ml_dtypes

  try:
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
  except Exception as e:  # noqa: BLE001 (torch raises many kinds for a bad file)
    raise CheckpointError(f"cannot read {path!r} (truncated or corrupt PyTorch file?): {e!r}; download it again") from e
  state = training_weights(state) if isinstance(state, dict) else state
  out = {}
  for key, tensor in state.items():
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: the same bytes, viewed
      out[key] = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
      out[key] = tensor.numpy()
  return out


def open_safetensors_folder(folder: str) -> dict[str, TensorRef]:
  """Every tensor of a model folder, memory-mapped (`open_safetensors_file`), none read yet.

  Raises:
    CheckpointError: see `safetensors_files` and `open_safetensors_file`; a key that appears in
      two files.
  """
  state: dict[str, TensorRef] = {}
  for path in safetensors_files(folder):
    refs = open_safetensors_file(path)
    dup = sorted(set(refs) & set(state))
    if dup:
      raise CheckpointError(f"keys {dup[:5]} appear in more than one file of {folder!r}")
    state.update(refs)
  return state


def read_safetensors_folder(folder: str) -> dict[str, np.ndarray]:
  """Every tensor of a model folder as a read-only numpy view of its memory-mapped file (bf16 stays
  bf16 via ml_dtypes); pages are read from disk when the values are used.

  Raises:
    CheckpointError: see `open_safetensors_folder`.
  """
  return {key: ref.array() for key, ref in open_safetensors_folder(folder).items()}


@dataclasses.dataclass(frozen=True)
class HostLeaf:
  """One parameter in the model's layout, still as views of memory-mapped checkpoint tensors.

  Loaders describe each parameter as the numpy view (transposes, reshapes: no copy) of the
  checkpoint tensor it comes from, or the Z per-layer views of a parameter stacked on a leading
  layer axis; `read(index)` then copies out only the part a device needs, converted to `dtype` in
  the same pass (`pipelines.parallel.distributed.put_host_leaves`). So loading never holds the whole
  checkpoint in memory, only the part being placed.

  Attributes:
    parts: one view, or the layers of a stacked parameter (equal shapes).
    dtype: the parameter's dtype.
    stacked: whether `parts` are stacked on a new leading axis.
    scales: None, or one scale per part (None: that part is not scaled) of a scaled-fp8 weight:
      float32 of the part's shape, in the part's layout (a broadcast view: one value, or one per
      output row, transposed and reshaped as the part is); the parameter is part * scale.
  """
  parts: tuple[np.ndarray, ...]
  dtype: np.dtype
  stacked: bool = False
  scales: tuple[np.ndarray | None, ...] | None = None

  @classmethod
  def of(cls, view: np.ndarray, dtype: Any, scale: np.ndarray | None = None) -> HostLeaf:
    """Raises ValueError: a scale that does not broadcast to the view."""
    return cls((view,), np.dtype(dtype), scales=None if scale is None else (_scale_of(view, scale),))

  @classmethod
  def stack(cls, views: list[np.ndarray], dtype: Any, scales: list[np.ndarray | None] | None = None) -> HostLeaf:
    """Raises ValueError: a scale that does not broadcast to its view."""
    return cls(tuple(views), np.dtype(dtype), stacked=True,
               scales=None if scales is None else tuple(None if s is None else _scale_of(v, s)
                                                        for v, s in zip(views, scales, strict=True)))

  @property
  def shape(self) -> tuple[int, ...]:
    inner = tuple(self.parts[0].shape)
    return (len(self.parts), *inner) if self.stacked else inner

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  def read(self, index: tuple[slice, ...] = ()) -> np.ndarray:
    """The C-contiguous `dtype` copy of `self[index]` (index: a tuple of slices, as
    `jax.make_array_from_callback` passes; a contiguous same-dtype part is returned uncopied).
    With `scales` (a scaled-fp8 weight), each part is q * scale in float32, element by element,
    rounded once to `dtype`."""
    if self.scales is not None:
      values = dataclasses.replace(self, dtype=np.dtype(np.float32), scales=None).read(index)
      if not self.stacked:
        return (values * self.scales[0][index]).astype(self.dtype, copy=False)
      layers = range(len(self.parts))[index[0] if index else slice(None)]
      for j, layer in enumerate(layers):  # `values` is a new array: scaled in place
        if self.scales[layer] is not None:
          values[j] *= self.scales[layer][tuple(index[1:])]
      return values.astype(self.dtype, copy=False)
    if not self.stacked:
      part = self.parts[0][index]
      if part.flags.c_contiguous and part.dtype == self.dtype:
        return part
      out = np.empty(part.shape, self.dtype)
      _tiled_copy(out, part)
      return out
    layers = range(len(self.parts))[index[0] if index else slice(None)]
    rest = tuple(index[1:])
    first = self.parts[0][rest]
    out = np.empty((len(layers), *first.shape), self.dtype)
    for j, layer in enumerate(layers):
      _tiled_copy(out[j], self.parts[layer][rest])
    return out


def _scale_of(view: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """`scale` as float32 broadcast to the view's shape (a view: no copy)."""
  return np.broadcast_to(np.asarray(scale, np.float32), view.shape)


_TILE_ELEMENTS = 1 << 16


def _tiled_copy(dst: np.ndarray, src: np.ndarray) -> None:
  """dst[...] = src (cast unsafely), in blocks of at most `_TILE_ELEMENTS` values when `src` is
  a strided view (a transpose): a block's reads and writes then stay in cache, about 3x faster than
  one whole-array copy of a transposed matrix."""
  if src.flags.c_contiguous or src.size <= _TILE_ELEMENTS:
    np.copyto(dst, src, casting="unsafe")
    return
  tiles = list(src.shape)
  while math.prod(tiles) > _TILE_ELEMENTS:
    axis = max(range(len(tiles)), key=tiles.__getitem__)
    tiles[axis] = (tiles[axis] + 1) // 2
  for starts in itertools.product(*(range(0, n, t) for n, t in zip(src.shape, tiles))):
    block = tuple(slice(a, a + t) for a, t in zip(starts, tiles))
    np.copyto(dst[block], src[block], casting="unsafe")


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
