"""UniPC multistep with flow sigmas, Wan's default sampler (the package's siblings: `euler`,
`dpm_solver`, `flow_schedule` for custom schedules, `registry` for the solvers by name).

Numerical references (diffusers): `UniPCMultistepScheduler` with `use_flow_sigmas=True`,
`prediction_type="flow_prediction"` (the scheduler Wan ships: bh2, order 2, predict x0, lower-order
final, final sigma 0), and `FlowMatchEulerDiscreteScheduler`. UniPC is Zhao et al. 2023,
"UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion Models" (B(h) variants
bh1: B(h) = h, bh2: B(h) = e^h - 1, section 3.3 / appendix).

Split between host and device:
- `*Config.set_timesteps(n)` builds a `*Schedule` on host with numpy, computing timesteps and sigmas
  exactly as diffusers does (float64 then float32 sigmas; UniPC timesteps truncated to int64, Euler
  timesteps float32). Every UniPC solver coefficient depends only on the sigmas, so they are also
  precomputed here, per step, in float32 with the same operation order as diffusers' 0-dim torch
  tensors (transcendentals rounded from float64, i.e. correctly rounded like glibc's logf/expm1f).
- `schedule.init_state(sample_shape)` gives a `*State` pytree (jnp arrays: the tables, an int32
  step index and, for UniPC, the model-output history), and `state.step(model_output, sample)` is a
  pure function returning `(prev_sample, new_state)`: jit it inside the denoise step, or run it in
  `lax.scan` / `fori_loop` (the step index may be traced; nothing is a Python branch).

The pipeline drives step k with `state.timestep()` (== `schedule.timesteps[k]`) like WanPipeline,
which calls `set_begin_index(0)`, so step k always uses sigmas[k] -> sigmas[k + 1].

Samples: any shape (video latents are [B, C, F, Hl, Wl]); elementwise, so any sharding passes through.
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
_log32 = flow_schedule.log32
_lambda = flow_schedule.flow_lambda


# --- UniPC (flow) ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class UniPCConfig:
  """diffusers `UniPCMultistepScheduler` in flow mode (the only mode Wan uses).

  Fixed, not fields: use_flow_sigmas=True, prediction_type="flow_prediction", predict_x0=True,
  no thresholding, no karras/exponential/beta sigmas, no dynamic shifting, no solver_p.
  """
  num_train_timesteps: int = 1000
  flow_shift: float = 1.0
  solver_order: int = 2
  solver_type: str = "bh2"
  lower_order_final: bool = True
  final_sigmas_type: str = "zero"
  disable_corrector: tuple[int, ...] = ()

  def __post_init__(self):
    flow_schedule.check_multistep(self.num_train_timesteps, self.flow_shift, self.solver_order)
    if self.solver_type not in ("bh1", "bh2"):
      raise ValueError(f"{self.solver_type=} must be 'bh1' or 'bh2'")
    if self.final_sigmas_type not in ("zero", "sigma_min"):
      raise ValueError(f"{self.final_sigmas_type=} must be 'zero' or 'sigma_min'")
    if self.final_sigmas_type == "zero" and not self.lower_order_final and self.solver_order > 1:
      # With sigma_next = 0, lambda = +inf and a multistep predictor divides by an infinite step:
      # diffusers returns inf/NaN there. Lower-order final makes the last step first order (-> x0).
      raise ValueError(f"{self.lower_order_final=} with final_sigmas_type='zero' and "
                       f"{self.solver_order=} gives NaN at the last step; set lower_order_final=True")

  @classmethod
  def from_config(cls, config: Mapping[str, Any]) -> "UniPCConfig":
    """Reads a diffusers `scheduler/scheduler_config.json` dict of a UniPCMultistepScheduler.

    Raises:
      ValueError: another scheduler class, or a setting this flow-only port does not implement.
    """
    name = config.get("_class_name", "UniPCMultistepScheduler")
    if name != "UniPCMultistepScheduler":
      raise ValueError(f"UniPCConfig.from_config got {name=}; use scheduler_config_from_dict")
    _reject(config, name, {
        "use_flow_sigmas": True, "prediction_type": "flow_prediction", "predict_x0": True,
        "thresholding": None, "use_karras_sigmas": None, "use_exponential_sigmas": None,
        "use_beta_sigmas": None, "use_dynamic_shifting": None, "solver_p": None,
        "shift_terminal": None, "sigma_min": None, "sigma_max": None})
    kw = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
    kw["disable_corrector"] = tuple(kw.get("disable_corrector", ()))
    if "flow_shift" in kw:
      kw["flow_shift"] = float(kw["flow_shift"])
    return cls(**kw)

  def set_timesteps(self, num_inference_steps: int, sigmas: Sequence[float] | None = None) -> "UniPCSchedule":
    """Host-side schedule, as `UniPCMultistepScheduler.set_timesteps` (flow-sigma branch).

    Args:
      num_inference_steps: N.
      sigmas: None, or N unshifted sigmas (diffusers' `sigmas=`; `flow_schedule.custom_sigmas`
        checks them), shifted here as diffusers does.

    Raises:
      ValueError: `num_inference_steps` < 1, or `sigmas` of another length.
    """
    n = num_inference_steps
    if n < 1:
      raise ValueError(f"{num_inference_steps=} must be >= 1")
    t_train = self.num_train_timesteps
    if sigmas is None:
      sigmas = np.linspace(1, 1 / t_train, n + 1)[:-1]  # float64, as diffusers
    sigmas = flow_schedule.given_sigmas(sigmas, n, np.float64)
    sigmas = flow_schedule.shift(sigmas, self.flow_shift)
    if np.fabs(sigmas[0] - 1) < 1e-6:  # diffusers: keep log(alpha) finite at sigma = 1
      sigmas[0] -= 1e-6
    timesteps = (sigmas * t_train).astype(np.int64)  # torch `.to(int64)`: truncation
    sigma_last = 0.0 if self.final_sigmas_type == "zero" else sigmas[-1]
    sigmas = np.concatenate([sigmas, [sigma_last]]).astype(np.float32)
    return UniPCSchedule(config=self, timesteps=timesteps, sigmas=sigmas,
                         coefficients=_unipc_coefficients(self, sigmas))


def _bh_terms(cfg: UniPCConfig, h: np.float32, order: int, rks: list[np.float32]):
  """h_phi_1, B(h), R [order, order] and b [order] of the UniPC B(h) update, in diffusers' op order."""
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    hh = _F32(-h)  # predict_x0
    h_phi_1 = _F32(np.expm1(np.float64(hh)))
    h_phi_k = _F32(h_phi_1 / hh - _F32(1))
    b_h = hh if cfg.solver_type == "bh1" else h_phi_1
    rks_arr = np.array(rks + [_F32(1)], np.float32)
    r_rows, b = [], []
    factorial = 1
    for i in range(1, order + 1):
      r_rows.append(rks_arr ** _F32(i - 1))
      b.append(_F32(h_phi_k * _F32(factorial) / b_h))
      factorial *= i + 1
      h_phi_k = _F32(h_phi_k / hh - _F32(1 / factorial))
  return h_phi_1, b_h, np.stack(r_rows).astype(np.float32), np.array(b, np.float32)


