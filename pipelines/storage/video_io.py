"""Writing generated videos atomically, read back before the rename: mp4 (H.264), gif, npy, PNG frames.

Frames are float [frames, height, width, 3] in [0, 1] (the pipeline's output for one video),
quantised with rounding to uint8, except .npy, which keeps them as float32 (for exact comparisons,
e.g. a multi-process run against a single-process one). Every write goes to a temporary name in
the destination's own directory, is read back, and only then renamed into place with `os.replace`,
so a crash, a Ctrl-C or an encoder failure never leaves a half-written, empty or undecodable file
under the requested name (the temporary file is removed), and an existing output is replaced only
when `overwrite` is set.

What each format can store, checked before anything is encoded (`generate` checks the fps before
any compute; its sizes, multiples of 16, are always even):
- fps: a finite number in `FPS_RANGE` for every format (ffmpeg's mp4 muxer refuses rates below
  ~2e-5 and leaves an empty file).
- mp4 (H.264 by imageio-ffmpeg's ffmpeg, yuv420p) needs an even width and height; `odd_size`
  chooses between refusing ("error"), repeating the last row / column ("pad") and dropping it
  ("crop"), the last two with a warning.
- GIF delays are whole centiseconds (1 .. 65535): the delay stored is the one nearest to 1 / fps,
  with a `FrameRateWarning` when that is not exactly 1 / fps (e.g. 16 fps -> 6 cs = 16.7 fps).

The read-back check: the mp4 decodes with ffmpeg to the frame count and size sent; the GIF decodes
to the size sent and its delays add up to the frame count sent (Pillow stores a run of identical
consecutive frames once, with the run's total delay); .npy and PNG frames read back bit-exact.
"""

from __future__ import annotations

import contextlib
import fractions
import json
import math
import numbers
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

VIDEO_SUFFIXES = (".mp4", ".gif", ".npy")
FPS_RANGE = (1e-3, 1000.0)  # frames per second; a frame every 1000 s .. 1 ms
ODD_SIZES = ("error", "pad", "crop")
GIF_MAX_DELAY_CS = 65535  # a GIF frame delay is an unsigned 16-bit count of centiseconds
TAG_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,78}")  # a PNG keyword's length; no '=' (ffmpeg's key=value)
ARGV_TAG_BYTES = 65536  # a longer mp4 tag reaches ffmpeg through a file (Linux: one argument <= 128 KiB)


class OutputError(ValueError):
  """The output cannot be written as asked: bad suffix, missing or read-only directory, an existing
  output, or an fps or frame size its format cannot store."""


class EncodeError(RuntimeError):
  """The encoder failed, or what it wrote does not read back as the video sent; nothing was left
  under the requested name."""


class FrameRateWarning(UserWarning):
  """The requested fps cannot be stored exactly by the output format (GIF: whole centiseconds)."""


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
  """The JSON sidecar next to an output, named after all of it so that `*.mp4.json`-style patterns
  (.gitignore) match sidecars and nothing else: fox.mp4 -> fox.mp4.json, frames/ ->
  frames.frames.json."""
  path = path.rstrip(os.sep) or path
  return path + (".frames.json" if output_kind(path) == "frames" else ".json")


def check_output(path: str, *, overwrite: bool, sidecar: bool = True) -> None:
  """Fails before any compute if `path` (and, with `sidecar`, its sidecar) cannot be written.

  Raises:
    OutputError: a bad suffix, a missing or unwritable directory, an existing output or sidecar
      without `overwrite`, or an mp4 without imageio-ffmpeg's ffmpeg (`check_mp4_encoder`).
  """
  if output_kind(path) == "mp4":
    check_mp4_encoder(path)
  parent = os.path.dirname(os.path.abspath(path.rstrip(os.sep) or path))
  if not os.path.isdir(parent):
    ancestor = parent
    while not os.path.lexists(ancestor):
      ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):  # e.g. --out some_file/fox.mp4: fails for root too
      raise OutputError(f"the directory of output {path!r} cannot exist: {ancestor!r} is a file, not a "
                        "directory; choose another path")
    raise OutputError(f"the directory of output {path!r} does not exist ({parent!r}); create it first")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise OutputError(f"cannot write to {parent!r} (the directory of output {path!r}); choose a writable "
                      "location")
  for target in (path, sidecar_path(path)) if sidecar else (path,):
    if os.path.lexists(target.rstrip(os.sep) or target) and not overwrite:
      raise OutputError(f"{target!r} exists; pass overwrite=True to replace it, or choose another path")


