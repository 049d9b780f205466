"""The text tags a written video carries (`video_io.write_video(..., metadata=)`): the prompt as its
title and the run's parameters as JSON in its comment, as ComfyUI's SaveVideo tags its videos, and
reading them back from any format that holds them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipelines.storage import video_io


def metadata_tags(prompt: str, parameters: dict[str, Any]) -> dict[str, str]:
  """A video's text tags, as ComfyUI's SaveVideo writes its prompt: "title" the prompt, "comment"
  the run's parameters as one line of JSON (prompt, seed, size, steps, guidance, model, ...: enough to
  make it again) with "software" ("wan-usp-jax 0.1.0") added unless given. The package goes into
  the JSON because ffmpeg keeps its own "encoder" tag in an mp4 and drops unknown keys there."""
  from importlib import metadata as package_metadata

  try:
    version = package_metadata.version("wan-usp-jax")
  except package_metadata.PackageNotFoundError:
    version = "source"
  comment = {"software": f"wan-usp-jax {version}", **parameters}
  return {"title": prompt, "comment": json.dumps(comment, ensure_ascii=False, default=str, sort_keys=True)}


def read_metadata(path: str) -> dict[str, str]:
  """The text tags of a video (`metadata_tags` where `write_video` wrote it): an mp4's container
  metadata (with ffmpeg's own: "encoder", "major_brand", ...), a GIF's comment (another program's
  comment that is no JSON object comes back as {"comment": its text}), a frame folder's first PNG's
  text chunks; {} for a .npy.

  Raises:
    OutputError: not a path `write_video` writes (`output_kind`).
    EncodeError: ffmpeg cannot read the mp4.
    OSError: no such file (for a folder, no frame_00000.png).
  """
  kind = video_io.output_kind(path)
  if kind == "npy":
    return {}
  if kind == "gif":
    return _gif_comment(path)
  if kind == "frames":
    from PIL import Image
    with Image.open(os.path.join(path, "frame_00000.png")) as frame:
      return {k: str(v) for k, v in frame.text.items()}
  return _parse_ffmetadata(video_io.run_ffmpeg(["-i", path, "-f", "ffmetadata", "-"], "reading the mp4's metadata"))


def _gif_comment(path: str) -> dict[str, str]:
  """A GIF's comment extension as tags: `_write_gif`'s JSON object, else {"comment": the text}."""
  from PIL import Image
  with Image.open(path) as gif:
    comment = gif.info.get("comment")
  if not comment:
    return {}
  text = comment.decode("utf-8", errors="replace")
  try:
    tags = json.loads(text)
  except json.JSONDecodeError:
    return {"comment": text}
  return {k: str(v) for k, v in tags.items()} if isinstance(tags, dict) else {"comment": text}


def _parse_ffmetadata(text: str) -> dict[str, str]:
  """ffmpeg's ffmetadata text (";FFMETADATA1", then key=value lines; '=', ';', '#', '\\' and newlines
  escaped with a backslash) as a dict of the global section."""
  tags: dict[str, str] = {}
  lines, current, escaped = [], [], False
  for ch in text:
    if escaped:
      current.append(("\\", ch))
      escaped = False
    elif ch == "\\":
      escaped = True
    elif ch == "\n":
      lines.append(current)
      current = []
    else:
      current.append(("", ch))
  lines.append(current)
  for line in lines:
    if not line or (line[0] == ("", ";") or line[0] == ("", "#")):
      continue
    if line[0] == ("", "["):
      break  # a stream or chapter section: the global tags are done
    split = next((i for i, item in enumerate(line) if item == ("", "=")), None)
    if split is not None:
      tags["".join(c for _, c in line[:split])] = "".join(c for _, c in line[split + 1:])
  return tags