def _orders(cfg: UniPCConfig, n: int) -> list[int]:
  """The solver order of each of n steps, as diffusers' `step` picks it: the warm-up
  (lower_order_nums == min(i, order) before step i) and, with `lower_order_final`, the cap at the
  number of steps left."""
  caps = [min(cfg.solver_order, n - i) if cfg.lower_order_final else cfg.solver_order for i in range(n)]
  return [min(cap, i + 1) for i, cap in enumerate(caps)]


def _zero_step_rks(cfg: UniPCConfig, order: int, n: int) -> list[np.float32]:
  """The history ratios rk standing in for diffusers' at a predictor step with h = 0.

  With `final_sigmas_type="sigma_min"` the last sigma repeats the one before, so the last
  predictor has h = lambda_t - lambda_s0 = 0. diffusers (`multistep_uni_p_bh_update`) then gets
  h_phi_1 = B(h) = expm1(-0) = -0 and rk = (lambda_k - lambda_s0) / 0 = -inf, D_k = (m_k - m0) / rk
  = 0, so x_t = (sigma_t / sigma_s0) x - alpha_t * h_phi_1 * m0 - alpha_t * B(h) * rho . D = x: the
  predictor returns the (corrected) sample it starts from, for order 1 and order 2 (rho = 0.5). The tables reproduce that with
  cx = 1, cm0 = cres = -0 (computed as usual) and rk = 1 (finite) in place of -inf.

  Raises:
    ValueError: order >= 3 at that step: diffusers solves for rho with b = (0/0 - 1) / B(h) = NaN
      and returns NaN, so there is nothing finite to match; the message names the fixes.
  """
  if order >= 3:
    raise ValueError(
        f"UniPCConfig(final_sigmas_type='sigma_min', lower_order_final={cfg.lower_order_final}, "
        f"solver_order={cfg.solver_order}) with num_inference_steps={n}: the last step has h = 0 and "
        f"order {order}, where diffusers' UniPC returns NaN; set lower_order_final=True (or "
        "solver_order=2, or final_sigmas_type='zero' with lower_order_final=True)")
  return [_F32(1)] * (order - 1)


