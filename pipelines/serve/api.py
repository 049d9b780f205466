"""The HTTP API's bodies (OpenAI's Videos API shape, as sglang's `/v1/videos` serves it) and the checks
that turn a `VideoCreate` into a job: the server's own limits first, then the very
`GenerationRequest.build` the `generate` command and the Python call use, so a bad value gets the
same message everywhere (`ApiError`, naming the field, before anything is queued).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipelines.commands.presets import FOLDER_DEFAULTS, PRESETS, TINY_MODELS
from pipelines.pipeline.seed import random_seed

FORMATS = ("mp4", "gif", "npy")
MEDIA_TYPES = {"mp4": "video/mp4", "gif": "image/gif", "npy": "application/octet-stream"}
STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
# What a request may ask for at most (a server guards its devices before queueing anything).
MAX_SIDE = 2048
MAX_FRAMES = 257
MAX_STEPS = 500
# GenerationRequest.build's argument -> the API field a client set.
FIELDS = {"height": "size", "width": "size", "num_frames": "num_frames", "num_inference_steps": "num_inference_steps",
          "guidance_scale": "guidance_scale", "seed": "seed", "prompt": "prompt", "negative_prompt": "negative_prompt",
          "mesh": "mesh", "flow_shift": "flow_shift"}


class ApiError(Exception):
  """A request the server refuses: HTTP `status`, the field at fault (`param`), the message."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request"):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": self.message, "type": "invalid_request_error" if self.status < 500 else "server_error",
                      "param": self.param, "code": self.code}}


class VideoCreate(BaseModel):
  """POST /v1/videos. Numbers are passed to `GenerationRequest.build` as sent (its checks apply).

  `num_frames` wins over `seconds` x `fps`; neither: the model's default length. `lora` names
  LoRAs the server was started with (`serve --lora NAME=PATH`), never a path.
  """
  model_config = ConfigDict(extra="forbid")
  prompt: str
  negative_prompt: str | None = None
  model: str | None = None
  size: str | None = Field(None, description="WIDTHxHEIGHT, e.g. 64x64")
  seconds: Any = None
  fps: Any = None  # None: the model's own rate (`commands.presets.model_fps`: TI2V-5B 24, else 16)
  num_frames: Any = None
  num_inference_steps: Any = None
  guidance_scale: Any = None
  flow_shift: Any = None
  seed: Any = None
  output_format: Literal["mp4", "gif", "npy"] = "mp4"
  lora: list[str] = Field(default_factory=list)


class VideoObject(BaseModel):
  """A job as GET /v1/videos/{id} returns it (OpenAI's video object plus the run's details)."""
  id: str
  object: Literal["video"] = "video"
  model: str
  status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
  progress: int
  created_at: int
  completed_at: int | None = None
  size: str
  seconds: str
  prompt: str
  seed: int
  num_frames: int
  num_inference_steps: int
  step: int
  output_format: str
  timings: dict[str, float] = Field(default_factory=dict)
  error: dict[str, Any] | None = None
  batch_size: int | None = None
  warnings: list[str] = Field(default_factory=list)


def defaults(model: str) -> Any:
  """The sampling defaults of the served model (`commands.presets`): the tiny preset, or diffusers'."""
  return PRESETS["tiny"] if model in TINY_MODELS else FOLDER_DEFAULTS


def _size(text: str | None, preset: Any) -> tuple[int, int]:
  if text is None:
    return preset.width, preset.height
  match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", text)
  if match is None:
    raise ApiError(400, f"size={text!r} is malformed; write WIDTHxHEIGHT, e.g. 64x64 or 832x480", "size")
  width, height = int(match.group(1)), int(match.group(2))
  if max(width, height) > MAX_SIDE:
    raise ApiError(400, f"size={text!r}: this server makes videos of at most {MAX_SIDE} pixels a side", "size")
  return width, height


def _frames(body: VideoCreate, preset: Any) -> Any:
  """num_frames as given, or seconds x fps, or the model's default."""
  if body.num_frames is not None:
    frames = body.num_frames
  elif body.seconds is not None:
    seconds = body.seconds
    if isinstance(seconds, str) and re.fullmatch(r"\d+(\.\d+)?", seconds):
      seconds = float(seconds)  # OpenAI sends seconds as a string ("4")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 60:
      raise ApiError(400, f"seconds={body.seconds!r} must be a number in (0, 60]", "seconds")
    frames = int(round(seconds * body.fps)) + 1
  else:
    frames = preset.frames
  if isinstance(frames, int) and not isinstance(frames, bool) and frames > MAX_FRAMES:
    raise ApiError(400, f"num_frames={frames} is over this server's limit of {MAX_FRAMES}", "num_frames")
  return frames


def _check_text(body: VideoCreate, limit: int) -> None:
  for name in ("prompt", "negative_prompt"):
    text = getattr(body, name)
    if text is None:
      continue
    if len(text) > limit:
      raise ApiError(400, f"{name} holds {len(text)} characters; this server takes at most {limit}", name)
    if "\x00" in text:
      raise ApiError(400, f"{name} holds a NUL character", name)
  if not body.prompt.strip():
    raise ApiError(400, "prompt is empty; describe the video, e.g. 'a red square moving right'", "prompt")


