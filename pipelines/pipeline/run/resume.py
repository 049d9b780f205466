"""Resumable denoising: the state after a step, written atomically off the critical path, and read back.

A checkpoint is one safetensors file, `DIR/denoise_state.safetensors`, holding
- the arrays of the denoising state after `step` completed steps: "latents" float32
  [B, C, F, Hl, Wl] and the solver state's leaves "solver.0", "solver.1", ... (`UniPCState` /
  `FlowEulerState`, in `jax.tree.flatten` order), and any other carried state named the same way;
- in its metadata ("wan_usp", JSON): the format version, `step`, and the run's identity: every
  setting that decides the video (prompts, sizes, steps, guidance, scheduler, text length, dtype),
  the SHA-256 of the initial noise (which covers the seed or explicit latents and is the same on
  every mesh) and the model's fingerprint (`model_fingerprint`). The mesh is not part of it: a run
  may resume on another mesh.

Writing (`Writer.save`): the state is copied on its device first (a device-side copy, dispatched
before the next step donates the buffers), then a background thread reads the copy to the host
and writes a temporary file beside it (`DIR/.denoise_state.safetensors.*.tmp`), fsyncs it and
renames it over the previous checkpoint, so the host copy and the file write overlap the next step and a crash at any moment
leaves the previous complete checkpoint. Only process 0 of a multi-process run writes; to resume,
every process reads DIR (shared storage, as the model folder).

The schedule (timesteps, sigmas, coefficients) is recomputed from the settings on resume and must
equal the saved one, which is checked leaf by leaf with the rest of the state.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

STATE_FILE = "denoise_state.safetensors"
FORMAT_VERSION = 1
_META_KEY = "wan_usp"


class ResumeError(ValueError):
  """A checkpoint that is missing, unreadable, or from another run (the message names the difference)."""


@dataclasses.dataclass(frozen=True)
class ResumeConfig:
  """Resumable denoising for one generation (`WanPipeline.generate(..., resume=...)`).

  Attributes:
    checkpoint_dir: the folder the denoising state is saved to (`STATE_FILE` in it).
    every: save after every `every`-th step (and after the last).
    resume: continue the run saved in `checkpoint_dir` (False: a checkpoint there is an error).
    keep: keep the checkpoint after a run that did every step (it is removed otherwise).

  Raises:
    ValueError: a checkpoint_dir that is not a path, `every` not an int >= 1, non-bool flags.
  """
  checkpoint_dir: str
  every: int = 1
  resume: bool = False
  keep: bool = False

  def __post_init__(self):
    if not isinstance(self.checkpoint_dir, (str, os.PathLike)):
      raise ValueError(f"checkpoint_dir={self.checkpoint_dir!r} must be a folder path, not a "
                       f"{type(self.checkpoint_dir).__name__}")
    object.__setattr__(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
    if isinstance(self.every, bool) or not isinstance(self.every, (int, np.integer)) or self.every < 1:
      raise ValueError(f"checkpoint_every={self.every!r} must be an int >= 1 (steps between checkpoints)")
    for name in ("resume", "keep"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"{'keep_checkpoint' if name == 'keep' else name}={getattr(self, name)!r} must be "
                         "True or False")


def model_fingerprint(trees: Mapping[str, Any], config: Mapping[str, Any]) -> str:
  """SHA-256 (hex) identifying a model's weights without reading them all.

  Hashes `config` (JSON) and, for every leaf of every tree in `trees`, its path, shape, dtype and
  up to 64 evenly strided values (exact bytes: no arithmetic, so the same on every mesh and
  placement). Two models differing in any config field, any parameter's shape, or the sampled
  values (different seeds, different checkpoints, a fused LoRA) get different fingerprints.

  Args:
    trees: name -> pytree of arrays (numpy or jax; replicated or single-device).
    config: JSON-serialisable description (configs, dtype, ...).
  """
  import jax

  h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
  for name in sorted(trees):
    flat = jax.tree_util.tree_flatten_with_path(trees[name])[0]
    samples = _samples([leaf for _, leaf in flat])
    for (path, leaf), sample in zip(flat, samples):
      sample = np.asarray(sample if not isinstance(sample, jax.Array) or sample.is_fully_addressable
                          else sample.addressable_data(0))
      h.update(f"{name}{jax.tree_util.keystr(path)}:{tuple(np.shape(leaf))}:{sample.dtype}".encode())
      h.update(np.ascontiguousarray(sample).tobytes())
  return h.hexdigest()


def _sample(x: Any) -> Any:
  size = int(np.prod(x.shape)) if x.shape else 1
  return x.reshape(-1)[::max(size // 64, 1)][:64]


def _samples(leaves: list[Any]) -> list[Any]:
  """Up to 64 strided values of every leaf: one jitted program for the jax arrays (one dispatch,
  compiled once per tree structure), numpy for the rest."""
  import jax

  arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
  out = [_sample(np.asarray(leaf)) if i not in arrays else None for i, leaf in enumerate(leaves)]
  if arrays:
    for i, sample in zip(arrays, _sample_jit()([leaves[i] for i in arrays])):
      out[i] = sample
  return out


def _sample_all(leaves: list[Any]) -> list[Any]:
  return [_sample(x) for x in leaves]


@functools.cache
def _sample_jit() -> Any:
  """`_sample_all` jitted (one compile per leaf structure, built on first use)."""
  import jax
  return jax.jit(_sample_all)


class Checkpoint:
  """A read checkpoint: `step` completed steps, `identity` (JSON dict) and the state's arrays."""

  def __init__(self, path: str, step: int, identity: dict[str, Any], arrays: dict[str, np.ndarray]):
    self.path = path
    self.step = step
    self.identity = identity
    self.arrays = arrays

  def differences(self, identity: Mapping[str, Any]) -> list[str]:
    """What differs between this checkpoint's run and `identity`: one "name: checkpoint X, this
    run Y" per setting (values shortened), empty when they match."""
    out = []
    for key in sorted(set(self.identity) | set(identity)):
      saved, now = self.identity.get(key, "<absent>"), identity.get(key, "<absent>")
      if _canonical(saved) != _canonical(now):
        out.append(f"{key}: checkpoint {_short(saved)}, this run {_short(now)}")
    return out

  def restore(self, name: str, like: Any) -> Any:
    """The saved pytree `name` ("latents", "solver", ...) in the structure of `like` (a fresh
    state of the resumed run), as numpy arrays.

    Raises:
      ResumeError: a leaf missing, or of another shape or dtype than `like`'s.
    """
    import jax

    leaves, treedef = jax.tree.flatten(like)
    keys = [name] if len(leaves) == 1 and name in self.arrays else [f"{name}.{i}" for i in range(len(leaves))]
    out = []
    for key, leaf in zip(keys, leaves):
      if key not in self.arrays:
        raise ResumeError(f"{self.path}: the checkpoint has no {key!r}; it was written by another "
                          "version of this program or another scheduler")
      array = self.arrays[key]
      if array.shape != tuple(leaf.shape) or array.dtype != np.dtype(leaf.dtype):
        raise ResumeError(f"{self.path}: {key} is {array.dtype}{list(array.shape)} but this run needs "
                          f"{np.dtype(leaf.dtype)}{list(leaf.shape)}")
      out.append(array)
    return jax.tree.unflatten(treedef, out)


