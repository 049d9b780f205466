"""What every flow-matching sampler shares: custom schedules, the flow shift, fp32 host scalars.

A custom schedule is diffusers' `set_timesteps(sigmas=...)` of its flow schedulers
(`FlowMatchEulerDiscreteScheduler`, `UniPCMultistepScheduler(use_flow_sigmas=True)`): N unshifted
sigmas in (0, 1], decreasing, that the scheduler shifts (sigma' = s sigma / (1 + (s - 1) sigma)) and
ends with a final sigma. A list of timesteps t_k in (0, num_train_timesteps] is the denoising step
list of Wan's distilled models (lightx2v `WanStepDistillScheduler`, `denoising_step_list`): the
same as sigmas = t_k / num_train_timesteps, so the model sees each step's shifted sigma x 1000
(e.g. [1000, 750, 500, 250] at shift 5 gives the model 1000, 937.5, 833.3, 625). diffusers' Euler
scheduler, given `timesteps=` alone, instead feeds them unshifted while it shifts the sigmas (and
warns that the two disagree); at shift 1 both readings are the same schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

F32 = np.float32


def scaled(c: jax.Array, x: jax.Array) -> jax.Array:
  """`c * x` for a 0-dim fp32 coefficient, with torch's rule that a 0-dim tensor does not promote:
  the coefficient is rounded to x's float dtype first (so bf16 x gives a bf16 product, as in diffusers)."""
  return c.astype(x.dtype) * x


def device_table(table: np.ndarray, dtype: Any = None) -> jax.Array:
  """A per-step schedule table as the device state holds it: `table` [N, ...] padded along its first
  axis to `table_length(N)` rows by repeating its last row (never read: a step reads rows up to its
  own index, and a step count never reaches the padding).

  Why: the jitted step takes the solver state as an argument, so the table's length is part of the
  compiled program's signature; padded, every step count up to 64 (and each power of two beyond)
  shares one program (a 4-step and a 50-step call compile the step once).
  """
  table = np.asarray(table if dtype is None else table.astype(dtype))
  pad = table_length(table.shape[0]) - table.shape[0]
  return jax.device_put(np.concatenate([table, np.repeat(table[-1:], pad, axis=0)]) if pad else table)


def device_zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """Zeros of a solver state on the default device, uncommitted as `jnp.zeros` makes them, by a
  transfer: `jnp.zeros` (and `jnp.asarray` of a host array) is a compiled program of its own, which
  a fresh process traces, lowers and looks up in the compile cache (tens of ms each on a TPU host)."""
  return jax.device_put(np.zeros(shape, np.dtype(dtype)))


def table_length(n: int) -> int:
  """The padded length of a schedule table of `n` rows: 64, or the next power of two above 64."""
  return max(64, 1 << (max(n, 1) - 1).bit_length())


def reject_settings(config: Mapping[str, Any], cls: str, expected: Mapping[str, Any]) -> None:
  """Raises ValueError naming every key of a diffusers config whose value this port does not implement."""
  bad = {k: config[k] for k, want in expected.items() if k in config and config[k] != want
         and not (want is None and config[k] in (None, False, 0))}
  if bad:
    raise ValueError(f"{cls}: unsupported scheduler settings {bad}; supported values are "
                     f"{ {k: expected[k] for k in bad} }")


def check_multistep(num_train_timesteps: int, flow_shift: float, solver_order: int) -> None:
  """The settings every multistep flow sampler's config checks (UniPC, DPM++).

  Raises:
    ValueError: num_train_timesteps < 1, flow_shift not > 0, or solver_order not 1, 2 or 3.
  """
  if num_train_timesteps < 1:
    raise ValueError(f"{num_train_timesteps=} must be >= 1")
  if not flow_shift > 0:
    raise ValueError(f"{flow_shift=} must be > 0")
  if solver_order not in (1, 2, 3):
    raise ValueError(f"{solver_order=} must be 1, 2 or 3")


def check_tail_start(start: int, steps: int) -> None:
  """A schedule's tail (`UniPCSchedule.tail`) starts at a step of it.

  Raises:
    ValueError: `start` outside [0, steps).
  """
  if not 0 <= start < steps:
    raise ValueError(f"start={start} must be in [0, {steps})")


def given_sigmas(sigmas: Sequence[float], n: int, dtype: Any) -> np.ndarray:
  """A copy of N sigmas in `dtype` (the caller checked their values with `custom_sigmas`).

  Raises:
    ValueError: not N of them.
  """
  sigmas = np.array(sigmas, dtype)
  if sigmas.shape != (n,):
    raise ValueError(f"sigmas of shape {sigmas.shape} for num_inference_steps={n}; give {n} sigmas")
  return sigmas


