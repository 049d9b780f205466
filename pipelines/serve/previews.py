"""The still images a finished job offers beside its video (`GET /v1/videos/{id}/content?variant=`, as
OpenAI's Videos API names them): `thumbnail`, the first frame as a WebP image, and `spritesheet`,
the video's frames in one grid (`contact_sheet.contact_sheet`: up to 9 evenly spaced frames, numbered) as
a JPEG. Both are written with the video (atomically) and removed with it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pipelines.storage import video_io

from pipelines.storage import contact_sheet

VARIANTS = {"thumbnail": ("webp", "image/webp"), "spritesheet": ("jpg", "image/jpeg")}


def preview_path(data_dir: str, job_id: str, variant: str) -> str:
  """Where a job's `variant` ("thumbnail" or "spritesheet") lies: videos/<id>.<variant>.<ext>.

  Raises:
    KeyError: an unknown variant.
  """
  extension, _ = VARIANTS[variant]
  return os.path.join(data_dir, "videos", f"{job_id}.{variant}.{extension}")


def write_previews(data_dir: str, job_id: str, frames: np.ndarray) -> list[str]:
  """Writes the job's thumbnail and spritesheet from its frames, float [F, H, W, 3] in [0, 1];
  returns their paths."""
  import PIL.Image

  images: dict[str, Any] = {"thumbnail": video_io.to_uint8(frames[:1])[0],
                            "spritesheet": contact_sheet.contact_sheet([frames])}
  paths = []
  for variant, pixels in images.items():
    path = preview_path(data_dir, job_id, variant)
    extension, _ = VARIANTS[variant]
    with video_io.atomic_file(path, f".{extension}", overwrite=True) as temp:
      options = {"lossless": True} if extension == "webp" else {"quality": 90}
      PIL.Image.fromarray(pixels).save(temp, format="WEBP" if extension == "webp" else "JPEG", **options)
    paths.append(path)
  return paths
