"""The HTTP API's bodies (OpenAI's Videos API, as the official SDK sends it: `multipart/form-data`, or
JSON) and the checks that turn a `VideoCreate` into a job: the text first (UTF-8 that can be stored
and sent back), the server's own limits, then the very `GenerationRequest.build` the `generate`
command and the Python call use, so a bad value gets the same message everywhere (`ApiError`,
naming the field, before anything is stored or queued).
"""

from __future__ import annotations

import math
import re
import reprlib
import unicodedata
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipelines.commands.presets import PRESETS, TINY_MODELS, model_preset
from pipelines.pipeline.checked.seed import random_seed
from pipelines.storage import video_io

JOB_ID = re.compile(r"video_[0-9a-f]{24}")
FORMATS = ("mp4", "gif", "npy")
MEDIA_TYPES = {"mp4": "video/mp4", "gif": "image/gif", "npy": "application/octet-stream"}
STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
# What a request may ask for at most (a server guards its devices before queueing anything).
MAX_SIDE = 2048
MAX_FRAMES = 257
MAX_STEPS = 500
# `GenerationRequest.build` arguments an API field of another name gives; every other argument is
# given by the field of its own name (`request_fields`).
SHARED_FIELDS = {"height": "size", "width": "size", "image": "input_reference", "video": "input_reference",
                 "reference_images": "input_reference"}
# A job's own values within a batch (the rest is the batch key, `batch_key`): prompts, seed, output.
PER_JOB = ("prompt", "negative_prompt", "seed", "fps", "output_format", "input_reference", "remixed_from_video_id")
# Characters no field may hold: C0 / C1 controls and DEL (tab, newline and carriage return allowed),
# lone surrogates (not UTF-8: nothing could send such a text back), the noncharacters U+FFFE / U+FFFF.
_ALLOWED_CONTROLS = "\t\n\r"
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
  """A request the server refuses: HTTP `status`, the field at fault (`param`), the message."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request"):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict[str, Any]:
    """OpenAI's error body (`ErrorBody`); the message made sendable (a lone surrogate quoted from a
    request becomes U+FFFD, never an encoding failure)."""
    kind = "invalid_request_error" if self.status < 500 else "server_error"
    kind = "authentication_error" if self.status == 401 else kind
    return {"error": {"message": sendable(self.message), "type": kind, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
  message: str
  type: str = Field(description="invalid_request_error, authentication_error or server_error")
  param: str | None = Field(None, description="the request field at fault")
  code: str | None = None


class ErrorBody(BaseModel):
  """OpenAI's error body: every status other than 2xx has it."""
  error: ErrorDetail


def sendable(text: Any) -> str:
  """`text` as a string that encodes as UTF-8 (lone surrogates replaced by U+FFFD)."""
  return _SURROGATE.sub("\ufffd", text if isinstance(text, str) else str(text))


def check_text(name: str, text: Any) -> None:
  """Refuses a text field a job could not store and send back, before anything is stored.

  Raises:
    ApiError: 400 naming `name`: a lone surrogate (not UTF-8), NUL, another control character
      (C0 / C1 / DEL; tab, newline and carriage return are allowed) or a noncharacter.
  """
  if not isinstance(text, str):
    return
  for i, ch in enumerate(text):
    if "\ud800" <= ch <= "\udfff":
      why = f"a lone surrogate U+{ord(ch):04X} (not UTF-8; a client sent a broken \\u escape)"
    elif ch == "\x00":
      why = "a NUL character"
    elif unicodedata.category(ch) == "Cc" and ch not in _ALLOWED_CONTROLS:
      why = f"the control character U+{ord(ch):04X}"
    elif ch in "\ufffe\uffff":
      why = f"the noncharacter U+{ord(ch):04X}"
    else:
      continue
    raise ApiError(400, f"{name} holds {why} at position {i}; send plain UTF-8 text", name)