def _unipc_coefficients(cfg: UniPCConfig, sigmas: np.ndarray, offset: int = 0) -> dict[str, np.ndarray]:
  """Per-step UniPC coefficients (host, float32), mirroring `UniPCMultistepScheduler.step`; `offset`:
  a tail's first step in the full schedule (`disable_corrector` names full-schedule steps). For step i the predictor goes sigmas[i] -> sigmas[i + 1] with order p_i and the corrector (from
  step 1 on) refines the sample at sigmas[i] with order p_{i-1}:
    x = cx * x_prev - cm0 * m0 - cres * (sum_k rho_k * (m_k - m0) / rk_k [+ rho_t * (x0_i - m0)])
  Unused history slots get rho 0 and rk 1, so they contribute an exact zero.
  """
  n = len(sigmas) - 1
  p_max = cfg.solver_order
  k_max = max(p_max - 1, 1)
  tables = {name: np.zeros((n,), np.float32) for name in
            ("p_cx", "p_cm0", "p_cres", "c_cx", "c_cm0", "c_cres", "c_rho_t", "use_corrector")}
  for name in ("p_rho", "p_rk", "c_rho", "c_rk"):
    tables[name] = np.zeros((n, k_max), np.float32)
  tables["p_rk"][:] = 1
  tables["c_rk"][:] = 1
  orders = _orders(cfg, n)
  lam = [_lambda(s) for s in sigmas]

  def fill(prefix: str, t_idx: int, s0_idx: int, order: int, hist_idx: list[int], step: int,
           corrector: bool) -> None:
    sigma_t, sigma_s0 = sigmas[t_idx], sigmas[s0_idx]
    alpha_t = _F32(_F32(1) - sigma_t)
    with np.errstate(invalid="ignore", divide="ignore"):
      h = _F32(lam[t_idx] - lam[s0_idx])
      rks = [_F32((lam[j] - lam[s0_idx]) / h) for j in hist_idx]
    if h == 0:  # final_sigmas_type="sigma_min": the last step goes from sigmas[n - 1] to itself
      rks = _zero_step_rks(cfg, order, len(sigmas) - 1)
    h_phi_1, b_h, r, b = _bh_terms(cfg, h, order, rks)
    if corrector:
      rhos = np.array([0.5], np.float32) if order == 1 else np.linalg.solve(r, b).astype(np.float32)
      tables["c_rho_t"][step] = rhos[-1]
      rhos = rhos[:-1]
    elif order == 1:
      rhos = np.zeros((0,), np.float32)
    elif order == 2:
      rhos = np.array([0.5], np.float32)  # diffusers' simplified order-2 predictor
    else:
      rhos = np.linalg.solve(r[:-1, :-1], b[:-1]).astype(np.float32)
    tables[prefix + "cx"][step] = _F32(sigma_t / sigma_s0)
    tables[prefix + "cm0"][step] = _F32(alpha_t * h_phi_1)
    # A first-order predictor has no residual term. diffusers still multiplies alpha_t * B(h) by 0,
    # which is NaN for bh1 (B(h) = h = -inf) at a zero final sigma; a 0 coefficient is exact instead.
    has_residual = corrector or order > 1
    tables[prefix + "cres"][step] = _F32(alpha_t * b_h) if has_residual else _F32(0)
    tables[prefix + "rho"][step, :len(rhos)] = rhos
    tables[prefix + "rk"][step, :len(rks)] = rks

  for i in range(n):
    fill("p_", i + 1, i, orders[i], [i - k for k in range(1, orders[i])], i, corrector=False)
    if i > 0 and (i - 1 + offset) not in cfg.disable_corrector:
      tables["use_corrector"][i] = 1
      p = orders[i - 1]
      fill("c_", i, i - 1, p, [i - (k + 1) for k in range(1, p)], i, corrector=True)
  for name, table in tables.items():
    if not np.all(np.isfinite(table)):
      raise ValueError(f"non-finite UniPC coefficient table {name!r} for sigmas {sigmas}")
  tables["orders"] = np.array(orders, np.int32)
  return tables


