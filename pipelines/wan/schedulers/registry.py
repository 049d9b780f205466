"""The samplers by name (`generate --scheduler`, `scheduler=`) and by diffusers' `_class_name`, and the
flow shift each keeps under its own field name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipelines.wan.schedulers.dpm_solver import DPMSolverConfig
from pipelines.wan.schedulers.euler import FlowEulerConfig
from pipelines.wan.schedulers.unipc import UniPCConfig

SchedulerConfig = UniPCConfig | FlowEulerConfig | DPMSolverConfig

# The solvers by the names `generate --scheduler` and `scheduler=` take (Wan's `--sample_solver`
# names "unipc" and "dpm++"; "euler" is lightx2v's sampler for its distilled models).
SOLVERS = {"unipc": UniPCConfig, "euler": FlowEulerConfig, "dpm++": DPMSolverConfig}


def flow_shift(config: SchedulerConfig) -> float:
  """The config's flow shift (UniPC's and DPM++'s `flow_shift`, Euler's `shift`)."""
  return float(config.shift if isinstance(config, FlowEulerConfig) else config.flow_shift)


def with_flow_shift(config: SchedulerConfig, shift: float) -> SchedulerConfig:
  """The config with another flow shift."""
  field = "shift" if isinstance(config, FlowEulerConfig) else "flow_shift"
  return dataclasses.replace(config, **{field: float(shift)})


def solver_name(config: SchedulerConfig) -> str:
  """"unipc", "euler" or "dpm++"."""
  return next(name for name, cls in SOLVERS.items() if isinstance(config, cls))


def switch_solver(config: SchedulerConfig, name: str) -> SchedulerConfig:
  """The solver `name` ("unipc", "euler", "dpm++") with `config`'s training timesteps and flow shift
  and its own defaults otherwise (diffusers: `OtherScheduler.from_config(pipe.scheduler.config)`);
  `config` itself when it already is that solver.

  Raises:
    ValueError: an unknown name (naming the choices).
  """
  if name not in SOLVERS:
    raise ValueError(f"scheduler={name!r} must be one of {', '.join(SOLVERS)} (Wan's samplers: unipc, "
                     "dpm++; euler for distilled few-step models)")
  if isinstance(config, SOLVERS[name]):
    return config
  return with_flow_shift(SOLVERS[name](num_train_timesteps=config.num_train_timesteps), flow_shift(config))


def scheduler_config_from_dict(config: Mapping[str, Any]) -> SchedulerConfig:
  """Reads a diffusers `scheduler_config.json` dict, dispatching on `_class_name`.

  Raises:
    ValueError: a missing or unsupported `_class_name`, or unsupported settings.
  """
  name = config.get("_class_name")
  match name:
    case "UniPCMultistepScheduler":
      return UniPCConfig.from_config(config)
    case "FlowMatchEulerDiscreteScheduler":
      return FlowEulerConfig.from_config(config)
    case "DPMSolverMultistepScheduler":
      return DPMSolverConfig.from_config(config)
    case _:
      raise ValueError(f"unsupported scheduler {name=}; expected UniPCMultistepScheduler, "
                       "FlowMatchEulerDiscreteScheduler or DPMSolverMultistepScheduler")