def log32(x: np.float32) -> np.float32:
  """fp32 log, correctly rounded (from float64), as torch's 0-dim `log` on CPU; log(0) = -inf."""
  with np.errstate(divide="ignore"):
    return F32(np.log(np.float64(x)))


def exp32(x: np.float32) -> np.float32:
  """fp32 exp, correctly rounded (from float64); exp(-inf) = 0."""
  with np.errstate(over="ignore"):
    return F32(np.exp(np.float64(x)))


def flow_lambda(sigma: np.float32) -> np.float32:
  """log-SNR of a flow sigma: log(1 - sigma) - log(sigma) (diffusers `_sigma_to_alpha_sigma_t`)."""
  return F32(log32(F32(1) - sigma) - log32(sigma))


def shift(sigmas: np.ndarray, flow_shift: float) -> np.ndarray:
  """s sigma / (1 + (s - 1) sigma) in sigmas' dtype (diffusers' static flow shift)."""
  return flow_shift * sigmas / (1 + (flow_shift - 1) * sigmas)


def custom_sigmas(num_inference_steps: Any, sigmas: Any, timesteps: Any,
                  num_train_timesteps: int) -> tuple[int, np.ndarray | None]:
  """Checks a schedule given as `sigmas` or `timesteps` and the step count.

  Args:
    num_inference_steps: the step count asked for, or None (50 without a custom schedule, else
      the schedule's length).
    sigmas: None, or N unshifted sigmas, each in (0, 1], strictly decreasing.
    timesteps: None, or N timesteps, each in (0, num_train_timesteps], strictly decreasing
      (lightx2v's `denoising_step_list`, e.g. [1000, 750, 500, 250]).

  Returns:
    (N, float64 [N] unshifted sigmas or None for the scheduler's own schedule).

  Raises:
    ValueError: both given, not 1-D numbers, empty, NaN/inf, out of range, not strictly decreasing,
      or a count that differs from `num_inference_steps`; each naming the values and the fix.
  """
  if sigmas is not None and timesteps is not None:
    raise ValueError("give either sigmas or timesteps, not both (timesteps t are sigmas t / "
                     f"{num_train_timesteps}; the scheduler shifts either)")
  given = sigmas if sigmas is not None else timesteps
  if given is None:
    return (50 if num_inference_steps is None else num_inference_steps), None
  name, top = ("sigmas", 1.0) if sigmas is not None else ("timesteps", float(num_train_timesteps))
  values = _numbers(name, given)
  if not np.all((values > 0) & (values <= top)):
    raise ValueError(f"{name}={given!r} must each lie in (0, {top:g}]; the final step to "
                     f"{'sigma' if name == 'sigmas' else 'timestep'} 0 is added by the scheduler")
  if np.any(np.diff(values) >= 0):
    raise ValueError(f"{name}={given!r} must be strictly decreasing (from noise to clean), e.g. "
                     + ("[1.0, 0.75, 0.5, 0.25]" if name == "sigmas" else "[1000, 750, 500, 250]"))
  if num_inference_steps is not None and num_inference_steps != len(values):
    raise ValueError(f"num_inference_steps={num_inference_steps} but {name}={given!r} holds {len(values)} values; "
                     f"leave num_inference_steps out (it is the {name}' count) or make them agree")
  return len(values), values if name == "sigmas" else values / num_train_timesteps


def _numbers(name: str, given: Any) -> np.ndarray:
  """float64 [N] of a non-empty 1-D sequence of finite real numbers (not bools, not strings)."""
  if isinstance(given, (str, bytes)) or not isinstance(given, (Sequence, np.ndarray)):
    raise ValueError(f"{name}={given!r} must be a list of numbers, e.g. [1000, 750, 500, 250]")
  if any(isinstance(v, (bool, np.bool_, str)) for v in given):
    raise ValueError(f"{name}={list(given)!r} must hold numbers only")
  try:
    values = np.asarray(given, np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"{name}={given!r} must be a flat list of numbers") from None
  if values.ndim != 1 or values.size == 0:
    raise ValueError(f"{name}={given!r} must be a non-empty flat list of numbers")
  if not np.all(np.isfinite(values)):
    raise ValueError(f"{name}={given!r} holds NaN/inf; give finite values")
  return values