def _typed(kind: Any, description: str, **more: Any) -> Any:
  """A field whose value reaches our own checks as sent (their messages name it), published in the
  schema as `kind` (a JSON Schema type, or a list of them)."""
  kinds = [kind] if isinstance(kind, str) else list(kind)
  return Field(None, description=description, json_schema_extra={"anyOf": [{"type": k} for k in kinds + ["null"]],
                                                                 **more})


class VideoCreate(BaseModel):
  """POST /v1/videos: a JSON object, or `multipart/form-data` (as the OpenAI SDK sends it; a form's
  numbers are read as this schema's types). `num_frames` wins over `seconds` x `fps`; neither: the
  model's default length. `lora` names LoRAs the server was started with, never a path.
  `input_reference`: the first frame of an image-to-video or TI2V model, an image file part, or
  {"image_url": "data:image/png;base64,..."}; or, for a text-to-video model, a video file to start
  from (video-to-video, `strength`); on a VACE model, a reference image (the subject or style the
  video shows) or the video VACE conditions on (e.g. a pose or depth video).
  """
  model_config = ConfigDict(extra="forbid")
  prompt: str = Field(description="what the video shows")
  negative_prompt: str | None = Field(None, description="what to steer away from (default: the model's)")
  model: str | None = Field(None, description="the served model's id (GET /v1/models), or absent")
  size: str | None = Field(None, description="WIDTHxHEIGHT, e.g. 64x64 or 832x480")
  seconds: Any = _typed(["string", "number"], "clip length in seconds (OpenAI sends a string, e.g. \"4\")")
  fps: Any = _typed("number", "frames per second (default: the model's, TI2V-5B 24, else 16)")
  num_frames: Any = _typed("integer", "frames, 4k + 1 (wins over seconds)")
  num_inference_steps: Any = _typed("integer", "denoising steps")
  guidance_scale: Any = _typed("number", "classifier-free guidance scale (> 1: with guidance; default: the "
                               "model's)")
  flow_shift: Any = _typed("number", "the flow-matching schedule's shift (default: the model's)")
  seed: Any = _typed("integer", "random seed, 0 <= seed < 2**63 (default: drawn)")
  strength: Any = _typed("number", "with a video input_reference (video-to-video): the share of the steps that "
                         "run, in (0, 1] (default 0.8)")
  context_frames: Any = _typed("integer", "a video longer than the model's trained clip in overlapping context "
                               "windows of this many frames, 4k + 1 (Wan: 81; default: one clip)")
  context_overlap: Any = _typed("integer", "with context_frames: frames neighbouring windows share at least, a "
                                "multiple of 4 (default: a quarter of the window)")
  context_fuse: Any = _typed("string", "with context_frames: \"pyramid\" or \"flat\" blend weights at every "
                             "step, or \"continue\": windows one after another, each given the frames it shares "
                             "with the one before (default: the model's)")
  output_format: Literal["mp4", "gif", "npy"] = "mp4"
  lora: list[str] = Field(default_factory=list, description="names of the server's LoRAs (serve --lora NAME=PATH)")
  input_reference: Any = Field(None, description="an image file part (the first frame; a VACE model's reference image) "
                               "or a video file part (video-to-video; a VACE model's video), or {\"image_url\": a "
                               "base64 data URL}", json_schema_extra={"anyOf": [
                                   {"type": "string", "format": "binary"},
                                   {"type": "object", "properties": {"image_url": {"type": "string"},
                                                                     "file_id": {"type": "string"}}},
                                   {"type": "null"}]})


class VideoRemix(BaseModel):
  """POST /v1/videos/{id}/remix: a new job from a finished one's video (video-to-video) with this
  prompt and the finished job's other settings."""
  model_config = ConfigDict(extra="forbid")
  prompt: str
  strength: Any = _typed("number", "the share of the steps that run, in (0, 1] (default 0.8)")


class VideoError(BaseModel):
  code: str
  message: str


