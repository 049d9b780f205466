"""Writing generated videos atomically: mp4 (imageio-ffmpeg, H.264), gif, npy, or PNG frames.

Frames are float [frames, height, width, 3] in [0, 1] (the pipeline's output for one video),
quantised with rounding to uint8, except .npy, which keeps them as float32 (for exact comparisons,
e.g. a multi-process run against a single-process one). Every write goes to a temporary name in
the destination's own directory and is renamed into place with `os.replace`, so a crash or Ctrl-C
never leaves a half-written file under the requested name (the temporary file is removed), and an
existing output is replaced only when `overwrite` is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

VIDEO_SUFFIXES = (".mp4", ".gif", ".npy")


class OutputError(ValueError):
  """The output path cannot be written (bad suffix, missing or read-only directory, exists)."""


def output_kind(path: str) -> str:
  """"mp4", "gif", "npy" or "frames" (a path ending in a separator or without a suffix is a folder).

  Raises:
    OutputError: another suffix.
  """
  if path.endswith(os.sep) or os.path.isdir(path):
    return "frames"
  suffix = os.path.splitext(path)[1].lower()
  if suffix == "":
    return "frames"
  if suffix in VIDEO_SUFFIXES:
    return suffix[1:]
  raise OutputError(f"output {path!r} has suffix {suffix!r}; use .mp4 (H.264 via imageio-ffmpeg), .gif, "
                    ".npy (float32 frames), or a folder path (no suffix, or ending in '/') for PNG frames")


def sidecar_path(path: str) -> str:
  """The JSON sidecar next to an output: fox.mp4 -> fox.json, frames/ -> frames.json."""
  path = path.rstrip(os.sep) or path
  return (os.path.splitext(path)[0] if output_kind(path) != "frames" else path) + ".json"


def check_output(path: str, *, overwrite: bool, sidecar: bool = True) -> None:
  """Fails before any compute if `path` (and, with `sidecar`, its sidecar) cannot be written.

  Raises:
    OutputError: a bad suffix, a missing or unwritable directory, or an existing output or
      sidecar without `overwrite`.
  """
  output_kind(path)
  parent = os.path.dirname(os.path.abspath(path.rstrip(os.sep) or path))
  if not os.path.isdir(parent):
    ancestor = parent
    while not os.path.lexists(ancestor):
      ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):  # e.g. --out some_file/fox.mp4: fails for root too
      raise OutputError(f"the directory of output {path!r} cannot exist: {ancestor!r} is a file, not a "
                        "directory; choose another --out")
    raise OutputError(f"the directory of output {path!r} does not exist ({parent!r}); create it first")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise OutputError(f"cannot write to {parent!r} (the directory of output {path!r}); choose a writable "
                      "location with --out")
  for target in (path, sidecar_path(path)) if sidecar else (path,):
    if os.path.lexists(target.rstrip(os.sep) or target) and not overwrite:
      raise OutputError(f"{target!r} exists; pass --overwrite to replace it, or choose another --out")


def to_uint8(frames: np.ndarray) -> np.ndarray:
  """float [F, H, W, 3] in [0, 1] -> uint8, rounded.

  Raises:
    ValueError: not [F, H, W, 3].
  """
  frames = np.asarray(frames)
  if frames.ndim != 4 or frames.shape[-1] != 3:
    raise ValueError(f"frames must be [F, H, W, 3], got {frames.shape=}")
  return np.clip(np.rint(frames.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)


def _temp_name(path: str, suffix: str) -> str:
  parent = os.path.dirname(os.path.abspath(path)) or "."
  fd, name = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=suffix, dir=parent)
  os.close(fd)
  return name


def _write_mp4(frames: np.ndarray, path: str, fps: float) -> None:
  import imageio_ffmpeg
  _, height, width, _ = frames.shape
  # yuv420p (what players expect) needs even sizes; Wan sizes are multiples of 16.
  writer = imageio_ffmpeg.write_frames(path, (width, height), fps=fps, codec="libx264",
                                       pix_fmt_out="yuv420p", quality=8, macro_block_size=1)
  with warnings.catch_warnings():
    # ffmpeg starts with fork + exec (subprocess), which is safe; Python's generic warning about
    # forking a multithreaded (JAX) process does not apply.
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
    writer.send(None)
  for frame in frames:
    writer.send(np.ascontiguousarray(frame))
  writer.close()


def _write_gif(frames: np.ndarray, path: str, fps: float) -> None:
  import imageio.v3 as iio
  iio.imwrite(path, frames, extension=".gif", duration=1000.0 / fps, loop=0)


def write_video(frames: np.ndarray, path: str, *, fps: float = 16.0, overwrite: bool = False) -> str:
  """Writes one video atomically; returns the path written.

  Args:
    frames: float [F, H, W, 3] in [0, 1].
    path: *.mp4, *.gif, *.npy (float32, not quantised), or a folder (frame_00000.png, ...).
    fps: frames per second (Wan: 16).
    overwrite: replace an existing output.

  Raises:
    OutputError: see `check_output` (the video's own path, checked before encoding and again just
      before the rename).
    ValueError: frames not [F, H, W, 3] or fps <= 0.
  """
  if not fps > 0:
    raise ValueError(f"{fps=} must be > 0")
  check_output(path, overwrite=overwrite, sidecar=False)
  kind = output_kind(path)
  floats = np.asarray(frames, np.float32)
  frames = to_uint8(frames)
  path = path.rstrip(os.sep) or path
  if kind == "frames":
    import imageio.v3 as iio
    temp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(os.path.abspath(path)))
    try:
      for i, frame in enumerate(frames):
        iio.imwrite(os.path.join(temp, f"frame_{i:05d}.png"), frame)
      _replace(temp, path, overwrite)
    except BaseException:
      shutil.rmtree(temp, ignore_errors=True)
      raise
    return path
  with _atomic_file(path, "." + kind, overwrite) as temp:
    if kind == "npy":
      np.save(temp, floats)
    else:
      (_write_mp4 if kind == "mp4" else _write_gif)(frames, temp, fps)
  return path


def write_json(data: dict[str, Any], path: str, *, overwrite: bool = False) -> str:
  """Writes a JSON file atomically (same temp-then-rename rule as `write_video`)."""
  with _atomic_file(path, ".json", overwrite) as temp:
    with open(temp, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=2, default=str, ensure_ascii=False)
      f.write("\n")
  return path


@contextlib.contextmanager
def _atomic_file(path: str, suffix: str, overwrite: bool) -> Iterator[str]:
  """Yields a temporary name beside `path`; renames it into place on success, removes it on any
  error or interrupt (so a half-written file never appears under `path`)."""
  temp = _temp_name(path, suffix)
  try:
    yield temp
    _replace(temp, path, overwrite)
  except BaseException:
    if os.path.exists(temp):
      os.remove(temp)
    raise


def _replace(temp: str, path: str, overwrite: bool) -> None:
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(temp, (0o777 if os.path.isdir(temp) else 0o666) & ~umask)  # mkstemp/mkdtemp give 0600/0700
  if os.path.lexists(path):
    if not overwrite:
      raise OutputError(f"{path!r} appeared while generating; pass --overwrite to replace it")
    if os.path.isdir(path) and not os.path.islink(path):
      # A directory cannot be renamed over a non-empty one: move the old one aside first.
      trash = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old.", dir=os.path.dirname(os.path.abspath(path)))
      os.replace(path, os.path.join(trash, "old"))
      os.replace(temp, path)
      shutil.rmtree(trash, ignore_errors=True)
      return
  os.replace(temp, path)