def _canonical(value: Any) -> str:
  return json.dumps(value, sort_keys=True, default=str)


def _short(value: Any, limit: int = 80) -> str:
  text = json.dumps(value, default=str)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def state_path(directory: str) -> str:
  return os.path.join(directory, STATE_FILE)


def window_dir(directory: str, window: int) -> str:
  """The checkpoint folder of window `window` of a run whose context windows continue one another
  (`pipeline.run.continued`): each window a run of its own, its checkpoint in DIR/window-K."""
  return os.path.join(directory, f"window-{window}")


def holds_checkpoint(directory: str) -> bool:
  """Whether `directory` holds a denoising checkpoint to resume: its own (`STATE_FILE`), or a
  window's (`window_dir`)."""
  if os.path.isfile(state_path(directory)):
    return True
  names = os.listdir(directory) if os.path.isdir(directory) else ()
  return any(name.startswith("window-") and os.path.isfile(state_path(os.path.join(directory, name))) for name in names)


def read(directory: str) -> Checkpoint | None:
  """The checkpoint in `directory`; None when there is none (no folder, or no state file).

  Raises:
    ResumeError: the file exists but is not a readable checkpoint of this format.
  """
  from safetensors import SafetensorError, safe_open

  path = state_path(directory)
  if not os.path.isfile(path):
    return None
  try:
    with safe_open(path, framework="numpy") as f:
      meta = json.loads((f.metadata() or {}).get(_META_KEY, "null"))
      arrays = {key: f.get_tensor(key) for key in f.keys()}
  except (SafetensorError, OSError, ValueError) as e:
    raise ResumeError(f"{path} is not a readable denoising checkpoint ({e}); remove it to start over") from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
    raise ResumeError(f"{path} is not a denoising checkpoint of format {FORMAT_VERSION} (metadata "
                      f"{_short(meta)}); remove it to start over")
  return Checkpoint(path, int(meta["step"]), meta["identity"], arrays)


