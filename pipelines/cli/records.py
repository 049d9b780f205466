"""What `generate` keeps beside a checkpoint: the run record (`RUN_RECORD`, the request for
`--resume`, built from the `GenerationRequest` by `request_record`), `apply_resume` (flags read back
from it), and the checkpoint folder's decisions (where it goes, when it is removed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from pipelines.cli.flags import build_parser, parse_guidance, parse_numbers, parse_size
from pipelines.commands import model_files
from pipelines.commands.flags import UsageError, parse_lora_arg
from pipelines.commands.presets import TINY_MODELS
from pipelines.parallel import estimate
from pipelines.storage import video_io
from pipelines.wan.pretrained import hub_id

from pipelines.cli.plan import Plan

RUN_RECORD = "generate.json"  # in a checkpoint folder: the request, for --resume
# Flags that decide the video: with --resume each is read from the record, and one given must match.
_RECORDED = ("prompt", "negative_prompt", "model", "preset", "size", "frames", "steps", "guidance", "shift",
             "seed", "dtype", "max_sequence_length", "lora", "lora_2", "step_cache", "quantize",
             "attention_exchange", "image", "last_image", "scheduler", "timesteps", "sigmas", "video", "strength",
             "mask", "reference_image", "conditioning_scale", "context_frames", "context_overlap", "context_fuse")
# The single files' flags: recorded (as `_RECORDED`) by a run of single files only, with the files'
# digests ("model_files": `model_files.describe`), so a resumed run checks it runs on the same bytes.
_RECORDED_FILES = ("transformer", "vae", "text_encoder", "tokenizer", "config")
# Flags read from the record when not given, free to differ (where and how the video is written).
_RECORDED_FREE = ("out", "fps")
# Facts the record holds that no flag sets: a Hub --model's resolved commit (None for any other model).
_RECORDED_FACTS = ("model_commit",)


def check_checkpoint_dir(directory: str) -> None:
  """A folder the checkpoint can go to: an existing folder, or a new one whose parent is a
  writable folder.

  Raises:
    UsageError: a file of that name, or a parent that is missing, not a folder or not writable.
  """
  if os.path.exists(directory):
    if not os.path.isdir(directory):
      raise UsageError(f"--checkpoint-dir {directory!r} is a file; give a folder (new or existing)")
    if not os.access(directory, os.W_OK | os.X_OK):
      raise UsageError(f"--checkpoint-dir {directory!r} is not writable")
    return
  parent = os.path.dirname(os.path.abspath(directory))
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
    raise UsageError(f"--checkpoint-dir {directory!r}: its parent {parent!r} is not a writable folder")


def given_flags(argv: list[str]) -> set[str]:
  """The destinations of the flags present in `argv` (not their defaults)."""
  parser = build_parser()  # (the description is --help's only)
  for action in parser._actions:
    action.default = argparse.SUPPRESS
  return set(vars(parser.parse_args(argv)))


def _normalized(name: str, value: Any) -> Any:
  """A flag's value in the record's form (so "832*480" equals "832x480", "5" equals 5.0)."""
  if value is None:
    return None
  if name == "size":
    return "x".join(map(str, parse_size(value))) if isinstance(value, str) else value
  if name == "guidance":
    values = list(parse_guidance(value)) if isinstance(value, str) else list(value)
    return values[:1] if len(values) == 2 and values[0] == values[1] else values  # one scale for both
  if name == "model":  # a Hub id as given (org/name[@revision]), a folder as its absolute path
    return value if value is None or value in TINY_MODELS or hub_id(value) is not None else os.path.abspath(value)
  if name in ("image", "last_image", "video", "mask") + _RECORDED_FILES:
    return os.path.abspath(value)
  if name == "reference_image":
    return [os.path.abspath(path) for path in value]
  if name == "conditioning_scale":
    return list(parse_numbers(value, "--conditioning-scale")) if isinstance(value, str) else [float(v) for v in value]
  if name in ("shift", "fps", "strength"):
    return float(value)
  if name in ("timesteps", "sigmas"):
    return list(parse_numbers(value, "--" + name)) if isinstance(value, str) else [float(v) for v in value]
  if name == "step_cache":
    from pipelines.wan.step_cache import parse_step_cache
    return parse_step_cache(value, model="tiny").describe() if isinstance(value, str) else value
  if name in ("lora", "lora_2"):
    return [f"{os.path.abspath(path)}:{scale!r}" for path, scale in
            (parse_lora_arg(text, "--" + name.replace("_", "-")) for text in value)]
  return value


def apply_resume(args: argparse.Namespace, given: set[str]) -> None:
  """`--resume DIR`: fills the flags not given from DIR's record; checks the given ones against it.

  Raises:
    UsageError: DIR holds no run record, or a given flag differs from it (naming each).
  """
  if args.resume is None:
    return
  from pipelines.pipeline.run import resume as resume_state

  path = os.path.join(args.resume, RUN_RECORD)
  if not os.path.isfile(path) or not resume_state.holds_checkpoint(args.resume):
    raise UsageError(f"--resume {args.resume!r} is not a saved run: it needs {RUN_RECORD} and "
                     f"{resume_state.STATE_FILE} (written by generate --checkpoint-dir, or for a long run "
                     "beside the output as OUT.resume)")
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    raise UsageError(f"--resume: {path} is unreadable ({e})") from e
  if "checkpoint_dir" in given and os.path.abspath(args.checkpoint_dir) != os.path.abspath(args.resume):
    raise UsageError("--resume DIR continues the checkpoint in DIR; drop --checkpoint-dir (or give the same folder)")
  if args.no_checkpoint:
    raise UsageError("--resume continues a checkpointed run; drop --no-checkpoint")
  differences = []
  for name in _RECORDED + _RECORDED_FILES:
    if name in given and _normalized(name, getattr(args, name)) != record.get(name):
      differences.append(f"--{name.replace('_', '-')}: saved {record.get(name)!r}, given "
                         f"{_normalized(name, getattr(args, name))!r}")
  if differences:
    raise UsageError(f"--resume {args.resume}: these flags differ from the saved run (leave them out to "
                     "use the saved values): " + "; ".join(differences))
  for name in _RECORDED + _RECORDED_FILES + _RECORDED_FREE:
    if name not in given and name in record:
      value = record[name]
      if name in ("guidance", "timesteps", "sigmas", "conditioning_scale") and value is not None:
        value = ",".join(repr(float(g)) for g in value)
      setattr(args, name, value)
  args.checkpoint_dir = args.resume
  files_changed = model_files.changed(record.get("model_files") or {})
  if files_changed:
    raise UsageError(f"--resume {args.resume}: the saved run's model files are not the ones it ran on: "
                     + "; ".join(files_changed) + ". A changed file is another model: restore it, or remove "
                     f"{args.resume} and start a new run")


@dataclasses.dataclass(frozen=True)
class RunFacts:
  """What the run record and the sidecar hold besides the request: the command's own facts.

  Attributes:
    model: --model as given ("tiny", "tiny-random", a folder or a Hub id org/name[@revision]), None for
      single files.
    model_commit: a Hub --model's resolved commit, or None.
    preset: the --preset applied, or None.
    out: --out; fps: frames per second of the output.
    loras: (path, scale, expert 0 or 1), in loading order.
    negative_prompt: --negative-prompt (the request drops it when guidance is off).
    image, last_image: --image / --last-image paths (their contents' digests are in the request).
    video: the --video path (its frames' digest and the strength are in the request).
    mask, reference_images: VACE's --mask and --reference-image paths (digests in the request).
    conditioning_scale: --conditioning-scale, one float or a tuple of floats.
    files: the single files (a `wan.pretrained.Sources`; model None), or None.
    model_files: the single files' `model_files.describe` (path, layout, SHA-256), or None.
  """
  model: str | None
  preset: str | None
  out: str
  fps: float
  loras: tuple[tuple[str, float, int], ...]
  negative_prompt: str
  image: str | None = None
  last_image: str | None = None
  video: str | None = None
  mask: str | None = None
  reference_images: tuple[str, ...] = ()
  conditioning_scale: Any = 1.0
  model_commit: str | None = None
  files: Any = None
  model_files: dict[str, Any] | None = None

  @classmethod
  def of(cls, plan: Plan, model_files: dict[str, Any] | None = None) -> RunFacts:
    return cls(model=plan.model, model_commit=plan.model_commit, files=plan.files, model_files=model_files,
               preset=plan.preset, out=plan.out, fps=plan.fps, loras=plan.loras,
               negative_prompt=plan.negative_prompt, image=plan.image, last_image=plan.last_image,
               video=plan.video, mask=plan.mask, reference_images=plan.reference_images,
               conditioning_scale=plan.conditioning_scale)


def flow_shift(request: Any) -> float:
  """The flow shift of the request's scheduler (UniPC's and DPM++'s `flow_shift`, Euler's `shift`)."""
  from pipelines.wan import schedulers
  return schedulers.flow_shift(request.scheduler)


def request_record(request: Any, facts: RunFacts) -> dict[str, Any]:
  """The request as the run record holds it (`apply_resume` reads it back; the sidecar takes its
  prompt, negative prompt, seed and preset from it): every value from the `GenerationRequest`,
  in the flags' form, and the command's own facts.

  Returns: a JSON-able dict, keys `_RECORDED` + `_RECORDED_FREE` + `_RECORDED_FACTS` (+ `_RECORDED_FILES`
    for single files).
  """
  g1, g2 = request.guidance
  record = {"prompt": request.prompts[0],
            "negative_prompt": request.negative_prompts[0] if request.negative_prompts else facts.negative_prompt,
            "model": _normalized("model", facts.model), "model_commit": facts.model_commit,
            "preset": facts.preset,
            "size": f"{request.width}x{request.height}", "frames": request.num_frames, "steps": request.steps,
            "guidance": [g1] if g1 == g2 else [g1, g2], "shift": flow_shift(request), "seed": request.seed,
            "dtype": request.model.dtype, "max_sequence_length": request.max_sequence_length,
            "out": os.path.abspath(facts.out), "fps": facts.fps}
  for name, expert in (("lora", 0), ("lora_2", 1)):
    record[name] = [f"{os.path.abspath(path)}:{scale!r}" for path, scale, e in facts.loras if e == expert]
  record["step_cache"] = None if request.step_cache is None else request.step_cache.describe()
  record["quantize"] = request.model.quantize
  record["attention_exchange"] = request.plan.attention_exchange
  for name in ("image", "last_image", "video", "mask"):
    record[name] = _normalized(name, getattr(facts, name))
  record["reference_image"] = _normalized("reference_image", facts.reference_images)
  scale = facts.conditioning_scale
  record["conditioning_scale"] = _normalized("conditioning_scale", scale if isinstance(scale, tuple) else (scale,))
  record["strength"] = None if request.video is None else request.video.strength
  windows = request.windows
  frames, overlap = (None, None) if windows is None else windows.video_frames(request.model.temporal_factor)
  record["context_frames"], record["context_overlap"] = frames, overlap
  record["context_fuse"] = "pyramid" if windows is None else windows.fuse
  from pipelines.wan import schedulers
  record["scheduler"] = schedulers.solver_name(request.scheduler)
  record["timesteps"] = None if request.timesteps is None else list(request.timesteps)
  record["sigmas"] = None if request.sigmas is None else list(request.sigmas)
  if facts.files is not None:
    record.update({name: _normalized(name, getattr(facts.files, name)) for name in _RECORDED_FILES})
  return record


def write_run_record(request: Any, facts: RunFacts, directory: str) -> None:
  """`request_record` in the checkpoint folder, as `apply_resume` reads it (process 0; atomic), with
  the single files' digests ("model_files") when the model is single files."""
  os.makedirs(directory, exist_ok=True)
  record = request_record(request, facts) | ({} if facts.model_files is None else {"model_files": facts.model_files})
  video_io.write_json(record, os.path.join(directory, RUN_RECORD), overwrite=True)


def saved_files(plan: Plan) -> dict[str, Any] | None:
  """A resumed run's recorded `model_files` (their digests, reused for files of the same size and
  mtime: hashed once), or None."""
  if not plan.resume or plan.checkpoint_dir is None:
    return None
  try:
    with open(os.path.join(plan.checkpoint_dir, RUN_RECORD), encoding="utf-8") as f:
      return json.load(f).get("model_files")
  except (OSError, ValueError):
    return None


def run_estimate(request: Any) -> estimate.Estimate:
  """The modelled time of the request on this backend (`pipelines.parallel.estimate`)."""
  import jax
  return estimate.estimate(
      request.model.transformer, request.token_facts, frames=request.num_frames, height=request.height,
      width=request.width, steps=request.steps, cfg=request.cfg, dtype=request.model.dtype,
      backend=jax.default_backend(), devices=request.plan.spec.devices)


def default_checkpoint_dir(out: str) -> str:
  """Where a long run keeps its denoising checkpoint: OUT.resume beside the output."""
  return os.path.normpath(out) + ".resume"



def plan_checkpoint(plan: Plan, request: Any) -> Plan:
  """Decides the checkpoint folder (given, or by default for a long run) and refuses one that
  already holds a saved run unless resuming it.

  Raises:
    UsageError: the folder holds a saved run and this is not --resume.
  """
  from pipelines.pipeline.run import resume as resume_state

  directory = plan.checkpoint_dir
  if directory is None and plan.checkpoint_default and run_estimate(request).seconds >= estimate.LONG_S:
    directory = default_checkpoint_dir(plan.out)
  if directory is not None and not plan.resume and os.path.exists(resume_state.state_path(directory)):
    raise UsageError(f"{directory} holds a saved denoising run; continue it with --resume {directory}, "
                     "or remove that folder to start over")
  return dataclasses.replace(plan, checkpoint_dir=directory)


def remove_checkpoint(directory: str) -> None:
  """The saved run in `directory` (state and record), and the folder if that empties it."""
  from pipelines.pipeline.run import resume as resume_state

  record = os.path.join(directory, RUN_RECORD)
  if os.path.exists(record):
    os.remove(record)
  resume_state.remove(directory)


def tidy_checkpoint(plan: Plan | None) -> None:
  """A run stopped before its first checkpoint: its folder holds only the run record; removed, so
  no folder that cannot be resumed is left behind (process 0 only)."""
  from pipelines.pipeline.run import resume as resume_state

  if (plan is None or plan.checkpoint_dir is None or plan.resume or not plan.writes
      or os.path.exists(resume_state.state_path(plan.checkpoint_dir))):
    return
  remove_checkpoint(plan.checkpoint_dir)


def resume_hint(plan: Plan | None) -> str:
  """"; the denoising state is saved: continue with ..." when a checkpoint is on disk."""
  from pipelines.pipeline.run import resume as resume_state

  if plan is None or plan.checkpoint_dir is None or not os.path.exists(resume_state.state_path(plan.checkpoint_dir)):
    return ""
  return f"; the denoising state is saved: continue with generate --resume {plan.checkpoint_dir}"