class VideoObject(BaseModel):
  """A job as GET /v1/videos/{id} returns it: OpenAI's video object plus the run's details."""
  id: str
  object: Literal["video"] = "video"
  model: str
  status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
  progress: int = Field(description="percent of the denoising steps done")
  created_at: int = Field(description="Unix seconds")
  completed_at: int | None = None
  expires_at: int | None = Field(None, description="Unix seconds after which the video may be deleted "
                                 "(None: kept until deleted)")
  size: str
  seconds: str
  prompt: str
  remixed_from_video_id: str | None = None
  seed: int | None = None
  num_frames: int | None = None
  num_inference_steps: int | None = None
  step: int = 0
  output_format: str = "mp4"
  timings: dict[str, float] = Field(default_factory=dict)
  error: VideoError | None = None
  batch_size: int | None = None
  warnings: list[str] = Field(default_factory=list)
  input_reference_sha256: str | None = Field(None, description="SHA-256 of the first frame's pixels, when given")


class VideoList(BaseModel):
  object: Literal["list"] = "list"
  data: list[VideoObject]
  first_id: str | None = None
  last_id: str | None = None
  has_more: bool


class VideoDeleted(BaseModel):
  """DELETE /v1/videos/{id}: OpenAI's answer (`deleted` is always true) and the status the job had."""
  id: str
  object: Literal["video.deleted"] = "video.deleted"
  deleted: Literal[True] = True
  status: Literal["queued", "in_progress", "completed", "failed", "cancelled"] = Field(
      description="the job's status when it was deleted (queued or in_progress: it never finishes)")


class ModelObject(BaseModel):
  id: str
  object: Literal["model"] = "model"
  created: int
  owned_by: str = "wan-usp-jax"


class ModelList(BaseModel):
  object: Literal["list"] = "list"
  data: list[ModelObject]


def defaults(model: str) -> Any:
  """The sampling defaults of the served model (`commands.presets`): the tiny preset, or a folder's own
  (`model_preset`: its generation_defaults.json, else diffusers')."""
  return PRESETS["tiny"] if model in TINY_MODELS else model_preset(model)


def _size(text: str | None, preset: Any) -> tuple[int, int]:
  if text is None:
    return preset.width, preset.height
  match = re.fullmatch(r"(\d+)x(\d+)", text)
  if match is None:
    raise ApiError(400, f"size={reprlib.repr(text)} is malformed; write WIDTHxHEIGHT, e.g. 64x64 or 832x480", "size")
  # A side of more digits than the limit is too large without parsing it (int() refuses 4300 digits).
  if any(len(side.lstrip("0")) > len(str(MAX_SIDE)) or int(side) > MAX_SIDE for side in match.groups()):
    raise ApiError(400, f"size={reprlib.repr(text)} is too large: this server makes videos of at most {MAX_SIDE} "
                   "pixels a side (a job's latents, activations and decoded frames grow with its area, and the "
                   "server keeps them within its memory); send a smaller size, e.g. 832x480 or 1280x720", "size")
  return int(match.group(1)), int(match.group(2))


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
  for name in ("prompt", "negative_prompt", "model", "size", "seconds"):
    check_text(name, getattr(body, name))
  for name in body.lora:
    check_text("lora", name)
  for name in ("prompt", "negative_prompt"):
    text = getattr(body, name)
    if text is not None and len(text) > limit:
      raise ApiError(400, f"{name} holds {len(text)} characters; this server takes at most {limit}", name)
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


def _check_mp4_encoder() -> None:
  """An mp4 is refused up front where it could not be encoded (`video_io.mp4_encoder_problem`), not
  after its generation; gif and npy still work there."""
  problem = video_io.mp4_encoder_problem()
  if problem is not None:
    raise ApiError(400, f"output_format='mp4' (the default) is not available on this server: {problem}; "
                   "ask for output_format 'gif' or 'npy', or install imageio-ffmpeg where the server runs",
                   "output_format", code="unsupported")


