"""Flow UniPC parity with diffusers over whole trajectories (Euler's beside it where a test covers both
solvers), plus config and dtype checks. The trajectory drivers here serve test_euler.py, test_dpm_solver.py,
test_flow_schedule.py and test_registry.py too.

Both implementations are driven by the same deterministic fake model (a fixed affine function of the
sample and the timestep), evaluated op by op in each framework (bitwise equal for equal inputs), so
any difference comes from the schedulers. The JAX step is jitted as in the pipeline; XLA contracts
multiply-adds into FMAs where the CPU has them, so agreement is to float32 rounding
(`trajectory_rel`), not bitwise.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from pipelines.wan import schedulers
from tests.numerics import EPS_F32, assert_close_scaled

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2

SHAPE = (2, 4, 3, 5, 6)  # [B, C, F, Hl, Wl]

_rng = np.random.RandomState(0)
X_INIT = _rng.randn(*SHAPE).astype(np.float32)
W = (0.3 * _rng.randn(*SHAPE)).astype(np.float32)
W_T, W_J = torch.tensor(W), jnp.asarray(W)

# The scheduler config Wan 2.1 T2V diffusers checkpoints ship (scheduler/scheduler_config.json).
WAN_UNIPC_CONFIG = {
    "_class_name": "UniPCMultistepScheduler", "_diffusers_version": "0.33.0.dev0",
    "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001, "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": 3.0,
    "lower_order_final": True, "num_train_timesteps": 1000, "predict_x0": True,
    "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False, "sample_max_value": 1.0,
    "solver_order": 2, "solver_p": None, "solver_type": "bh2", "steps_offset": 0,
    "thresholding": False, "timestep_spacing": "linspace", "trained_betas": None,
    "use_beta_sigmas": False, "use_exponential_sigmas": False, "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}


def fake_model(x, t):
  """Velocity-like output; the same ops in torch and jnp (run eagerly, so bitwise equal)."""
  w = W_T if isinstance(x, torch.Tensor) else W_J
  return 0.8 * x + w * (t / 1000.0) - 0.1


_jit_step = jax.jit(lambda state, model_output, sample: state.step(model_output, sample))


def run_diffusers(sched, n):
  sched.set_timesteps(n)
  sched.set_begin_index(0)  # as WanPipeline does
  x = torch.tensor(X_INIT)
  for t in sched.timesteps:
    x = sched.step(fake_model(x, t.to(torch.float32)), t, x, return_dict=False)[0]
  return sched.timesteps.numpy(), sched.sigmas.numpy(), x.numpy()


def run_jax(config, n, step=_jit_step):
  schedule = config.set_timesteps(n)
  state = schedule.init_state(SHAPE)
  x = jnp.asarray(X_INIT)
  for k in range(n):
    t = state.timestep()
    assert float(t) == float(schedule.timesteps[k])
    x, state = step(state, fake_model(x, t.astype(jnp.float32)), x)
  assert int(state.step_index) == n
  return schedule, np.asarray(x)


def trajectory_rel(n: int) -> float:
  """Tolerance for an n-step fp32 trajectory, in units of the final sample's scale (max |x|).

  Each step rounds a few times at the sample's scale (the jitted step's FMAs where torch rounds
  every op, or not: XLA:CPU contracts only where the CPU has FMA); steps' errors are independent
  and add like a random walk, sqrt(n) roundings. 4 (1 + sqrt(n)) eps; measured <= 0.9 sqrt(n) eps
  (5 eps at n = 50) under three ISA settings.
  """
  return 4 * (1 + math.sqrt(n)) * EPS_F32


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 12.0])
@pytest.mark.parametrize("n", [1, 2, 10, 50])
def test_unipc_trajectory_matches_diffusers(n, shift):
  ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                flow_shift=shift)
  t_ref, s_ref, x_ref = run_diffusers(ref, n)
  schedule, x = run_jax(schedulers.UniPCConfig(flow_shift=shift), n)
  assert schedule.timesteps.dtype == t_ref.dtype == np.int64
  # Bit-exact tables: computed on the host in numpy with diffusers' formulas and dtypes (no XLA), so
  # equality is the property; a different formula or dtype shows up here first.
  np.testing.assert_array_equal(schedule.timesteps, t_ref)
  np.testing.assert_array_equal(schedule.sigmas, s_ref)
  assert schedule.sigmas[-1] == 0.0
  assert np.all(np.isfinite(x)), "NaN/inf after the final (sigma = 0) step"
  assert_close_scaled(x, x_ref, rel=trajectory_rel(n), name=f"UniPC {n=} {shift=}")


@pytest.mark.parametrize("order,solver_type,disable,final", [
    (1, "bh2", (), "zero"), (3, "bh2", (), "zero"), (2, "bh2", (0, 3), "zero"),
    (2, "bh1", (), "sigma_min"), (3, "bh1", (), "sigma_min")])
def test_unipc_variants_match_diffusers(order, solver_type, disable, final):
  kw = dict(solver_order=order, solver_type=solver_type, disable_corrector=list(disable),
            final_sigmas_type=final)
  ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                flow_shift=5.0, **kw)
  t_ref, _, x_ref = run_diffusers(ref, 10)
  kw["disable_corrector"] = disable
  schedule, x = run_jax(schedulers.UniPCConfig(flow_shift=5.0, **kw), 10)
  np.testing.assert_array_equal(schedule.timesteps, t_ref)
  assert_close_scaled(x, x_ref, rel=trajectory_rel(10), name=f"UniPC {kw}")


def test_bh1_zero_final_sigma_is_finite_where_diffusers_is_nan():
  # diffusers computes alpha_t * B(h) * 0 with B(h) = -inf at the last bh1 step -> NaN.
  ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                flow_shift=5.0, solver_type="bh1")
  _, _, x_ref = run_diffusers(ref, 3)
  assert np.all(np.isnan(x_ref)), "diffusers fixed bh1 at sigma 0; compare trajectories instead"
  _, x = run_jax(schedulers.UniPCConfig(flow_shift=5.0, solver_type="bh1"), 3)
  assert np.all(np.isfinite(x))


def test_unipc_eager_step_is_bitwise_for_euler_and_near_bitwise_for_unipc():
  # Bit-exactness is the property here: without jit every op is one IEEE-rounded operation on any
  # CPU (no fusion, no FMA contraction), in diffusers' order, with the same host-side coefficients
  # (at these 2 UniPC steps numpy's coefficients equal torch's), so the samples are bitwise equal.
  _, _, x_ref = run_diffusers(FlowMatchEulerDiscreteScheduler(shift=3.0), 10)
  _, x = run_jax(schedulers.FlowEulerConfig(shift=3.0), 10, step=lambda s, m, x: s.step(m, x))
  np.testing.assert_array_equal(x, x_ref)
  ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0)
  _, _, x_ref = run_diffusers(ref, 2)
  _, x = run_jax(schedulers.UniPCConfig(flow_shift=3.0), 2, step=lambda s, m, x: s.step(m, x))
  np.testing.assert_array_equal(x, x_ref)


@pytest.mark.parametrize("config", [schedulers.UniPCConfig(flow_shift=5.0),
                                    schedulers.FlowEulerConfig(shift=5.0)], ids=["unipc", "euler"])
def test_scan_with_traced_step_index_equals_python_loop(config):
  n = 10
  _, x_loop = run_jax(config, n)
  state = config.set_timesteps(n).init_state(SHAPE)

  @jax.jit
  def denoise(state, x):
    def body(carry, _):
      state, x = carry
      mo = 0.8 * x + W_J * (state.timestep().astype(jnp.float32) / 1000.0) - 0.1
      x, state = state.step(mo, x)
      return (state, x), None
    (state, x), _ = jax.lax.scan(body, (state, x), None, length=n)
    return x

  x_scan = np.asarray(denoise(state, jnp.asarray(X_INIT)))
  assert_close_scaled(x_scan, x_loop, rel=trajectory_rel(n), name="scan vs loop")


def test_final_step_lands_on_x0_without_nan():
  # With sigma_next = 0 the last UniPC step is first order and returns the x0 prediction
  # sample - sigma * v (log-SNR is +inf there; a NaN would show up in the tables or the sample).
  schedule = schedulers.UniPCConfig(flow_shift=3.0).set_timesteps(4)
  assert schedule.coefficients["orders"].tolist() == [1, 2, 2, 1]
  for table in schedule.coefficients.values():
    assert np.all(np.isfinite(table))
  state = schedule.init_state(SHAPE)
  x = jnp.asarray(X_INIT)
  for _ in range(3):
    x, state = _jit_step(state, fake_model(x, 500.0), x)
  v = fake_model(x, 100.0)
  out, state = _jit_step(state, v, x)
  x0 = x - schedule.sigmas[3] * v
  assert_close_scaled(out, x0, rel=trajectory_rel(1), name="last step vs x0 prediction")
  assert np.all(np.isfinite(np.asarray(out)))


def test_step_dtypes_follow_diffusers():
  x = torch.tensor(X_INIT)
  v = fake_model(x, torch.tensor(999.0)).to(torch.bfloat16)
  ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
  ref.set_timesteps(10)
  ref.set_begin_index(0)
  y_ref = ref.step(v, ref.timesteps[0], x, return_dict=False)[0]
  state = schedulers.FlowEulerConfig(shift=3.0).set_timesteps(10).init_state()
  y, _ = state.step(jnp.asarray(v.float().numpy()).astype(jnp.bfloat16), jnp.asarray(X_INIT))
  assert y_ref.dtype == torch.bfloat16 and y.dtype == jnp.bfloat16  # cast to the model dtype
  # Bit-exact: eager steps, one IEEE-rounded op at a time (see the eager test above); the dtypes and
  # rounding points are what this checks.
  np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), y_ref.float().numpy())

  ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0)
  ref.set_timesteps(10)
  ref.set_begin_index(0)
  y_ref = ref.step(v, ref.timesteps[0], x, return_dict=False)[0]
  state = schedulers.UniPCConfig(flow_shift=3.0).set_timesteps(10).init_state(SHAPE)
  y, _ = state.step(jnp.asarray(v.float().numpy()).astype(jnp.bfloat16), jnp.asarray(X_INIT))
  assert y_ref.dtype == torch.float32 and y.dtype == jnp.float32  # UniPC keeps the sample dtype
  np.testing.assert_array_equal(np.asarray(y), y_ref.numpy())


@pytest.mark.parametrize("shift", [1.0, 5.0])
@pytest.mark.parametrize("solver_type", ["bh1", "bh2"])
@pytest.mark.parametrize("order", [2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 20])
def test_unipc_sigma_min_without_lower_order_final_matches_diffusers(n, order, solver_type, shift):
  """final_sigmas_type="sigma_min", lower_order_final=False: the last step repeats the last sigma
  (h = 0). diffusers' predictor returns its input there at order <= 2 (`_zero_step_rks`; the
  corrector of the step before still runs); ours matches it to float32 rounding (these were refused
  with "non-finite UniPC coefficient table 'p_rk'" before). At order 3 (n >= 3) diffusers returns NaN, and ours refuses the schedule
  naming lower_order_final; the NaN is checked too, so the refusal is not hiding a finite answer."""
  kw = dict(solver_order=order, solver_type=solver_type, final_sigmas_type="sigma_min",
            lower_order_final=False)
  ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                flow_shift=shift, **kw)
  t_ref, s_ref, x_ref = run_diffusers(ref, n)
  assert s_ref[-1] == s_ref[-2]  # h = 0 at the last step: the case under test
  config = schedulers.UniPCConfig(flow_shift=shift, **kw)
  if min(order, n) >= 3:
    assert np.all(np.isnan(x_ref)), "diffusers is finite here now; compare trajectories instead"
    with pytest.raises(ValueError, match=r"h = 0 and order 3.*set lower_order_final=True"):
      config.set_timesteps(n)
    return
  schedule, x = run_jax(config, n)
  np.testing.assert_array_equal(schedule.timesteps, t_ref)
  np.testing.assert_array_equal(schedule.sigmas, s_ref)
  assert np.all(np.isfinite(x)) and np.all(np.isfinite(x_ref))
  assert_close_scaled(x, x_ref, rel=trajectory_rel(n), name=f"UniPC sigma_min {kw} {n=} {shift=}")


@pytest.mark.parametrize("change", [{"use_karras_sigmas": True}, {"prediction_type": "epsilon"},
                                    {"use_flow_sigmas": False}, {"thresholding": True},
                                    {"use_dynamic_shifting": True}, {"solver_type": "midpoint"},
                                    {"lower_order_final": False}, {"_class_name": "DDIMScheduler"}])
def test_unsupported_scheduler_settings_raise(change):
  with pytest.raises(ValueError):
    schedulers.scheduler_config_from_dict({**WAN_UNIPC_CONFIG, **change})


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="num_inference_steps"):
    schedulers.UniPCConfig().set_timesteps(0)
  with pytest.raises(ValueError, match="num_inference_steps"):
    schedulers.FlowEulerConfig().set_timesteps(0)
  with pytest.raises(ValueError, match="shift"):
    schedulers.FlowEulerConfig(shift=0.0)
  with pytest.raises(ValueError):
    schedulers.scheduler_config_from_dict({"_class_name": "FlowMatchEulerDiscreteScheduler",
                                           "use_dynamic_shifting": True})
  with pytest.raises(dataclasses.FrozenInstanceError):
    schedulers.UniPCConfig().flow_shift = 2.0  # type: ignore[misc]



@pytest.mark.parametrize("config", [schedulers.UniPCConfig(flow_shift=3.0), schedulers.FlowEulerConfig(shift=3.0),
                                    schedulers.DPMSolverConfig(flow_shift=3.0)],
                         ids=lambda c: type(c).__name__)
def test_step_counts_share_one_state_signature(config):
  """The device state's tables are padded (`flow_schedule.device_table`), so a 2-step and a 50-step
  call pass the jitted step the same shapes and share its compiled program; 65 steps need longer
  tables (the positive control: the padding follows the step count), and the rows used are the
  schedule's own."""
  def signature(n):
    return [(x.shape, x.dtype) for x in jax.tree.leaves(config.set_timesteps(n).init_state(SHAPE))]

  assert signature(2) == signature(50)
  assert signature(65) != signature(64)
  schedule = config.set_timesteps(7)
  state = schedule.init_state(SHAPE)
  np.testing.assert_array_equal(np.asarray(state.sigmas)[:8], schedule.sigmas)
  assert np.all(np.asarray(state.sigmas)[8:] == schedule.sigmas[-1])  # padding repeats the last row