def mp4_encoder_problem() -> str | None:
  """Why no mp4 could be encoded here, or None when one can: imageio-ffmpeg does not import (a machine
  with only the core packages, e.g. a TPU host's own index) or finds no ffmpeg (`IMAGEIO_FFMPEG_EXE`
  naming a missing file, which imageio-ffmpeg returns unchecked)."""
  try:
    import imageio_ffmpeg
  except ImportError as e:
    return f"imageio-ffmpeg is not installed ({e})"
  try:
    exe = imageio_ffmpeg.get_ffmpeg_exe()
  except RuntimeError as e:
    return f"imageio-ffmpeg finds no ffmpeg ({e})"
  if shutil.which(exe) is None:
    return f"imageio-ffmpeg finds no ffmpeg ({exe!r} is not an executable: check IMAGEIO_FFMPEG_EXE)"
  return None


def check_mp4_encoder(path: str) -> None:
  """Fails before any compute if the mp4 at `path` could not be encoded (`mp4_encoder_problem`).
  Found only at the write, the video would be lost.

  Raises:
    OutputError: naming the cause and the fixes (install imageio-ffmpeg, or another output kind).
  """
  problem = mp4_encoder_problem()
  if problem is not None:
    raise OutputError(f"output {path!r} is an mp4 but {problem}; pip install imageio-ffmpeg (it ships "
                      "ffmpeg), or write .npy, .gif or a folder of PNG frames")


def _check_frames(frames: np.ndarray) -> np.ndarray:
  if frames.ndim != 4 or frames.shape[-1] != 3:
    raise ValueError(f"frames must be [F, H, W, 3], got {frames.shape=}")
  return frames


def to_uint8(frames: np.ndarray) -> np.ndarray:
  """float [F, H, W, 3] in [0, 1] -> uint8, rounded.

  Raises:
    ValueError: not [F, H, W, 3].
  """
  frames = _check_frames(np.asarray(frames))
  return np.clip(np.rint(frames.astype(np.float32) * 255.0), 0, 255).astype(np.uint8)


def check_fps(fps: float) -> float:
  """Returns `fps` as a float if every output format can store it.

  Raises:
    OutputError: not a real number (a bool included), not finite, or outside `FPS_RANGE`.
  """
  low, high = FPS_RANGE
  if not isinstance(fps, numbers.Real) or isinstance(fps, (bool, np.bool_)) or not math.isfinite(fps) \
      or not low <= fps <= high:
    raise OutputError(f"fps={fps!r} must be a finite number of frames per second in [{low:g}, {high:g}] "
                      "(Wan: 16)")
  return float(fps)


def gif_delay_cs(fps: float) -> int:
  """The GIF frame delay nearest to 1 / fps, in centiseconds (1 .. `GIF_MAX_DELAY_CS`).

  Warns (`FrameRateWarning`) when it is not exactly 1 / fps, naming the fps actually stored: e.g.
  60 fps -> 2 cs (50 fps), 120 fps -> 1 cs (100 fps), 16 fps -> 6 cs (16.7 fps).

  Raises:
    OutputError: see `check_fps`.
  """
  exact = 100.0 / check_fps(fps)
  delay = _nearest_delay_cs(exact)
  if abs(delay - exact) > 1e-9 * exact:
    warnings.warn(f"GIF frame delays are whole centiseconds: {fps:g} fps (a {1000 / fps:.4g} ms delay) is "
                  f"stored as {delay} cs = {100 / delay:.4g} fps; pick an fps that divides 100 (e.g. 10, 20, "
                  "25, 50) or write .mp4 for exact timing", FrameRateWarning, stacklevel=2)
  return delay


