"""A job's `input_reference`: the first frame of an image-to-video or TI2V model, the video a
text-to-video model starts from (video-to-video, with the job's `strength`; also what `remix`
gives a job: the finished job's video), or on a VACE model a reference image (reference-to-video)
or the video VACE conditions on (a control video; remix's too). Sent as a file part (or a base64
data URL), checked against the served model, decoded by the one image reader (`storage.images`:
16-bit, alpha, palette, CMYK, EXIF orientation) or video reader (`video_reading.read_video`), and
kept in the data folder's `inputs/` under the SHA-256 of its pixels (`image_inputs.digest`, as the sidecar records it), so the worker
and a restarted server read the very pixels the request sent.

What the loaded model cannot take is a 400 naming `input_reference` and the model: an image for a
text-to-video model, a video for an image-to-video or TI2V one, a file that is neither, a URL or a
file id (no fetching: send the file itself); a missing image for an image-to-video model.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import io
import os
import re
import tempfile
from typing import Any

import numpy as np

from pipelines.pipeline.checked.image_inputs import digest
from pipelines.serve import api
from pipelines.serve.forms import Upload
from pipelines.storage import images, video_io
from pipelines.storage import video_reading

MAX_PIXELS = 64 * 2 ** 20  # an image's width x height at most (its decoded RGB: 192 MiB)
INPUTS = "inputs"
_VIDEO_MAGIC = ((4, b"ftyp"), (0, b"\x1aE\xdf\xa3"), (8, b"AVI "), (0, b"OggS"), (4, b"moov"))
_IMAGE_BRANDS = (b"avif", b"heic", b"heix", b"mif1", b"msf1")  # ISO-BMFF images (an `ftyp` too)


def from_body(value: Any, upload: Upload | None) -> Upload | None:
  """The request's reference: the file part, or a JSON / form `{"image_url": "data:...;base64,..."}`.

  Raises:
    api.ApiError: a URL that is not a data URL, a `file_id`, or both a file and an object.
  """
  if value is None:
    return upload
  if upload is not None:
    raise api.ApiError(400, "input_reference: given as a file part and as an object; send one", "input_reference")
  if not isinstance(value, dict) or set(value) - {"image_url", "file_id"} or not value:
    raise api.ApiError(400, "input_reference must be an image file part (multipart/form-data) or "
                       "{\"image_url\": \"data:image/png;base64,...\"}", "input_reference")
  if "file_id" in value:
    raise api.ApiError(400, "input_reference.file_id: this server has no files API; send the image itself as "
                       "a file part", "input_reference")
  url = value["image_url"]
  match = re.fullmatch(r"data:([\w.+/-]*)(;[\w=.-]+)*;base64,([A-Za-z0-9+/=\s]*)", url) if isinstance(url, str) else None
  if match is None:
    raise api.ApiError(400, "input_reference.image_url must be a base64 data URL (data:image/png;base64,...); "
                       "this server fetches no URLs: send the image itself", "input_reference")
  try:
    data = base64.b64decode(match.group(3), validate=False)
  except (binascii.Error, ValueError) as e:
    raise api.ApiError(400, f"input_reference.image_url: its base64 cannot be decoded ({e})", "input_reference") from e
  return Upload(data, None, match.group(1) or None)


@dataclasses.dataclass(frozen=True)
class Decoded:
  """A decoded reference: `kind` "image" (a first frame: pixels uint8 [H, W, 3]), "reference" (a
  VACE reference image, the same form) or "video" (frames [F, H, W, 3], uint8, or float32 in
  [0, 1] from a .npy)."""
  kind: str
  pixels: np.ndarray


def decode(upload: Upload, facts: Any, max_frames: int) -> Decoded:
  """The reference's pixels for the served model: an image (RGB as displayed) for an image-to-video
  or TI2V model, a video (its first `max_frames` frames) for a text-to-video one; on a VACE model
  an image is a reference image and a video the video VACE conditions on.

  Raises:
    api.ApiError: 400 naming input_reference and the model (module docstring).
  """
  model = f"model {facts.name!r}"
  vace = facts.transformer.has_vace
  takes_image = facts.image_to_video or facts.expand_timesteps
  if _is_video(upload):
    if takes_image and not vace:
      raise api.ApiError(400, f"input_reference {_name(upload)} is a video; {model} starts from an image (the "
                         "first frame); send one image", "input_reference")
    return Decoded("video", _video(upload, max_frames))
  if vace:
    return Decoded("reference", _image(upload, model))
  if not takes_image:
    raise api.ApiError(400, f"input_reference: {model} is text-to-video: it takes a video to start from "
                       "(video-to-video), not an image; send a video file, or the prompt alone", "input_reference")
  return Decoded("image", _image(upload, model))


def _image(upload: Upload, model: str) -> np.ndarray:
  import PIL.Image

  try:
    with PIL.Image.open(io.BytesIO(upload.data)) as image:
      if image.size[0] * image.size[1] > MAX_PIXELS:
        raise api.ApiError(400, f"input_reference {_name(upload)} is {image.size[0]}x{image.size[1]} pixels; this "
                           f"server takes at most {MAX_PIXELS} pixels", "input_reference")
      if getattr(image, "n_frames", 1) > 1:
        raise api.ApiError(400, f"input_reference {_name(upload)} is animated ({image.n_frames} frames); {model} "
                           "takes one image (the first frame)", "input_reference")
      image.load()
      return images.to_rgb(image).pixels
  except api.ApiError:
    raise
  except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:
    raise api.ApiError(400, f"input_reference {_name(upload)} is not an image Pillow can read ({e}); send a "
                       "PNG, JPEG or WebP file", "input_reference") from e


def _video(upload: Upload, max_frames: int) -> np.ndarray:
  """A video upload's frames (written to a temporary file for the decoder)."""
  suffix = ".webm" if upload.data[:4] == b"\x1aE\xdf\xa3" else ".avi" if upload.data[8:12] == b"AVI " else ".mp4"
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "reference" + suffix)
    with open(path, "wb") as f:
      f.write(upload.data)
    try:
      frames = video_reading.read_video(path, max_frames=max_frames)
    except ValueError as e:
      raise api.ApiError(400, f"input_reference {_name(upload)} is not a video ffmpeg can read; send an mp4, "
                         "webm, mov or avi file", "input_reference") from e
  if frames.shape[1] * frames.shape[2] > MAX_PIXELS:
    raise api.ApiError(400, f"input_reference {_name(upload)} is {frames.shape[2]}x{frames.shape[1]} pixels; this "
                       f"server takes at most {MAX_PIXELS} pixels", "input_reference")
  return frames