@dataclasses.dataclass(frozen=True)
class UniPCSchedule:
  """Host-side UniPC schedule.

  Attributes:
    timesteps: int64 [N], exactly `UniPCMultistepScheduler.timesteps` after `set_timesteps(N)`.
    sigmas: float32 [N + 1], ending in 0 (or sigma_min).
    coefficients: float32 per-step solver tables (see `_unipc_coefficients`); `orders` int32 [N].
  """
  config: UniPCConfig
  timesteps: np.ndarray
  sigmas: np.ndarray
  coefficients: dict[str, np.ndarray]

  def tail(self, start: int) -> "UniPCSchedule":
    """The steps from `start` on, run by a fresh solver: what diffusers does when a pipeline runs
    `timesteps[start:]` after `set_timesteps(N)` (video-to-video's strength): the solver's warm-up
    orders restart there, the caps at the steps left stay the full schedule's.

    Raises:
      ValueError: `start` outside [0, N).
    """
    flow_schedule.check_tail_start(start, len(self.timesteps))
    sigmas = self.sigmas[start:]
    return UniPCSchedule(config=self.config, timesteps=self.timesteps[start:], sigmas=sigmas,
                         coefficients=_unipc_coefficients(self.config, sigmas, offset=start))

  def init_state(self, sample_shape: Sequence[int], dtype: Any = jnp.float32) -> "UniPCState":
    """Fresh solver state; `dtype` is the history dtype (the x0 dtype: the sample's, fp32 in Wan)."""
    shape = tuple(sample_shape)
    return UniPCState(
        timesteps=flow_schedule.device_table(self.timesteps, np.int32),
        sigmas=flow_schedule.device_table(self.sigmas),
        coefficients={k: flow_schedule.device_table(v) for k, v in self.coefficients.items() if k != "orders"},
        step_index=flow_schedule.device_zeros((), jnp.int32),
        model_outputs=flow_schedule.device_zeros((self.config.solver_order,) + shape, dtype),
        last_sample=flow_schedule.device_zeros(shape, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UniPCState:
  """Device-side UniPC state (a pytree; every field is an array).

  Attributes:
    timesteps: int32 [table_length(N)] (the schedule's int64 timesteps, all < num_train_timesteps;
      every table padded by `flow_schedule.device_table`, so step counts share a compiled step).
    sigmas: float32 [table_length(N + 1)] (N + 1 used).
    coefficients: per-step tables, float32 [table_length(N)] or [table_length(N), max(P - 1, 1)],
      P = solver_order (N rows used).
    step_index: int32 [], the next step to take.
    model_outputs: [P, *sample shape] converted model outputs (x0 predictions), newest last.
    last_sample: [*sample shape] the sample the last predictor started from.
  """
  timesteps: jax.Array
  sigmas: jax.Array
  coefficients: dict[str, jax.Array]
  step_index: jax.Array
  model_outputs: jax.Array
  last_sample: jax.Array

  def timestep(self) -> jax.Array:
    """int32 []: the timestep to give the model at the current step."""
    return self.timesteps[self.step_index]

  def step(self, model_output: jax.Array, sample: jax.Array) -> tuple[jax.Array, "UniPCState"]:
    """One UniPC step (corrector on the incoming sample, then predictor), as diffusers' `step`.

    Args:
      model_output: [*shape] flow prediction (velocity) at the current timestep, any float dtype.
      sample: [*shape] current sample (fp32 in Wan).

    Returns:
      (prev_sample in sample's dtype, new state).
    """
    i = self.step_index
    c = {k: v[i] for k, v in self.coefficients.items()}
    hist = self.model_outputs
    num_hist = hist.shape[0]
    # flow_prediction -> x0 (diffusers `convert_model_output`).
    x0 = sample - _mul(self.sigmas[i], model_output)
    x0 = x0.astype(hist.dtype)

    # UniC corrector: refines the sample reached by the last predictor using this step's x0.
    m0 = hist[-1]
    last = self.last_sample
    corrected = _mul(c["c_cx"], last) - _mul(c["c_cm0"], m0)
    corr_res = jnp.zeros_like(m0)
    for k in range(num_hist - 1):
      corr_res = corr_res + _mul(c["c_rho"][k], (hist[-(k + 2)] - m0) / c["c_rk"][k].astype(m0.dtype))
    corrected = corrected - _mul(c["c_cres"], corr_res + _mul(c["c_rho_t"], x0 - m0))
    sample = jnp.where(c["use_corrector"] > 0, corrected.astype(last.dtype), sample)

    hist = jnp.concatenate([hist[1:], x0[None]], axis=0)
    m0 = hist[-1]
    # UniP predictor: sigmas[i] -> sigmas[i + 1].
    pred = _mul(c["p_cx"], sample) - _mul(c["p_cm0"], m0)
    pred_res = jnp.zeros_like(m0)
    for k in range(num_hist - 1):
      pred_res = pred_res + _mul(c["p_rho"][k], (hist[-(k + 2)] - m0) / c["p_rk"][k].astype(m0.dtype))
    prev_sample = (pred - _mul(c["p_cres"], pred_res)).astype(sample.dtype)
    new_state = dataclasses.replace(self, step_index=i + 1, model_outputs=hist,
                                    last_sample=sample.astype(self.last_sample.dtype))
    return prev_sample, new_state