def gif_fps(fps: float) -> float:
  """The frame rate a GIF stores for `fps` (100 / the nearest whole-centisecond delay), without a
  warning: what `generate` writes when --fps is not given (16 fps -> 6 cs = 16.67 fps).

  Raises:
    OutputError: see `check_fps`.
  """
  return 100.0 / _nearest_delay_cs(100.0 / check_fps(fps))


def _nearest_delay_cs(exact_cs: float) -> int:
  return min(max(math.floor(exact_cs + 0.5), 1), GIF_MAX_DELAY_CS)


def check_frame_size(path: str, height: int, width: int, *, odd_size: str = "error") -> tuple[int, int]:
  """The (height, width) `write_video` stores for frames of height x width at `path`.

  Unchanged except for an mp4 of odd height or width (yuv420p subsamples chroma 2x2, so libx264
  refuses odd sizes): odd_size "pad" adds one row / column (a copy of the last), "crop" drops the
  last one.

  Raises:
    OutputError: an unknown `odd_size`, or an odd size for mp4 with odd_size="error".
  """
  if odd_size not in ODD_SIZES:
    raise OutputError(f"odd_size={odd_size!r} must be one of {ODD_SIZES}")
  if output_kind(path) != "mp4" or (height % 2 == 0 and width % 2 == 0):
    return height, width
  if odd_size == "error":
    raise OutputError(f"frames of {width}x{height} cannot be written to {path!r}: mp4 (H.264, yuv420p) needs "
                      "an even width and height; pass odd_size='pad' (repeat the last row / column) or "
                      "'crop' (drop it), or write .gif, .npy or PNG frames")
  step = 1 if odd_size == "pad" else -1
  return height + step * (height % 2), width + step * (width % 2)


def _fit_size(frames: np.ndarray, path: str, odd_size: str) -> np.ndarray:
  """`frames` padded (edge rows / columns) or cropped to `check_frame_size`, with a warning."""
  _, height, width, _ = frames.shape
  new_height, new_width = check_frame_size(path, height, width, odd_size=odd_size)
  if (new_height, new_width) == (height, width):
    return frames
  warnings.warn(f"mp4 needs an even width and height: frames of {width}x{height} written as "
                f"{new_width}x{new_height} ({odd_size=})", stacklevel=3)
  padding = ((0, 0), (0, max(new_height - height, 0)), (0, max(new_width - width, 0)), (0, 0))
  return np.pad(frames, padding, mode="edge")[:, :new_height, :new_width]


def run_ffmpeg(arguments: list[str], what: str, stdin: memoryview | None = None, *, text: bool = True) -> Any:
  """Runs imageio-ffmpeg's ffmpeg as a plain fork + exec (no Python code runs in the child, so it is
  safe in this multithreaded JAX process); returns its stdout, as str (or bytes without `text`).

  Raises:
    EncodeError: a nonzero exit status, with `what` ffmpeg did and the first lines of its stderr.
  """
  import imageio_ffmpeg
  with warnings.catch_warnings():
    # fork + exec of a child process is safe; Python's generic warning about forking a
    # multithreaded (JAX) process does not apply.
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
    # Its own session: a terminal Ctrl-C reaches Python only, and subprocess.run kills ffmpeg.
    done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", *arguments], input=stdin,
                          capture_output=True, start_new_session=True, check=False)
  if done.returncode != 0:
    lines = done.stderr.decode(errors="replace").strip().splitlines()  # the cause comes first
    message = "\n".join(lines[:10] + (["..."] if len(lines) > 10 else [])) or "(no message)"
    raise EncodeError(f"ffmpeg {what} exited with status {done.returncode}: {message}")
  return done.stdout.decode(errors="replace") if text else done.stdout


