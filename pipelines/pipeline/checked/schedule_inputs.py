"""A call's schedule checked against the model: the scheduler config (the model's, another solver's
or a given config, with a flow shift) and the step count (`GenerationRequest.build`)."""

from __future__ import annotations

from typing import Any

from pipelines.pipeline.checked.inputs import check_int, check_number
from pipelines.pipeline.checked.model_facts import ModelFacts
from pipelines.wan import schedulers

# flow_shift's accepted range: beyond it float32 sigmas collapse (s = 1e7 puts every sigma within
# 1e-7 of 1, s = 1e-30 every timestep at 0) and the solvers' tables turn singular (distinct sigmas
# run out near s = 3e4 at 50 steps); its ends give finite tables on every solver up to 1000 steps.
FLOW_SHIFT_RANGE = (0.01, 1000.0)


def check_schedule(model: ModelFacts, scheduler: Any, flow_shift: Any, num_inference_steps: Any, timesteps: Any,
                   sigmas: Any) -> tuple[Any, int]:
  """(scheduler config, steps): `scheduler_of`, and the step count checked against a custom schedule."""
  if num_inference_steps is not None:
    num_inference_steps = check_int("num_inference_steps", num_inference_steps, hint="; e.g. 50")
  config = scheduler_of(model, scheduler, flow_shift)
  steps, _ = schedulers.custom_sigmas(num_inference_steps, sigmas, timesteps, config.num_train_timesteps)
  if steps > config.num_train_timesteps:  # the tables are computed at build: O(steps) time and memory
    raise ValueError(f"num_inference_steps={steps} must be at most {config.num_train_timesteps}, the scheduler's "
                     "num_train_timesteps (more steps than trained noise levels sample no finer); Wan uses 40 to 50")
  return config, steps


def scheduler_of(model: ModelFacts, scheduler: Any, flow_shift: Any) -> Any:
  """The model's scheduler config, or the solver `scheduler` names ("unipc", "euler", "dpm++") or is
  (a `schedulers.SchedulerConfig`), with `flow_shift` applied (None: the config's)."""
  config = model.scheduler
  if isinstance(scheduler, str):
    config = schedulers.switch_solver(config, scheduler)
  elif scheduler is not None:
    if not isinstance(scheduler, schedulers.SchedulerConfig):
      raise ValueError(f"scheduler={scheduler!r} must be None (the model's), one of "
                       f"{', '.join(schedulers.SOLVERS)}, or a scheduler config (schedulers.UniPCConfig, ...)")
    config = scheduler
  if flow_shift is None:
    return config
  shift = check_number("flow_shift", flow_shift, positive=True, hint=" (Wan: 3.0 at 480p, 5.0 at 720p)")
  if not FLOW_SHIFT_RANGE[0] <= shift <= FLOW_SHIFT_RANGE[1]:
    raise ValueError(f"flow_shift={flow_shift!r} must be in [{FLOW_SHIFT_RANGE[0]:g}, {FLOW_SHIFT_RANGE[1]:g}]: "
                     "beyond, every sigma of the schedule rounds to 1 (or to 0) and the steps collapse into one "
                     "timestep (Wan uses 1 to 12: 3.0 at 480p, 5.0 at 720p)")
  return schedulers.with_flow_shift(config, shift)