def job_params(body: VideoCreate, *, model: str, loras: tuple[str, ...], max_prompt_chars: int,
               fps: float = 16.0) -> dict[str, Any]:
  """A request's values resolved (defaults filled, seed drawn when missing; `fps` when the body gives
  none: the model's frame rate), before the model checks.

  Raises:
    ApiError: a value outside the server's limits, an unknown LoRA name or model.
  """
  _check_text(body, max_prompt_chars)
  if body.model is not None and body.model != model:
    raise ApiError(400, f"model={body.model!r}: this server serves {model!r} only (GET /v1/models)", "model")
  body = body.model_copy(update={"fps": fps}) if body.fps is None else body
  _check_numbers(body)
  if body.output_format == "mp4":
    _check_mp4_encoder()
  unknown = [name for name in body.lora if name not in loras]
  if unknown or len(set(body.lora)) != len(body.lora):
    raise ApiError(400, f"lora={body.lora!r}: give each of the server's LoRAs at most once; it has "
                   f"{list(loras) or 'none'} (started with serve --lora NAME=PATH)", "lora")
  preset = defaults(model)
  width, height = _size(body.size, preset)
  built = build_defaults()
  given = {name: getattr(body, name) for name in request_fields()}
  return {name: built[name] if value is None else value for name, value in given.items()} | {
      "negative_prompt": preset.negative_prompt if body.negative_prompt is None else body.negative_prompt,
      "width": width, "height": height, "num_frames": _frames(body, preset),
      "num_inference_steps": preset.steps if body.num_inference_steps is None else body.num_inference_steps,
      "guidance_scale": preset.guidance[0] if body.guidance_scale is None else body.guidance_scale,
      "seed": random_seed() if body.seed is None else body.seed, "fps": body.fps,
      "output_format": body.output_format, "lora": sorted(body.lora)}


def build_defaults() -> dict[str, Any]:
  """`GenerationRequest.build`'s keyword arguments and their defaults (`call_options.build_defaults`;
  imported here on first use, so that this module loads without JAX's model code)."""
  from pipelines.pipeline.run.call_options import build_defaults as defaults_of_build

  return defaults_of_build()


def request_fields() -> tuple[str, ...]:
  """The `VideoCreate` fields named as a `GenerationRequest.build` argument: each is given to it by
  that name (its default when absent)."""
  return tuple(name for name in VideoCreate.model_fields if name in build_defaults())


def build_kwargs(params: dict[str, Any], mesh: Any) -> dict[str, Any]:
  """`GenerationRequest.build`'s keyword arguments of one job, by name (without the prompts and the
  seed, which a batch gives per job)."""
  own = {"prompt", "negative_prompt", "seed"}
  return {name: value for name, value in params.items() if name in build_defaults() and name not in own} | {
      "mesh": mesh}


def check_request(params: dict[str, Any], facts: Any, mesh: Any, reference: Any = None) -> tuple[Any, list[str]]:
  """The job's `GenerationRequest` (built as the Python call builds it; `reference`: the decoded
  input_reference, `references.Decoded`, or None), its values written back into `params` as
  resolved (frames rounded to 4k + 1), and the job's warnings: frames rounded, a size the model
  was not trained at (`ModelFacts.outside_training`), a video longer than its trained clip without
  context windows (`window_inputs.long_video_warning`).

  Raises:
    ApiError: the request's ValueError, with the API field it names.
  """
  from pipelines.pipeline.checked.request import GenerationRequest
  from pipelines.pipeline.checked.window_inputs import long_video_warning

  asked = params["num_frames"]
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # made again below: Python's warning filters are shared by all threads
      request = GenerationRequest.build(facts, params["prompt"], params["negative_prompt"], seed=params["seed"],
                                        **reference_kwargs(params, reference), **build_kwargs(params, mesh))
  except ValueError as e:
    raise ApiError(400, str(e), _field(str(e))) from e
  params["num_frames"] = request.num_frames
  notes = [] if asked == request.num_frames else [
      f"num_frames={asked} rounded to {request.num_frames}: Wan makes 4k + 1 frames"]
  trained = facts.outside_training(request.height, request.width, request.clip_frames)
  if trained is None and request.windows is None:
    trained = long_video_warning(facts, request.num_frames)  # a long clip: the window fields to use
  return request, notes + ([] if trained is None else [trained])


