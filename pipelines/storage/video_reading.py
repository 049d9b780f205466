"""Reading a video the user gives (video-to-video's input): mp4 and the other containers through
imageio-ffmpeg, GIF through Pillow, .npy as `video_io` writes it, or a folder of image frames.
"""

from __future__ import annotations

import os
import re

import numpy as np


# File suffixes read as videos (a folder of frames is one too); anything else is an image file.
VIDEO_SUFFIXES = (".npy", ".gif", ".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v")
VIDEO_INPUTS = ".mp4, .mov, .mkv, .webm, .avi, .gif, .npy (float [F, H, W, 3] in [0, 1]) or a folder of image frames"


def read_video(path: str, max_frames: int | None = None) -> np.ndarray:
  """The frames of a video file, as the decoder shows them: uint8 [F, H, W, 3] RGB, or for .npy
  float32 [F, H, W, 3] in [0, 1] as `write_video` stores them (`VIDEO_INPUTS`); at most
  `max_frames` (the first ones).

  mp4 and the other containers are decoded by imageio-ffmpeg's ffmpeg (every codec it has; its
  first video stream);
  a GIF's frames by Pillow (composited as displayed); a folder's image files in name order by
  `storage.images` (16-bit, alpha, EXIF as for --image).

  Raises:
    ValueError: not one of `VIDEO_INPUTS`, no frames, frames of different sizes, or a file the
      decoder cannot read (naming the path and the decoder's message).
  """
  kind = "folder" if os.path.isdir(path) else os.path.splitext(path)[1].lower()
  try:
    if kind == ".npy":
      frames = np.load(path, allow_pickle=False)[:max_frames].astype(np.float32)
    elif kind == "folder":
      frames = _read_frame_folder(path, max_frames)
    elif kind == ".gif":
      frames = _read_gif(path, max_frames)
    elif kind in VIDEO_SUFFIXES:
      frames = _read_ffmpeg(path, max_frames)
    else:
      raise ValueError(f"{path!r} is not a video this reads; give {VIDEO_INPUTS}")
  except (OSError, RuntimeError, IndexError) as e:
    raise ValueError(f"{path!r} cannot be read as a video ({type(e).__name__}: {e})") from e
  if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
    raise ValueError(f"{path!r} holds no [F, H, W, 3] video (shape {frames.shape})")
  if kind == ".npy" and (not np.isfinite(frames).all() or frames.min() < 0 or frames.max() > 1):
    raise ValueError(f"{path!r}: .npy frames must be finite and in [0, 1]")
  return frames


def _read_ffmpeg(path: str, max_frames: int | None) -> np.ndarray:
  """The first video stream decoded by imageio-ffmpeg's ffmpeg to RGB (as imageio's reader decodes
  it), sent as PPM images on a pipe: each a "P6\\nW H\\n255\\n" header and H x W x 3 bytes. Spawned
  by `video_io.run_ffmpeg`, not by imageio's reader: that one runs Python (os.setpgrp) in the
  forked child, which in this multithreaded (JAX) process prints JAX's os.fork() deadlock warning."""
  from pipelines.storage.video_io import run_ffmpeg

  limit = [] if max_frames is None else ["-frames:v", str(max_frames)]
  data = run_ffmpeg(["-i", path, "-map", "0:v:0", *limit, "-f", "image2pipe", "-c:v", "ppm", "-pix_fmt", "rgb24",
                     "-"], f"decoding {path!r}", text=False)
  found = re.match(rb"P6\s(\d+)\s(\d+)\s255\s", data)
  if found is None:
    return np.zeros((0, 0, 0, 3), np.uint8)
  header, width, height = found.group(0), int(found.group(1)), int(found.group(2))
  size = len(header) + height * width * 3  # one frame's bytes
  if len(data) % size or any(data[i:i + len(header)] != header for i in range(0, len(data), size)):
    raise RuntimeError(f"ffmpeg's frames of {path!r} change size mid-stream (the first is {width}x{height})")
  return np.frombuffer(data, np.uint8).reshape(-1, size)[:, len(header):].reshape(-1, height, width, 3)


def _read_gif(path: str, max_frames: int | None) -> np.ndarray:
  from PIL import Image, ImageSequence

  with Image.open(path) as gif:
    frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(gif)]
  return np.stack(frames[:max_frames])


def _read_frame_folder(path: str, max_frames: int | None) -> np.ndarray:
  from pipelines.storage import images

  names = sorted(n for n in os.listdir(path) if os.path.splitext(n)[1].lower() in
                 (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"))[:max_frames]
  frames = [images.read_image(os.path.join(path, name)).pixels for name in names]
  if len({f.shape for f in frames}) > 1:
    raise ValueError(f"the frames in {path!r} differ in size: {sorted({f.shape for f in frames})}")
  return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)
