"""DPM-Solver++ multistep for flow matching (Wan's `--sample_solver dpm++`).

Numerical reference: diffusers `DPMSolverMultistepScheduler(use_flow_sigmas=True,
prediction_type="flow_prediction", flow_shift=s)`, algorithm "dpmsolver++" (Lu et al. 2022,
"DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic Models", arXiv:2211.01095,
multistep updates of section 4 / algorithm 2; "midpoint" and "heun" second-order variants as diffusers
names them). Wan's `FlowDPMSolverMultistepScheduler` (wan/utils/fm_solvers.py) is the same solver;
its `set_timesteps(sigmas=...)` is our `sigmas=` (shifted here, timesteps = int(sigma x 1000)).

Flow sigmas: alpha = 1 - sigma, lambda = log(alpha) - log(sigma); the model's flow prediction v
becomes x0 = x - sigma v. Step i goes sigmas[i] -> sigmas[i + 1] with h = lambda_{i+1} - lambda_i:
  order 1: x' = (sigma'/sigma) x - alpha' (e^-h - 1) x0_i
  order 2: ... - 0.5 alpha' (e^-h - 1) D1 (midpoint), D1 = (x0_i - x0_{i-1}) / r0, r0 = h_{i-1} / h
  order 3: ... + alpha' ((e^-h - 1)/h + 1) D1 - alpha' ((e^-h - 1 + h)/h^2 - 0.5) D2
As in `schedulers`, every coefficient depends only on the sigmas, so the host computes them per step
(float32, diffusers' operation order; transcendentals correctly rounded) and the device step is
x' = cx x - c0 m0 + cd1 D1 + cd2 D2 with zero coefficients for the terms a step's order does not use
(the history starts as zeros, so an unused term adds an exact zero).
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
_TABLES = ("cx", "c0", "cd1", "cd2", "a0", "a1", "k1", "k2")


@dataclasses.dataclass(frozen=True)
class DPMSolverConfig:
  """diffusers `DPMSolverMultistepScheduler` in flow mode, algorithm "dpmsolver++".

  Fixed, not fields: use_flow_sigmas=True, prediction_type="flow_prediction",
  algorithm_type="dpmsolver++" (the deterministic one), final_sigmas_type="zero", no thresholding,
  no karras/exponential/beta/lu sigmas, no dynamic shifting.
  """
  num_train_timesteps: int = 1000
  flow_shift: float = 1.0
  solver_order: int = 2
  solver_type: str = "midpoint"
  lower_order_final: bool = True
  euler_at_final: bool = False

  def __post_init__(self):
    flow_schedule.check_multistep(self.num_train_timesteps, self.flow_shift, self.solver_order)
    if self.solver_type not in ("midpoint", "heun"):
      raise ValueError(f"{self.solver_type=} must be 'midpoint' or 'heun'")

  @classmethod
  def from_config(cls, config: Mapping[str, Any]) -> DPMSolverConfig:
    """Reads a diffusers `scheduler_config.json` dict of a DPMSolverMultistepScheduler.

    Raises:
      ValueError: another scheduler class, or a setting this flow-only port does not implement.
    """
    name = config.get("_class_name", "DPMSolverMultistepScheduler")
    if name != "DPMSolverMultistepScheduler":
      raise ValueError(f"DPMSolverConfig.from_config got {name=}; use scheduler_config_from_dict")
    flow_only = {"use_flow_sigmas": True, "prediction_type": "flow_prediction",
                 "algorithm_type": "dpmsolver++", "final_sigmas_type": "zero"}
    missing = {k: v for k, v in flow_only.items() if k not in config and k != "final_sigmas_type"}
    if missing:  # diffusers' defaults are the non-flow ones (epsilon prediction on DDPM sigmas)
      raise ValueError(f"{name}: the config must set {missing} (diffusers' defaults are not flow matching)")
    flow_shift = {"thresholding": None, "use_karras_sigmas": None, "use_exponential_sigmas": None,
                  "use_beta_sigmas": None, "use_lu_lambdas": None, "use_dynamic_shifting": None,
                  "variance_type": None}
    flow_schedule.reject_settings(config, name, {**flow_only, **flow_shift})
    kw = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
    if "flow_shift" in kw:
      kw["flow_shift"] = float(kw["flow_shift"])
    return cls(**kw)

  def set_timesteps(self, num_inference_steps: int, sigmas: Sequence[float] | None = None) -> DPMSolverSchedule:
    """Host-side schedule, as `DPMSolverMultistepScheduler.set_timesteps` (flow-sigma branch).

    Args:
      num_inference_steps: N.
      sigmas: None (diffusers' schedule: shifted 1 - linspace(1, 1/1000, N + 1), the last dropped),
        or N unshifted sigmas (Wan's `FlowDPMSolverMultistepScheduler.set_timesteps(sigmas=)`;
        `flow_schedule.custom_sigmas` checks them), shifted here.

    Raises:
      ValueError: `num_inference_steps` < 1, or `sigmas` of another length.
    """
    n = num_inference_steps
    if n < 1:
      raise ValueError(f"{num_inference_steps=} must be >= 1")
    t_train = self.num_train_timesteps
    if sigmas is None:
      ramp = 1.0 - np.linspace(1, 1 / t_train, n + 1)  # float64, as diffusers
      sigmas = np.flip(flow_schedule.shift(ramp, self.flow_shift))[:-1].copy()
    else:
      sigmas = flow_schedule.shift(flow_schedule.given_sigmas(sigmas, n, np.float64), self.flow_shift)
    timesteps = (sigmas * t_train).astype(np.int64)  # torch `.to(int64)`: truncation
    sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
    return DPMSolverSchedule(config=self, timesteps=timesteps, sigmas=sigmas,
                             coefficients=_coefficients(self, sigmas))


def _orders(cfg: DPMSolverConfig, n: int, total: int | None = None) -> list[int]:
  """Each step's order, as diffusers' `step` picks it (warm-up, then the lower-order final steps:
  always first order into the zero final sigma); `total`: the full schedule's steps when these n
  are its tail (diffusers' "short schedule" test reads the full one)."""
  orders = []
  for i in range(n):
    short = cfg.lower_order_final and (n if total is None else total) < 15
    final = i == n - 1  # final_sigmas_type "zero" makes the last step first order whatever the rest
    second = i == n - 2 and short
    if cfg.solver_order == 1 or i < 1 or final:
      orders.append(1)
    elif cfg.solver_order == 2 or i < 2 or second:
      orders.append(2)
    else:
      orders.append(3)
  return orders


def _coefficients(cfg: DPMSolverConfig, sigmas: np.ndarray, total: int | None = None) -> dict[str, np.ndarray]:
  """float32 [N] tables of x' = cx x - c0 m0 + cd1 D1 + cd2 D2 with D1_0 = a0 (m0 - m1),
  D1_1 = a1 (m1 - m2), D1 = D1_0 + k1 (D1_0 - D1_1), D2 = k2 (D1_0 - D1_1), in diffusers' op order.

  Raises:
    ValueError: a non-finite coefficient (naming the table and the sigmas).
  """
  n = len(sigmas) - 1
  tables = {name: np.zeros((n,), np.float32) for name in _TABLES}
  lam = [flow_schedule.flow_lambda(s) for s in sigmas]
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    for i, order in enumerate(_orders(cfg, n, total)):
      alpha_t = _F32(_F32(1) - sigmas[i + 1])
      h = _F32(lam[i + 1] - lam[i])
      em1 = _F32(flow_schedule.exp32(_F32(-h)) - _F32(1))  # torch.exp(-h) - 1.0
      tables["cx"][i] = _F32(sigmas[i + 1] / sigmas[i])
      c0 = tables["c0"][i] = _F32(alpha_t * em1)
      heun_d1 = _F32(alpha_t * _F32(_F32(em1 / h) + _F32(1)))
      if order >= 2:
        r0 = _F32(_F32(lam[i] - lam[i - 1]) / h)
        tables["a0"][i] = _F32(_F32(1) / r0)
        if order == 2:
          tables["cd1"][i] = -_F32(_F32(0.5) * c0) if cfg.solver_type == "midpoint" else heun_d1
      if order == 3:
        r1 = _F32(_F32(lam[i - 1] - lam[i - 2]) / h)
        tables["a1"][i] = _F32(_F32(1) / r1)
        tables["k1"][i] = _F32(r0 / _F32(r0 + r1))
        tables["k2"][i] = _F32(_F32(1) / _F32(r0 + r1))
        tables["cd1"][i] = heun_d1
        h2 = _F32(np.float64(h) ** 2)
        tables["cd2"][i] = -_F32(alpha_t * _F32(_F32(_F32(_F32(em1 + h) / h2)) - _F32(0.5)))
  for name, table in tables.items():
    if not np.all(np.isfinite(table)):
      raise ValueError(f"non-finite DPM-Solver++ coefficient table {name!r} for sigmas {sigmas}")
  tables["orders"] = np.array(_orders(cfg, n, total), np.int32)
  return tables


@dataclasses.dataclass(frozen=True)
class DPMSolverSchedule:
  """Host-side DPM-Solver++ schedule.

  Attributes:
    timesteps: int64 [N], exactly `DPMSolverMultistepScheduler.timesteps` after `set_timesteps(N)`.
    sigmas: float32 [N + 1], ending in 0.
    coefficients: float32 [N] per-step tables (`_coefficients`); `orders` int32 [N].
  """
  config: DPMSolverConfig
  timesteps: np.ndarray
  sigmas: np.ndarray
  coefficients: dict[str, np.ndarray]

  def tail(self, start: int) -> DPMSolverSchedule:
    """The steps from `start` on, run by a fresh solver (video-to-video's strength; see
    `UniPCSchedule.tail`).

    Raises:
      ValueError: `start` outside [0, N).
    """
    flow_schedule.check_tail_start(start, len(self.timesteps))
    sigmas = self.sigmas[start:]
    return DPMSolverSchedule(config=self.config, timesteps=self.timesteps[start:], sigmas=sigmas,
                             coefficients=_coefficients(self.config, sigmas, total=len(self.timesteps)))

  def init_state(self, sample_shape: Sequence[int], dtype: Any = jnp.float32) -> DPMSolverState:
    """Fresh solver state; `dtype` is the history's (x0, fp32 in Wan: the sample's dtype)."""
    shape = tuple(sample_shape)
    return DPMSolverState(
        timesteps=flow_schedule.device_table(self.timesteps, np.int32),
        sigmas=flow_schedule.device_table(self.sigmas),
        coefficients={k: flow_schedule.device_table(v) for k, v in self.coefficients.items() if k != "orders"},
        step_index=flow_schedule.device_zeros((), jnp.int32),
        model_outputs=flow_schedule.device_zeros((max(self.config.solver_order, 1),) + shape, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DPMSolverState:
  """Device-side DPM-Solver++ state (a pytree; every field an array).

  Attributes:
    timesteps: int32 [N]; sigmas: float32 [N + 1]; coefficients: float32 [N] tables; each padded to
      `flow_schedule.table_length` rows (`flow_schedule.device_table`; the first N or N + 1 used).
    step_index: int32 [], the next step to take.
    model_outputs: [P, *sample shape] x0 predictions, newest last (P = solver_order).
  """
  timesteps: jax.Array
  sigmas: jax.Array
  coefficients: dict[str, jax.Array]
  step_index: jax.Array
  model_outputs: jax.Array

  def timestep(self) -> jax.Array:
    """int32 []: the timestep to give the model at the current step."""
    return self.timesteps[self.step_index]

  def step(self, model_output: jax.Array, sample: jax.Array) -> tuple[jax.Array, DPMSolverState]:
    """One multistep DPM-Solver++ step, as diffusers' `step` (deterministic).

    Args:
      model_output: [*shape] flow prediction at the current timestep, any float dtype.
      sample: [*shape] current sample (fp32 in Wan).

    Returns:
      (prev_sample float32 [*shape] (diffusers: the x0 dtype), new state).
    """
    i = self.step_index
    c = {k: v[i] for k, v in self.coefficients.items()}
    x0 = (sample - _mul(self.sigmas[i], model_output)).astype(self.model_outputs.dtype)
    hist = jnp.concatenate([self.model_outputs[1:], x0[None]], axis=0)
    m0 = hist[-1]
    x = sample.astype(jnp.float32)
    prev = _mul(c["cx"], x) - _mul(c["c0"], m0)
    if hist.shape[0] >= 2:
      d1 = _mul(c["a0"], m0 - hist[-2])
      if hist.shape[0] >= 3:
        diff = d1 - _mul(c["a1"], hist[-2] - hist[-3])
        prev = prev + _mul(c["cd1"], d1 + _mul(c["k1"], diff)) + _mul(c["cd2"], _mul(c["k2"], diff))
      else:
        prev = prev + _mul(c["cd1"], d1)
    return prev.astype(m0.dtype), dataclasses.replace(self, step_index=i + 1, model_outputs=hist)
