"""What `generate` keeps beside a checkpoint: the run record (`RUN_RECORD`: every flag that decides
the video, by dest, `recorded_flags`; `request_record`), `apply_resume` (flags read back from it), what
the video's tags and sidecar say of the run (`run_parameters`), and the checkpoint folder's decisions
(where it goes, when it is removed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from pipelines.cli.flags import RECORDED_GROUPS, build_parser, parse_guidance, parse_numbers, parse_size
from pipelines.commands import model_files
from pipelines.commands.flags import UsageError, parse_lora_arg
from pipelines.commands.presets import TINY_MODELS
from pipelines.parallel import estimate
from pipelines.storage import video_io
from pipelines.wan.pretrained import hub_id

from pipelines.cli.plan import Plan

RUN_RECORD = "generate.json"  # in a checkpoint folder: the recorded flags, for --resume
RECORD_FORMAT = 2  # 2: flags by dest (`recorded_flags`); 1 (no "format" key): by flag name, before
# Flags read from the record when not given, free to differ (where and how the video is written).
_FREE = ("out", "fps")
# Flags whose text has one canonical form (so "832*480" equals "832x480" and "5" equals "5.0").
_PATH_METAVARS = ("PATH", "FILE", "FOLDER", "DIR")


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


def _recorded_actions() -> list[argparse.Action]:
  """The flags that decide the video: those of `flags.RECORDED_GROUPS`, read from the parser."""
  groups = build_parser()._action_groups
  return [a for g in groups if g.title in RECORDED_GROUPS for a in g._group_actions]


def _numbers(text: str, flag: str) -> str:
  return ",".join(repr(v) for v in parse_numbers(text, flag))


def _canonical(action: argparse.Action, value: Any) -> Any:
  """A flag's value in the record's form: paths absolute (a Hub id or a tiny model's name as
  given), comma-separated numbers as `repr` floats, a step-cache spec and a size in one spelling."""
  flag = action.option_strings[0]
  if value is None or value == []:
    return value
  if action.metavar in _PATH_METAVARS:
    return [os.path.abspath(v) for v in value] if isinstance(value, list) else os.path.abspath(value)
  if action.metavar == "PATH[:SCALE]":
    return [f"{os.path.abspath(path)}:{scale!r}" for path, scale in (parse_lora_arg(v, flag) for v in value)]
  if action.dest == "model":
    return value if value in TINY_MODELS or hub_id(value) is not None else os.path.abspath(value)
  if action.dest == "size":
    return "x".join(map(str, parse_size(value)))
  if action.dest == "guidance_scale":
    values = parse_guidance(value)
    return _numbers(value, flag) if len(set(values)) > 1 else repr(values[0])  # one scale for both
  if action.dest in ("timesteps", "sigmas", "conditioning_scale"):
    return _numbers(value, flag)
  if action.dest == "step_cache":
    from pipelines.wan.step_cache import parse_step_cache
    return parse_step_cache(value, model="tiny").describe()
  return value


def recorded_flags(args: argparse.Namespace) -> dict[str, Any]:
  """Every flag that decides the video (`flags.RECORDED_GROUPS`), by its dest, in the record's
  form (`_canonical`): what `apply_resume` reads back."""
  return {a.dest: _canonical(a, getattr(args, a.dest)) for a in _recorded_actions()}


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
  if record.get("format") != RECORD_FORMAT:
    raise UsageError(f"--resume: {path} was written by an earlier version of generate, which named the flags "
                     "otherwise; rerun that command without --resume to start over (or continue it with that version)")
  if "checkpoint_dir" in given and os.path.abspath(args.checkpoint_dir) != os.path.abspath(args.resume):
    raise UsageError("--resume DIR continues the checkpoint in DIR; drop --checkpoint-dir (or give the same folder)")
  if args.no_checkpoint:
    raise UsageError("--resume continues a checkpointed run; drop --no-checkpoint")
  actions = _recorded_actions()
  # A flag the saved run left to its default (None: the preset's or the model's) may be given now: the
  # checkpoint's identity then decides (`resume.ResumeError` names what differs).
  differences = [f"{a.option_strings[0]}: saved {record.get(a.dest)!r}, given {_canonical(a, getattr(args, a.dest))!r}"
                 for a in actions if a.dest in given and record.get(a.dest) is not None
                 and _canonical(a, getattr(args, a.dest)) != record.get(a.dest)]
  if differences:
    raise UsageError(f"--resume {args.resume}: these flags differ from the saved run (leave them out to "
                     "use the saved values): " + "; ".join(differences))
  for dest in [a.dest for a in actions] + list(_FREE):
    if dest not in given and dest in record:
      setattr(args, dest, record[dest])
  args.checkpoint_dir = args.resume
  files_changed = model_files.changed(record.get("model_files") or {})
  if files_changed:
    raise UsageError(f"--resume {args.resume}: the saved run's model files are not the ones it ran on: "
                     + "; ".join(files_changed) + ". A changed file is another model: restore it, or remove "
                     f"{args.resume} and start a new run")


def flow_shift(request: Any) -> float:
  """The flow shift of the request's scheduler (UniPC's and DPM++'s `flow_shift`, Euler's `shift`)."""
  from pipelines.wan import schedulers
  return schedulers.flow_shift(request.scheduler)


def request_record(plan: Plan, request: Any) -> dict[str, Any]:
  """The run record (`apply_resume` reads it back): every flag that decides the video, by dest, as
  the plan recorded it (`recorded_flags`), with the seed the run drew, the output's path and frame
  rate, and a Hub model's resolved commit."""
  return plan.recorded | {"seed": request.seed, "out": os.path.abspath(plan.out), "fps": plan.fps,
                          "model_commit": plan.model_commit, "format": RECORD_FORMAT}


def run_parameters(plan: Plan, request: Any) -> dict[str, Any]:
  """What the video's tags and the sidecar say of the run: the run record with the values the
  request resolved from presets and the model (prompt, negative prompt, size, frames, steps,
  guidance, flow shift, sampler), and the model as run (not the output path)."""
  from pipelines.wan import schedulers

  g1, g2 = request.guidance
  negatives = request.negative_prompts
  return {k: v for k, v in request_record(plan, request).items() if k not in ("out", "format")} | {
      "prompt": request.prompts[0], "negative_prompt": negatives[0] if negatives else plan.asked("negative_prompt"),
      "model": plan.model if plan.files is None else None, "preset": plan.preset,
      "size": f"{request.width}x{request.height}", "num_frames": request.num_frames,
      "num_inference_steps": request.steps, "guidance_scale": [g1] if g1 == g2 else [g1, g2],
      "flow_shift": flow_shift(request), "scheduler": schedulers.solver_name(request.scheduler)}


def write_run_record(plan: Plan, request: Any, model_files: dict[str, Any] | None, directory: str) -> None:
  """`request_record` in the checkpoint folder, as `apply_resume` reads it (process 0; atomic), with
  the single files' digests ("model_files") when the model is single files."""
  os.makedirs(directory, exist_ok=True)
  record = request_record(plan, request) | ({} if model_files is None else {"model_files": model_files})
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