def _check_numbers(body: VideoCreate) -> None:
  fps = body.fps
  if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or not 1 <= fps <= 120:
    raise ApiError(400, f"fps={fps!r} must be a number in [1, 120]", "fps")
  steps = body.num_inference_steps
  if isinstance(steps, int) and not isinstance(steps, bool) and steps > MAX_STEPS:
    raise ApiError(400, f"num_inference_steps={steps} is over this server's limit of {MAX_STEPS}",
                   "num_inference_steps")
  seed = body.seed
  if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 2 ** 63:
    raise ApiError(400, f"seed={seed} must be below 2**63", "seed")


def job_params(body: VideoCreate, *, model: str, loras: tuple[str, ...], max_prompt_chars: int,
               fps: float = 16.0) -> dict[str, Any]:
  """A request's values resolved (defaults filled, seed drawn when missing; `fps` when the body gives
  none: the model's frame rate), before the model checks.

  Raises:
    ApiError: a value outside the server's limits, an unknown LoRA name or model.
  """
  if body.model is not None and body.model != model:
    raise ApiError(400, f"model={body.model!r}: this server serves {model!r} only", "model")
  _check_text(body, max_prompt_chars)
  body = body.model_copy(update={"fps": fps}) if body.fps is None else body
  _check_numbers(body)
  unknown = [name for name in body.lora if name not in loras]
  if unknown or len(set(body.lora)) != len(body.lora):
    raise ApiError(400, f"lora={body.lora!r}: give each of the server's LoRAs at most once; it has "
                   f"{list(loras) or 'none'} (started with serve --lora NAME=PATH)", "lora")
  preset = defaults(model)
  width, height = _size(body.size, preset)
  seed = random_seed() if body.seed is None else body.seed
  return {"prompt": body.prompt, "negative_prompt": preset.negative_prompt if body.negative_prompt is None
          else body.negative_prompt, "width": width, "height": height, "num_frames": _frames(body, preset),
          "num_inference_steps": preset.steps if body.num_inference_steps is None else body.num_inference_steps,
          "guidance_scale": preset.guidance[0] if body.guidance_scale is None else body.guidance_scale,
          "flow_shift": body.flow_shift, "seed": seed, "fps": body.fps, "output_format": body.output_format,
          "lora": sorted(body.lora)}


def build_kwargs(params: dict[str, Any], mesh: Any) -> dict[str, Any]:
  """`GenerationRequest.build`'s keyword arguments of one job (without the prompt)."""
  return {"height": params["height"], "width": params["width"], "num_frames": params["num_frames"],
          "num_inference_steps": params["num_inference_steps"], "guidance_scale": params["guidance_scale"],
          "flow_shift": params["flow_shift"], "mesh": mesh}


def check_request(params: dict[str, Any], facts: Any, mesh: Any) -> tuple[Any, list[str]]:
  """The job's `GenerationRequest` (built as the Python call builds it), its values written back into
  `params` as resolved (frames rounded to 4k + 1), and the job's warnings: frames rounded, a size the
  model was not trained at (`request.outside_training`).

  Raises:
    ApiError: the request's ValueError, with the API field it names.
  """
  from pipelines.pipeline.request import GenerationRequest, outside_training

  asked = params["num_frames"]
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # made again below: Python's warning filters are shared by all threads
      request = GenerationRequest.build(facts, params["prompt"], params["negative_prompt"], seed=params["seed"],
                                        **build_kwargs(params, mesh))
  except ValueError as e:
    raise ApiError(400, str(e), _field(str(e))) from e
  params["num_frames"] = request.num_frames
  notes = [] if asked == request.num_frames else [
      f"num_frames={asked} rounded to {request.num_frames}: Wan makes 4k + 1 frames"]
  trained = outside_training(facts, request.height, request.width, request.num_frames)
  return request, notes + ([] if trained is None else [trained])


def _field(message: str) -> str | None:
  """The API field a `GenerationRequest` message names first (its messages start "name=...")."""
  found = [(message.find(name), field) for name, field in FIELDS.items() if re.search(rf"\b{name}\b", message)]
  return min(found)[1] if found else None


def batch_key(params: dict[str, Any]) -> str:
  """Jobs with equal keys run as one batch: everything but the prompts, seed and output."""
  keep = ("width", "height", "num_frames", "num_inference_steps", "guidance_scale", "flow_shift", "lora")
  return repr(tuple((k, params[k]) for k in keep) + (("cfg", params["guidance_scale"] > 1),))


def video_object(row: dict[str, Any], model: str) -> dict[str, Any]:
  """The API's view of a job row (`store.JobStore`)."""
  p = row["params"]
  return VideoObject(
      id=row["id"], model=model, status=row["status"], progress=row["progress"], created_at=int(row["created_at"]),
      completed_at=None if row["completed_at"] is None else int(row["completed_at"]),
      size=f"{p['width']}x{p['height']}", seconds=f"{(p['num_frames'] - 1) / p['fps']:g}", prompt=p["prompt"],
      seed=p["seed"], num_frames=p["num_frames"], num_inference_steps=p["num_inference_steps"], step=row["step"],
      output_format=p["output_format"], timings=row["timings"] or {},
      error=None if row["error"] is None else {"code": "generation_failed", "message": row["error"]},
      batch_size=row["batch_size"], warnings=row.get("warnings") or []).model_dump()