def _write(directory: str, step: int, identity: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
  """Writes the checkpoint atomically (`video_io.atomic_file`: a temporary file beside it, here
  fsynced before the rename, then the folder fsynced)."""
  from safetensors.numpy import save_file

  from pipelines.storage import video_io

  os.makedirs(directory, exist_ok=True)
  meta = {_META_KEY: json.dumps({"format": FORMAT_VERSION, "step": step, "identity": identity},
                                default=str)}
  with video_io.atomic_file(state_path(directory), ".tmp", overwrite=True) as tmp:
    save_file({k: np.asarray(v).copy(order="C") for k, v in arrays.items()}, tmp, metadata=meta)
    with open(tmp, "rb") as f:
      os.fsync(f.fileno())
  try:
    fd = os.open(directory, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  except OSError:
    pass  # folders cannot be fsynced on every platform


def flatten_state(state: Mapping[str, Any]) -> dict[str, Any]:
  """{"latents": x, "solver": tree, ...} -> {"latents": x, "solver.0": leaf, ...} (a single-leaf
  tree keeps its name)."""
  import jax

  out = {}
  for name, tree in state.items():
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1 and not isinstance(tree, (tuple, list, dict)) and hasattr(tree, "shape"):
      out[name] = leaves[0]
    else:
      out.update({f"{name}.{i}": leaf for i, leaf in enumerate(leaves)})
  return out


class Writer:
  """Saves denoising states in the background, one at a time, newest last.

  Args:
    directory: where the checkpoint goes (created on the first save).
    identity: the run's identity (JSON dict; see the module docstring).
    enabled: False on processes that do not write (all but process 0): `save` does nothing.
  """

  def __init__(self, directory: str, identity: Mapping[str, Any], *, enabled: bool = True):
    self.directory = directory
    self.identity = dict(identity)
    self.enabled = enabled
    self.saved_step: int | None = None
    self._error: BaseException | None = None
    self._queue: queue.Queue = queue.Queue(maxsize=1)
    self._thread: threading.Thread | None = None

  def save(self, step: int, state: Mapping[str, Any]) -> None:
    """Schedules the state after `step` completed steps for writing; returns at once.

    `state` maps names to pytrees of jax arrays (replicated or single-device). Each leaf is copied
    on its device here (so the caller may donate the originals to the next step); the host copy and
    the write happen on the writer thread. Waits only if the previous write is still going.

    Raises:
      OSError / ResumeError: the previous write failed (raised here, at the next save, or at `close`).
    """
    import jax
    import jax.numpy as jnp

    if not self.enabled:
      return
    self._raise_if_failed()
    arrays = {}
    for key, leaf in flatten_state(state).items():
      if isinstance(leaf, jax.Array):
        if len(leaf.sharding.device_set) > 1:  # replicated over a mesh: this process's first copy
          if not leaf.sharding.is_fully_replicated:
            raise ValueError(f"{key} is sharded ({leaf.sharding}); the denoising state is replicated")
          leaf = leaf.addressable_data(0)
        leaf = jnp.copy(leaf)
      arrays[key] = leaf
    if self._thread is None:
      self._thread = threading.Thread(target=self._work, name="denoise-checkpoint", daemon=True)
      self._thread.start()
    self._queue.put((step, arrays))

  def _work(self) -> None:
    while True:
      item = self._queue.get()
      try:
        if item is None:
          return
        step, arrays = item
        if self._error is None:
          _write(self.directory, step, self.identity, {k: np.asarray(v) for k, v in arrays.items()})
          self.saved_step = step
      except BaseException as e:  # reported by the next save / close
        self._error = e
      finally:
        self._queue.task_done()

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      error, self._error = self._error, None
      raise OSError(f"writing the denoising checkpoint in {self.directory} failed: {error}") from error

  def close(self) -> None:
    """Waits for the pending write; raises if a write failed."""
    if self._thread is not None:
      self._queue.put(None)
      self._thread.join()
      self._thread = None
    self._raise_if_failed()


def remove(directory: str) -> None:
  """Removes the checkpoint (and `directory` if that leaves it empty)."""
  path = state_path(directory)
  if os.path.exists(path):
    os.remove(path)
  for name in os.listdir(directory) if os.path.isdir(directory) else ():
    if name.startswith(f".{STATE_FILE}.") and name.endswith(".tmp"):  # left by a process killed mid-write
      os.remove(os.path.join(directory, name))
  try:
    os.rmdir(directory)
  except OSError:
    pass  # not empty (the user's other files) or already gone
