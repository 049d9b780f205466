"""The contact sheet: a video's (or several videos') frames in one numbered grid image, for
`generate --contact-sheet`, the quality tools and serve's spritesheet.
"""

from __future__ import annotations

import math
import os

import numpy as np

from pipelines.storage import video_io


def contact_sheet_path(path: str) -> str:
  """The frame grid written next to an output: fox.mp4 -> fox.mp4.contact.png, frames/ ->
  frames.contact.png (named after all of the output, like `sidecar_path`)."""
  path = path.rstrip(os.sep) or path
  return path + ".contact.png"


def sheet_columns(num_frames: int, max_columns: int) -> list[int]:
  """The frame indices a contact sheet shows: all of them when they fit, else `max_columns` evenly
  spaced ones from the first frame to the last.

  Raises:
    ValueError: no frame, or max_columns < 2.
  """
  if num_frames < 1 or max_columns < 2:
    raise ValueError(f"a contact sheet needs >= 1 frame and >= 2 columns, got {num_frames=}, {max_columns=}")
  if num_frames <= max_columns:
    return list(range(num_frames))
  return sorted({round(i * (num_frames - 1) / (max_columns - 1)) for i in range(max_columns)})


def contact_sheet(rows: list[np.ndarray], *, labels: list[str] | None = None, max_columns: int = 9,
                  min_tile_height: int = 96, gap: int = 2) -> np.ndarray:
  """A grid of frames as one image: one row per video, one column per shown frame (`sheet_columns`),
  a header with the frame numbers and, with `labels`, each row's label on its left.

  Args:
    rows: videos, each float [F, H, W, 3] in [0, 1], all the same shape.
    labels: None or one short text per row.
    max_columns: at most this many frames per row.
    min_tile_height: frames smaller than this are enlarged by a whole factor (nearest neighbour:
      every pixel stays visible as it is).
    gap: pixels between tiles.

  Returns:
    uint8 [height, width, 3]: tiles are `to_uint8` of the frames, exactly (enlarged by repetition).

  Raises:
    ValueError: no rows, rows of different shapes, or a label count that differs from the rows'.
  """
  from PIL import Image, ImageDraw, ImageFont

  if not rows:
    raise ValueError("a contact sheet needs at least one video")
  videos = [video_io.to_uint8(r) for r in rows]
  if any(v.shape != videos[0].shape for v in videos):
    raise ValueError(f"contact sheet rows must have one shape, got {[v.shape for v in videos]}")
  if labels is not None and len(labels) != len(videos):
    raise ValueError(f"{len(labels)} labels for {len(videos)} rows")
  F, H, W, _ = videos[0].shape
  columns = sheet_columns(F, max_columns)
  zoom = max(1, math.ceil(min_tile_height / H))
  th, tw = H * zoom, W * zoom
  font = ImageFont.load_default()
  measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))

  def text_size(text: str) -> tuple[int, int]:
    left, top, right, bottom = measure.textbbox((0, 0), text, font=font)
    return right - left, bottom - top

  label_w = 0 if labels is None else max(text_size(t)[0] for t in labels) + 3 * gap
  header_h = text_size("frame 0")[1] + 3 * gap
  height = header_h + len(videos) * (th + gap)
  width = label_w + len(columns) * (tw + gap) + gap
  sheet = Image.new("RGB", (width, height), (40, 40, 40))
  draw = ImageDraw.Draw(sheet)
  for c, f in enumerate(columns):
    draw.text((label_w + gap + c * (tw + gap), gap), f"frame {f}", fill=(220, 220, 220), font=font)
  for r, video in enumerate(videos):
    y = header_h + r * (th + gap)
    if labels is not None:
      draw.text((gap, y + (th - text_size(labels[r])[1]) // 2), labels[r], fill=(220, 220, 220), font=font)
    for c, f in enumerate(columns):
      tile = video[f].repeat(zoom, axis=0).repeat(zoom, axis=1)
      sheet.paste(Image.fromarray(tile), (label_w + gap + c * (tw + gap), y))
  return np.asarray(sheet)


def write_contact_sheet(rows: list[np.ndarray], path: str, *, labels: list[str] | None = None,
                        max_columns: int = 9, overwrite: bool = False) -> str:
  """Writes `contact_sheet(rows, ...)` as a PNG atomically (same rules as `write_video`); returns
  the path.

  Raises:
    OutputError: `path` does not end in .png, or exists without `overwrite`.
    ValueError: see `contact_sheet`.
  """
  import imageio.v3 as iio

  if not path.lower().endswith(".png"):
    raise video_io.OutputError(f"a contact sheet is a PNG image; {path!r} does not end in .png")
  if os.path.lexists(path) and not overwrite:
    raise video_io.OutputError(f"{path!r} exists; pass overwrite=True to replace it")
  image = contact_sheet(rows, labels=labels, max_columns=max_columns)
  with video_io.atomic_file(path, ".png", overwrite) as temp:
    iio.imwrite(temp, image, extension=".png")
  return path