def _write_mp4(frames: np.ndarray, path: str, fps: float, tags: dict[str, str]) -> tuple[int, int, int]:
  """H.264 (libx264, yuv420p, crf 10), `tags` as the container's metadata (`_metadata_options`);
  returns (frames, height, width) as ffmpeg decodes the file back (every frame, stopping at the
  first decoding error).

  imageio-ffmpeg's own writer neither reports ffmpeg's exit status nor raises when the encoder
  refuses its input (it leaves an empty file): ffmpeg runs here, its stderr kept for the error.
  """
  _, height, width, _ = frames.shape
  rate = fractions.Fraction(fps).limit_denominator(1_000_000)  # exact for 24000/1001 and the like
  with tempfile.TemporaryDirectory(prefix="wan-tags.") as folder:
    run_ffmpeg(["-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(rate),
             "-i", "-", "-an", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-crf", "10",
             *_metadata_options(tags, folder), "-f", "mp4", path],
            "encoding the mp4", stdin=memoryview(to_uint8(frames).reshape(-1)))
  return read_back_mp4(path)


def read_back_mp4(path: str) -> tuple[int, int, int]:
  """(frames, height, width) of an mp4 as ffmpeg decodes it (every frame, stopping at the first
  decoding error).

  Raises:
    EncodeError: ffmpeg cannot read it at all.
  """
  # framecrc: a "#dimensions 0: WxH" header, then one line per decoded frame.
  lines = run_ffmpeg(["-xerror", "-i", path, "-map", "0:v:0", "-f", "framecrc", "-"], "decoding the mp4 back")
  lines = lines.splitlines()
  sizes = [line.split(":")[1].strip() for line in lines if line.startswith("#dimensions 0:")]
  width, height = (int(n) for n in sizes[0].split("x")) if sizes else (0, 0)
  return sum(1 for line in lines if line.strip() and not line.startswith("#")), height, width


def _metadata_options(tags: dict[str, str], folder: str) -> list[str]:
  """ffmpeg's output options that store `tags` (`check_tags`) exactly: `-metadata key=value`, or
  for a tag over `ARGV_TAG_BYTES` of UTF-8, `-/metadata FILE` (the option's value read from a file
  written in `folder`; ffmpeg >= 7.0, as imageio-ffmpeg ships). ffmpeg's ffmetadata input is no
  way in: it cannot hold a value that ends in a backslash."""
  options = []
  for number, (key, value) in enumerate(tags.items()):
    text = f"{key}={value}"
    if len(text.encode("utf-8")) <= ARGV_TAG_BYTES:
      options += ["-metadata", text]
      continue
    name = os.path.join(folder, f"tag_{number}.txt")
    with open(name, "w", encoding="utf-8", newline="") as f:  # newline="": the text exactly
      f.write(text)
    options += ["-/metadata", name]
  return options


def _write_gif(frames: np.ndarray, path: str, fps: float, tags: dict[str, str]) -> tuple[int, int, int]:
  """A looping GIF at `fps`, one a GIF stores (`write_video` rounds it with `gif_delay_cs`), `tags`
  as one comment extension (JSON); returns (frames, height, width) as Pillow decodes it back,
  counting each stored frame as its delay / the delay sent."""
  from PIL import Image, ImageSequence
  delay_ms = 10 * round(100 / fps)
  images = [Image.fromarray(frame) for frame in to_uint8(frames)]
  comment = {"comment": json.dumps(tags, ensure_ascii=False).encode("utf-8")} if tags else {}
  images[0].save(path, format="GIF", save_all=True, append_images=images[1:], duration=delay_ms, loop=0, **comment)
  with Image.open(path) as gif:
    delays = []
    for frame in ImageSequence.Iterator(gif):
      frame.load()
      delays.append(frame.info.get("duration", 0))
    width, height = gif.size
  if any(d <= 0 or d % delay_ms for d in delays):
    raise EncodeError(f"the GIF's frame delays read back as {sorted(set(delays))} ms, not multiples of "
                      f"the {delay_ms} ms sent")
  return sum(delays) // delay_ms, height, width


