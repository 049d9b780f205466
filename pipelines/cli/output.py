"""What `generate` writes and says: the lines before compute (`announce`), the video and its contact
sheet (`write_outputs`), the JSON sidecar (`sidecar`, its request fields from `records.run_parameters`)
and the summary line (`summary_line`).
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

from pipelines.cli import records
from pipelines.commands.versions import versions
from pipelines.parallel import estimate
from pipelines.storage import images, video_io
from pipelines.storage import video_tags
from pipelines.storage import contact_sheet

if TYPE_CHECKING:
  from pipelines.cli.plan import Plan
  from pipelines.cli.run_plan import Checked


def announce(checked: Checked) -> None:
  """Before compute (process 0 only): the drawn seed, the estimate of a long run, the checkpoint."""
  plan, request = checked.plan, checked.request
  if not plan.writes:
    return
  if plan.asked("seed") is None:
    print(f"generate: random seed {request.seed} (pass --seed {request.seed} to make this video again)",
          file=sys.stderr)
  line = estimate.long_run_line(records.run_estimate(request))
  if line is not None:
    print(f"generate: {line}", file=sys.stderr)
  if plan.checkpoint_dir is not None:
    every = "every step" if plan.checkpoint_every == 1 else f"every {plan.checkpoint_every} steps"
    print(f"generate: {'continuing the run saved in' if plan.resume else 'saving the denoising state to'} "
          f"{plan.checkpoint_dir} ({every}; an interrupted run continues with --resume "
          f"{plan.checkpoint_dir})", file=sys.stderr)


def mesh_text(request: Any) -> str:
  """The mesh as the model line and the summary line print it: "U=2,R=2, weights sharded"."""
  spec = request.plan.spec
  return str(spec) + (", weights sharded" if spec.shard_weights else "")


def write_outputs(plan: Plan, frames: Any, checked: Checked | None = None) -> tuple[str, str | None]:
  """The video (one [F, H, W, 3] float array) to --out, tagged with the run's prompt and parameters
  (`run_tags`) when `checked` is given, and, with --contact-sheet, its contact sheet; returns
  (video path, sheet path or None). See `video_io.write_video` for the errors."""
  tags = None if checked is None else run_tags(checked)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", video_io.FrameRateWarning)  # printed by plan_run, before compute
    out = video_io.write_video(frames, plan.out, fps=plan.fps, overwrite=plan.overwrite, metadata=tags)
  sheet = None
  if plan.contact_sheet:
    sheet = contact_sheet.write_contact_sheet([frames], contact_sheet.contact_sheet_path(out), overwrite=plan.overwrite)
  return out, sheet


def run_tags(checked: Checked) -> dict[str, str]:
  """The written video's text tags (`video_tags.metadata_tags`): the prompt, and as JSON the run's
  parameters (`records.run_parameters`: prompt, negative prompt, model, size, frames, steps, guidance,
  flow shift, seed, LoRAs, ...; not the output path) and the mesh (`mesh_text`)."""
  parameters = records.run_parameters(checked.plan, checked.request) | {"mesh": mesh_text(checked.request)}
  return video_tags.metadata_tags(parameters["prompt"], parameters)


def timings(load_s: float, pipeline: dict[str, float], write_s: float) -> dict[str, float]:
  """Seconds per stage. "total" is the whole command (load + pipeline + write), as the summary line
  prints it; the pipeline's own total (text encode to decode) stays as "pipeline"."""
  out = {"load": load_s, **pipeline, "write": write_s}
  out["pipeline"] = out.pop("total")
  out["total"] = out["load"] + out["pipeline"] + out["write"]
  return out


def sidecar(checked: Checked, result: Any, *, out: str, sheet: str | None, lora: Any, times: dict[str, float],
            cache: Any, warnings_seen: list[str]) -> dict[str, Any]:
  """The JSON sidecar of a written video: the run's parameters (`records.run_parameters`), the mesh,
  the video's shape, the pipeline's settings and timings, the cache, the checkpoint, the warnings; for
  single files each file's path, layout and SHA-256 ("model_files")."""
  import jax

  plan, request = checked.plan, checked.request
  asked = records.run_parameters(plan, request)
  frames, height, width = result.frames.shape[1:4]
  files = {} if checked.model_files is None else {"model_files": checked.model_files}
  return files | {
      "output": os.path.abspath(out), "prompt": asked["prompt"], "negative_prompt": asked["negative_prompt"],
      "seed": asked["seed"], "seed_drawn": plan.asked("seed") is None, "model": request.model.name,
      "model_commit": asked["model_commit"], "preset": asked["preset"],
      "mesh": {**request.plan.spec.describe(), "auto": checked.mesh_auto, "devices": checked.device_note,
               "processes": jax.process_count()},
      "video": {"frames": int(frames), "height": int(height), "width": int(width), "fps": plan.fps},
      "contact_sheet": None if sheet is None else os.path.abspath(sheet),
      "images": {name: images.describe(path) for name, path in (("image", plan.asked("image")),
                                                                      ("last_image", plan.asked("last_image")))
                 if path is not None},
      "settings": result.settings, "lora": lora, "timings_s": times,
      "compile_cache": cache.report(),
      "checkpoint": None if plan.checkpoint_dir is None else {
          "dir": os.path.abspath(plan.checkpoint_dir), "every": plan.checkpoint_every,
          "resumed_from_step": result.settings.get("resumed_from_step"), "kept": plan.keep_checkpoint},
      "warnings": list(warnings_seen), "versions": versions(),
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def summary_line(checked: Checked, result: Any, *, out: str, described: str, times: dict[str, float],
                 cache: Any) -> str:
  """"wrote OUT and OUT.json (F frames WxH @ FPS fps, seed S, mesh M) | load ..., total ...; cache"."""
  plan, request = checked.plan, checked.request
  frames, height, width = result.frames.shape[1:4]
  stages = [cache.stages[name] for name in ("decode", "decode_compile_ahead") if name in cache.stages]
  ahead = times.get("decode_compile_ahead", 0.0)
  if stages and all(s["hits"] == s["lookups"] for s in stages):  # every decoder program from the cache
    compiled = ""
  elif ahead:
    compiled = f" (the VAE's first compile, {fmt(ahead)}, ran beside the text encoder, step compile and loop)"
  else:
    compiled = " (decode includes the VAE's first compile)"
  return (f"generate: wrote {out} and {described} ({frames} frames {width}x{height} @ {plan.fps:g} fps, "
          f"seed {result.settings['seed']}, mesh {mesh_text(request)}) | load {fmt(times['load'])}, text encode "
          f"{fmt(times['text_encode'])}, compile {fmt(times['compile'])}, denoise "
          f"{fmt(times['denoise_per_step'])}/step x {result.settings.get('steps_run', request.steps)}, "
          f"decode {fmt(times['decode'])}, "
          f"total {fmt(times['total'])}{compiled}; {cache.summary()}"
          f"{_step_cache_note(result.settings.get('step_cache'))}")


def _step_cache_note(record: dict[str, Any] | None) -> str:
  """"; step cache SPEC skipped N/S steps" for the summary line, or "" when caching was off."""
  if not record:
    return ""
  return (f"; step cache {record['spec']} skipped {len(record['skipped_steps'])}/{len(record['metrics'])} "
          "steps")


def fmt(seconds: float) -> str:
  """"850 ms" below a second, "12.3 s" above."""
  return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
