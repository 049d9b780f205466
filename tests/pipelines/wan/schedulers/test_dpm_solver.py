"""DPM-Solver++ (flow) parity with diffusers' `DPMSolverMultistepScheduler(use_flow_sigmas=True,
prediction_type="flow_prediction")` over whole trajectories, driven by test_unipc.py's fake model
(bitwise equal in both frameworks), so any difference comes from the solvers; agreement is to
float32 rounding (`trajectory_rel`: the jitted step contracts FMAs where torch rounds every op)."""

import json

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from pipelines.wan import schedulers
from tests.numerics import assert_close_scaled
from tests.pipelines.wan.schedulers.test_unipc import X_INIT, fake_model, run_diffusers, run_jax, trajectory_rel

pytestmark = pytest.mark.numerics


def _reference(shift, **kw):
  return DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                     flow_shift=shift, **kw)


@pytest.mark.parametrize("n,shift,order,solver_type", [
    (1, 1.0, 2, "midpoint"), (4, 5.0, 2, "midpoint"), (10, 3.0, 2, "heun"), (10, 5.0, 3, "midpoint"),
    (20, 12.0, 2, "midpoint"), (16, 5.0, 3, "heun")])
def test_dpm_trajectory_matches_diffusers(n, shift, order, solver_type):
  kw = dict(solver_order=order, solver_type=solver_type)
  t_ref, s_ref, x_ref = run_diffusers(_reference(shift, **kw), n)
  schedule, x = run_jax(schedulers.DPMSolverConfig(flow_shift=shift, **kw), n)
  # Tables on the host in numpy with diffusers' formulas and dtypes: equal, not close.
  assert schedule.timesteps.dtype == t_ref.dtype == np.int64
  np.testing.assert_array_equal(schedule.timesteps, t_ref)
  np.testing.assert_array_equal(schedule.sigmas, s_ref)
  assert np.all(np.isfinite(x))
  assert_close_scaled(x, x_ref, rel=trajectory_rel(n), name=f"DPM++ {n=} {shift=} {kw}")


@pytest.mark.parametrize("sigmas", [[1.0, 0.75, 0.5, 0.25], [0.9, 0.6, 0.3]])
def test_dpm_custom_sigmas_match_diffusers_stepping_the_same_table(sigmas):
  """diffusers' flow DPM++ ignores custom schedules in `set_timesteps`, so its stepping is checked
  on our table (Wan's FlowDPMSolverMultistepScheduler(sigmas=) table: shifted, no 1e-6 nudge at
  sigma 1, where log(alpha) = -inf makes h = inf and the first step x' = sigma' x + alpha' x0)."""
  schedule = schedulers.DPMSolverConfig(flow_shift=5.0).set_timesteps(len(sigmas), sigmas=sigmas)
  ref = _reference(5.0)
  ref.set_timesteps(len(sigmas))
  ref.sigmas, ref.timesteps = torch.from_numpy(schedule.sigmas), torch.from_numpy(schedule.timesteps)
  ref.set_begin_index(0)
  x_ref = torch.tensor(X_INIT)
  for t in ref.timesteps:
    x_ref = ref.step(fake_model(x_ref, t.to(torch.float32)), t, x_ref, return_dict=False)[0]
  assert np.all(np.isfinite(x_ref.numpy()))
  _, x = run_jax_schedule(schedule)
  assert_close_scaled(x, x_ref.numpy(), rel=trajectory_rel(len(sigmas)), name=f"DPM++ sigmas={sigmas}")


def run_jax_schedule(schedule):
  import jax.numpy as jnp
  from tests.pipelines.wan.schedulers.test_unipc import SHAPE, _jit_step
  state, x = schedule.init_state(SHAPE), jnp.asarray(X_INIT)
  for _ in schedule.timesteps:
    x, state = _jit_step(state, fake_model(x, state.timestep().astype(jnp.float32)), x)
  return schedule, np.asarray(x)


def test_dpm_config_read_from_a_scheduler_config_json(tmp_path):
  _reference(5.0, solver_order=3).save_config(tmp_path)
  with open(tmp_path / "scheduler_config.json") as f:
    saved = json.load(f)
  assert schedulers.scheduler_config_from_dict(saved) == schedulers.DPMSolverConfig(flow_shift=5.0, solver_order=3)
  for change, match in [({"prediction_type": "epsilon"}, "prediction_type"),
                        ({"algorithm_type": "sde-dpmsolver++"}, "algorithm_type"),
                        ({"final_sigmas_type": "sigma_min"}, "final_sigmas_type"),
                        ({"use_karras_sigmas": True}, "use_karras_sigmas")]:
    with pytest.raises(ValueError, match=match):
      schedulers.scheduler_config_from_dict({**saved, **change})
  # diffusers' defaults are DDPM epsilon prediction: a config that leaves flow mode out is refused.
  with pytest.raises(ValueError, match="use_flow_sigmas"):
    schedulers.scheduler_config_from_dict({"_class_name": "DPMSolverMultistepScheduler"})