def _write_npy(frames: np.ndarray, path: str, fps: float, tags: dict[str, str]) -> tuple[int, int, int]:
  """float32 frames; returns their (frames, height, width) if they read back bit-exact. A .npy holds
  no metadata (the sidecar does)."""
  del fps, tags
  np.save(path, frames)
  return _same(np.load(path), frames)


def _write_frames(frames: np.ndarray, path: str, fps: float, tags: dict[str, str]) -> tuple[int, int, int]:
  """frame_00000.png, ... in the folder `path`, each with `tags` as iTXt chunks; returns (frames,
  height, width) if they read back bit-exact."""
  import imageio.v3 as iio
  from PIL import Image, PngImagePlugin
  del fps
  frames = to_uint8(frames)
  names = [os.path.join(path, f"frame_{i:05d}.png") for i in range(len(frames))]
  info = PngImagePlugin.PngInfo()
  for key, value in tags.items():
    info.add_itxt(key, value)
  for name, frame in zip(names, frames):
    Image.fromarray(frame).save(name, format="PNG", pnginfo=info)
  return _same(np.stack([iio.imread(name) for name in names]), frames)


def _same(stored: np.ndarray, sent: np.ndarray) -> tuple[int, int, int]:
  if stored.shape != sent.shape or stored.dtype != sent.dtype or not np.array_equal(stored, sent):
    raise EncodeError(f"the file reads back as {stored.dtype} {stored.shape}, not the {sent.dtype} "
                      f"{sent.shape} frames sent (or with other values)")
  return sent.shape[:3]


_WRITERS: dict[str, Callable[[np.ndarray, str, float, dict[str, str]], tuple[int, int, int]]] = {
    "mp4": _write_mp4, "gif": _write_gif, "npy": _write_npy, "frames": _write_frames}


def write_video(frames: np.ndarray, path: str, *, fps: float = 16.0, overwrite: bool = False,
                odd_size: str = "error", metadata: dict[str, str] | None = None) -> str:
  """Writes one video atomically after checking that it reads back; returns the path written.

  Args:
    frames: float [F, H, W, 3] in [0, 1].
    path: *.mp4, *.gif, *.npy (float32, not quantised), or a folder (frame_00000.png, ...).
    fps: frames per second (Wan: 16), in `FPS_RANGE`; a GIF stores the nearest whole-centisecond
      delay (`gif_delay_cs`, with a `FrameRateWarning` when inexact).
    overwrite: replace an existing output.
    odd_size: for an mp4 of odd height or width: "error", "pad" or "crop" (`check_frame_size`).
    metadata: text tags for the file (`video_tags.metadata_tags`: title and comment; `check_tags`), stored
      exactly: the mp4's container metadata, the GIF's comment (the tags as one JSON object), each
      PNG frame's iTXt chunks; none in a .npy. `video_tags.read_metadata` reads them back.

  Raises:
    OutputError: see `check_output` (the video's own path, checked before encoding and again just
      before the rename), `check_fps`, `check_frame_size` and `check_tags`; raised before anything
      is written.
    EncodeError: the encoder failed (the message holds ffmpeg's exit status and the first lines
      of its stderr), or the output does not read back with the frame count and size sent. The temporary
      file is removed; an existing output under `path` is left as it was.
    ValueError: frames not [F, H, W, 3], or no frame.
  """
  fps = check_fps(fps)
  check_output(path, overwrite=overwrite, sidecar=False)
  tags = check_tags(metadata or {})
  kind = output_kind(path)
  path = path.rstrip(os.sep) or path
  frames = np.asarray(frames, np.float32)
  _check_frames(frames)
  if not len(frames):
    raise ValueError(f"frames must hold at least one frame, got {frames.shape=}")
  frames = _fit_size(frames, path, odd_size)
  if kind == "gif":
    fps = 100 / gif_delay_cs(fps)  # the nearest fps a GIF stores
  with atomic_file(path, "" if kind == "frames" else "." + kind, overwrite, folder=kind == "frames") as temp:
    try:
      stored = tuple(_WRITERS[kind](frames, temp, fps, tags))
      if stored != frames.shape[:3]:
        raise EncodeError(f"the {kind} output reads back as {stored[0]} frames of {stored[2]}x{stored[1]}, "
                          f"not the {frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]} sent")
    except Exception as e:  # noqa: BLE001 -- any writer or reader error, reported with its cause
      why = e if isinstance(e, EncodeError) else (f"the {kind} output does not write or read back "
                                                  f"({type(e).__name__}: {e})")
      raise EncodeError(f"writing {path!r} failed; nothing was written there: {why}") from e
  return path