def reference_kwargs(params: dict[str, Any], reference: Any) -> dict[str, Any]:
  """`GenerationRequest.build`'s image or video arguments of a job's decoded input_reference."""
  if reference is None:
    return {}
  if reference.kind == "image":
    return {"image": reference.pixels}
  if reference.kind == "reference":  # a VACE model's reference image
    return {"reference_images": [reference.pixels]}
  return {"video": reference.pixels}


def _field(message: str) -> str | None:
  """The API field a `GenerationRequest` message names first (its messages start "name=...")."""
  fields = {name: SHARED_FIELDS.get(name, name) for name in build_defaults()}
  found = [(message.find(name), field) for name, field in fields.items()
           if re.search(rf"\b{name}\b", message) and field in VideoCreate.model_fields]
  return min(found)[1] if found else None


def batch_key(params: dict[str, Any]) -> str:
  """Jobs with equal keys run as one batch: everything but their own values (`PER_JOB`: the prompts,
  seed and output)."""
  shared = tuple((k, params[k]) for k in sorted(params) if k not in PER_JOB)
  reference = (params.get("input_reference") or {}).get("sha256")  # a batch shares one first frame or video
  return repr(shared + (("cfg", params["guidance_scale"] > 1), ("input_reference", reference)))


def video_object(row: dict[str, Any], model: str, retention_s: float | None = None) -> dict[str, Any]:
  """The API's view of a job row (`store.JobStore`), valid UTF-8 whatever the row holds: a row that
  cannot be read (written by another program, or by a version that stored broken text) is shown
  as a failed video saying so (`unreadable_object`), never an error for the whole list."""
  try:
    return _video_object(row, model, retention_s)
  except Exception as e:  # noqa: BLE001 -- one bad row must not hide the others
    return unreadable_object(row, model, e)


def _video_object(row: dict[str, Any], model: str, retention_s: float | None) -> dict[str, Any]:
  p = row["params"]
  completed = None if row["completed_at"] is None else int(row["completed_at"])
  expires = None if completed is None or retention_s is None else int(completed + retention_s)
  reference = p.get("input_reference") or {}
  return VideoObject(
      id=row["id"], model=model, status=row["status"], progress=row["progress"], created_at=int(row["created_at"]),
      completed_at=completed, expires_at=expires, size=f"{p['width']}x{p['height']}",
      seconds=f"{(p['num_frames'] - 1) / p['fps']:g}", prompt=sendable(p["prompt"]),
      remixed_from_video_id=p.get("remixed_from_video_id"), seed=p["seed"], num_frames=p["num_frames"],
      num_inference_steps=p["num_inference_steps"], step=row["step"], output_format=p["output_format"],
      timings=row["timings"] or {},
      error=None if row["error"] is None else {"code": "generation_failed", "message": sendable(row["error"])},
      batch_size=row["batch_size"], warnings=[sendable(w) for w in row.get("warnings") or []],
      input_reference_sha256=reference.get("sha256")).model_dump()


def unreadable_object(row: dict[str, Any], model: str, error: Exception) -> dict[str, Any]:
  """A failed `VideoObject` for a job row that cannot be shown, with what went wrong."""
  def number(name: str) -> int:
    value = row.get(name)
    return int(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0

  status = row.get("status") if row.get("status") in STATUSES else "failed"
  return VideoObject(
      id=sendable(str(row.get("id"))), model=model, status=status, progress=number("progress"),
      created_at=number("created_at"), size="0x0", seconds="0", prompt="", step=number("step"),
      error={"code": "unreadable_job", "message": sendable(f"this job's stored record cannot be read "
                                                           f"({type(error).__name__}: {error}); delete it")}
  ).model_dump()