def require(facts: Any, given: Decoded | None) -> None:
  """An image-to-video model's job must bring its first frame.

  Raises:
    api.ApiError: 400 naming input_reference and the model.
  """
  if facts.image_to_video and given is None:
    raise api.ApiError(400, f"input_reference is required: model {facts.name!r} is image-to-video (every video "
                       "starts from an image); send one as a file part", "input_reference")


def store(data_dir: str, given: Decoded) -> dict[str, str]:
  """Writes the pixels as `inputs/<sha256>.png` (an image) or `.npy` (a video's frames), atomically,
  kept if already there; returns the job's `input_reference` record: {"kind", "sha256", "path"}."""
  import PIL.Image

  sha = digest(given.pixels)
  path = os.path.join(data_dir, INPUTS, f"{sha}.{'npy' if given.kind == 'video' else 'png'}")
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with video_io.atomic_file(path, os.path.splitext(path)[1], overwrite=True) as temp:
      if given.kind != "video":
        PIL.Image.fromarray(given.pixels).save(temp, format="PNG")
      else:
        with open(temp, "wb") as f:
          np.save(f, given.pixels, allow_pickle=False)
  return {"kind": given.kind, "sha256": sha, "path": path}


def discard(data_dir: str, record: dict[str, str]) -> None:
  """Removes a stored reference (`store`'s record) from the data folder's inputs/ (a path elsewhere,
  as a row written by another program could hold, is left alone); the caller knows no job uses it."""
  folder = os.path.realpath(os.path.join(data_dir, INPUTS))
  path = os.path.realpath(str(record.get("path")))
  if os.path.dirname(path) == folder:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


def load(record: dict[str, str]) -> np.ndarray:
  """A stored reference's pixels: uint8 [H, W, 3] (an image) or [F, H, W, 3] (a video).

  Raises:
    ValueError: the file is gone or holds other pixels than its name says.
  """
  try:
    if record.get("kind", "image") != "video":
      pixels = images.read_image(record["path"]).pixels
    else:
      pixels = np.load(record["path"], allow_pickle=False)
  except OSError as e:
    raise ValueError(f"the input_reference file {record['path']!r} cannot be read ({e})") from e
  if digest(pixels) != record["sha256"]:
    raise ValueError(f"the input_reference file {record['path']!r} holds other pixels than the job was given")
  return pixels


def _is_video(upload: Upload) -> bool:
  head = upload.data[:16]
  kind = (upload.content_type or "").lower()
  if head[4:8] == b"ftyp" and head[8:12] in _IMAGE_BRANDS:
    return False
  return kind.startswith("video/") or any(head[at:at + len(magic)] == magic for at, magic in _VIDEO_MAGIC)


def _name(upload: Upload) -> str:
  return repr(api.sendable(upload.filename)) if upload.filename else "(data URL)"