def check_tags(tags: dict[str, str]) -> dict[str, str]:
  """`tags` as `write_video` stores them (a copy), if every format can hold them exactly.

  Raises:
    OutputError: a key not matching `TAG_KEY` (a letter, then letters, digits or '_'; at most 79:
      a PNG keyword), or a value that is not a str, holds a NUL or is not UTF-8 (a lone surrogate).
  """
  for key, value in tags.items():
    if not isinstance(key, str) or not TAG_KEY.fullmatch(key):
      raise OutputError(f"metadata key {key!r} must be a letter then up to 78 letters, digits or '_'")
    if not isinstance(value, str):
      raise OutputError(f"metadata {key!r} must be text, got {type(value).__name__}")
    if "\0" in value:
      raise OutputError(f"metadata {key!r} holds a NUL character, which no container tag keeps")
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:
      raise OutputError(f"metadata {key!r} is not UTF-8 text ({e})") from e
  return dict(tags)


def write_json(data: dict[str, Any], path: str, *, overwrite: bool = False) -> str:
  """Writes a JSON file atomically (same temp-then-rename rule as `write_video`)."""
  with atomic_file(path, ".json", overwrite) as temp:
    with open(temp, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=2, default=str, ensure_ascii=False)
      f.write("\n")
  return path


@contextlib.contextmanager
def atomic_file(path: str, suffix: str, overwrite: bool, *, folder: bool = False) -> Iterator[str]:
  """Yields a temporary file (or, with `folder`, directory) name beside `path`; renames it into
  place on success, removes it on any error or interrupt (so a half-written file never appears
  under `path`). The one atomic-write mechanism of the package (videos, sidecars, run records,
  denoising checkpoints).

  Raises:
    OutputError: `path` appeared meanwhile and `overwrite` is False.
  """
  parent = os.path.dirname(os.path.abspath(path)) or "."
  prefix = f".{os.path.basename(path)}."
  if folder:
    temp = tempfile.mkdtemp(prefix=prefix, dir=parent)
  else:
    fd, temp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=parent)
    os.close(fd)
  try:
    yield temp
    _replace(temp, path, overwrite)
  except BaseException:
    if os.path.isdir(temp) and not os.path.islink(temp):
      shutil.rmtree(temp, ignore_errors=True)
    elif os.path.lexists(temp):
      os.remove(temp)
    raise


def _replace(temp: str, path: str, overwrite: bool) -> None:
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(temp, (0o777 if os.path.isdir(temp) else 0o666) & ~umask)  # mkstemp/mkdtemp give 0600/0700
  if os.path.lexists(path):
    if not overwrite:
      raise OutputError(f"{path!r} appeared while generating; pass overwrite=True to replace it")
    if os.path.isdir(path) and not os.path.islink(path):
      # A directory cannot be renamed over a non-empty one: move the old one aside first.
      trash = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old.", dir=os.path.dirname(os.path.abspath(path)))
      os.replace(path, os.path.join(trash, "old"))
      os.replace(temp, path)
      shutil.rmtree(trash, ignore_errors=True)
      return
  os.replace(temp, path)
