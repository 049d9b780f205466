"""diffusers' `FlowMatchEulerDiscreteScheduler` (static shift) as a host schedule and a device state:
the sampler of distilled few-step models (lightx2v). Host/device split as in `unipc`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.wan.schedulers import flow_schedule

_F32 = flow_schedule.F32
_mul = flow_schedule.scaled
_reject = flow_schedule.reject_settings


@dataclasses.dataclass(frozen=True)
class FlowEulerConfig:
  """diffusers `FlowMatchEulerDiscreteScheduler` with a static shift (no dynamic shifting)."""
  num_train_timesteps: int = 1000
  shift: float = 1.0

  def __post_init__(self):
    if self.num_train_timesteps < 1:
      raise ValueError(f"{self.num_train_timesteps=} must be >= 1")
    if not self.shift > 0:
      raise ValueError(f"{self.shift=} must be > 0")

  @classmethod
  def from_config(cls, config: Mapping[str, Any]) -> "FlowEulerConfig":
    """Reads a diffusers FlowMatchEulerDiscreteScheduler config dict.

    Raises:
      ValueError: another scheduler class or an unsupported setting.
    """
    name = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if name != "FlowMatchEulerDiscreteScheduler":
      raise ValueError(f"FlowEulerConfig.from_config got {name=}; use scheduler_config_from_dict")
    _reject(config, name, {
        "use_dynamic_shifting": None, "invert_sigmas": None, "shift_terminal": None,
        "use_karras_sigmas": None, "use_exponential_sigmas": None, "use_beta_sigmas": None,
        "stochastic_sampling": None})
    return cls(num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
               shift=float(config.get("shift", 1.0)))

  def set_timesteps(self, num_inference_steps: int, sigmas: Sequence[float] | None = None) -> "FlowEulerSchedule":
    """Host-side schedule, as `FlowMatchEulerDiscreteScheduler.__init__` + `set_timesteps`.

    Note diffusers shifts twice: sigma_max/min come from the already shifted training sigmas and
    the linspace between them is shifted again. Reproduced as is, since it defines the reference.
    Given `sigmas` (N unshifted, diffusers' `sigmas=`) are cast to float32 and shifted once.

    Raises:
      ValueError: `num_inference_steps` < 1, or `sigmas` of another length.
    """
    n = num_inference_steps
    if n < 1:
      raise ValueError(f"{num_inference_steps=} must be >= 1")
    t_train = self.num_train_timesteps
    shift = self.shift
    if sigmas is None:
      train = np.linspace(1, t_train, t_train, dtype=np.float32)[::-1]
      train = (train / _F32(t_train)).astype(np.float32)
      train = (_F32(shift) * train / (_F32(1) + _F32(shift - 1) * train)).astype(np.float32)
      sigma_max, sigma_min = float(train[0]), float(train[-1])
      timesteps = np.linspace(sigma_max * t_train, sigma_min * t_train, n)  # float64
      sigmas = timesteps / t_train
    else:
      sigmas = flow_schedule.given_sigmas(sigmas, n, np.float32)
    sigmas = flow_schedule.shift(sigmas, shift).astype(np.float32)
    timesteps = (sigmas * _F32(t_train)).astype(np.float32)
    sigmas = np.concatenate([sigmas, np.zeros((1,), np.float32)])
    return FlowEulerSchedule(config=self, timesteps=timesteps, sigmas=sigmas)


@dataclasses.dataclass(frozen=True)
class FlowEulerSchedule:
  """Host-side Euler schedule: timesteps float32 [N] and sigmas float32 [N + 1] (ending in 0)."""
  config: FlowEulerConfig
  timesteps: np.ndarray
  sigmas: np.ndarray

  def tail(self, start: int) -> "FlowEulerSchedule":
    """The steps from `start` on (video-to-video's strength; Euler keeps no history).

    Raises:
      ValueError: `start` outside [0, N).
    """
    flow_schedule.check_tail_start(start, len(self.timesteps))
    return FlowEulerSchedule(config=self.config, timesteps=self.timesteps[start:], sigmas=self.sigmas[start:])

  def init_state(self, sample_shape: Sequence[int] = (), dtype: Any = jnp.float32) -> "FlowEulerState":
    """Fresh state (Euler keeps no history; the arguments exist to match `UniPCSchedule`)."""
    del sample_shape, dtype
    return FlowEulerState(timesteps=flow_schedule.device_table(self.timesteps),
                          sigmas=flow_schedule.device_table(self.sigmas),
                          step_index=flow_schedule.device_zeros((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FlowEulerState:
  """Device-side Euler state: timesteps float32 [N], sigmas float32 [N + 1] (each padded to
  `flow_schedule.table_length` rows by `flow_schedule.device_table`), step_index int32 []."""
  timesteps: jax.Array
  sigmas: jax.Array
  step_index: jax.Array

  def timestep(self) -> jax.Array:
    """float32 []: the timestep to give the model at the current step."""
    return self.timesteps[self.step_index]

  def step(self, model_output: jax.Array, sample: jax.Array) -> tuple[jax.Array, "FlowEulerState"]:
    """x <- x + (sigma_next - sigma) * v, as diffusers' `step` (deterministic branch).

    The sample is upcast to fp32 and the result cast to model_output's dtype, as diffusers does.
    """
    i = self.step_index
    dt = self.sigmas[i + 1] - self.sigmas[i]
    prev = sample.astype(jnp.float32) + _mul(dt, model_output)
    return prev.astype(model_output.dtype), dataclasses.replace(self, step_index=i + 1)
