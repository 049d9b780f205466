"""Custom schedules (`sigmas=` / `timesteps=`): diffusers' flow schedulers given sigmas, lightx2v's
denoising step list given timesteps, and the checks on both."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from pipelines.wan import schedulers
from pipelines.wan.schedulers import flow_schedule
from tests.numerics import assert_close_scaled
from tests.pipelines.wan.schedulers.test_dpm_solver import run_jax_schedule
from tests.pipelines.wan.schedulers.test_unipc import X_INIT, fake_model, trajectory_rel

pytestmark = pytest.mark.numerics
LIGHTX2V_STEPS = [1000, 750, 500, 250]


def _diffusers_custom(sched, sigmas):
  sched.set_timesteps(sigmas=np.array(sigmas))
  sched.set_begin_index(0)
  x = torch.tensor(X_INIT)
  for t in sched.timesteps:
    x = sched.step(fake_model(x, t.to(torch.float32)), t, x, return_dict=False)[0]
  return sched.timesteps.numpy(), sched.sigmas.numpy(), x.numpy()


@pytest.mark.parametrize("shift", [1.0, 5.0])
@pytest.mark.parametrize("solver", ["euler", "unipc"])
def test_custom_sigmas_match_diffusers(solver, shift):
  sigmas = [1.0, 0.75, 0.5, 0.25]
  if solver == "euler":
    ref, config = FlowMatchEulerDiscreteScheduler(shift=shift), schedulers.FlowEulerConfig(shift=shift)
  else:
    ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift)
    config = schedulers.UniPCConfig(flow_shift=shift)
  t_ref, s_ref, x_ref = _diffusers_custom(ref, sigmas)
  schedule, x = run_jax_schedule(config.set_timesteps(4, sigmas=sigmas))
  np.testing.assert_array_equal(schedule.timesteps, t_ref)
  np.testing.assert_array_equal(schedule.sigmas, s_ref)
  assert_close_scaled(x, x_ref, rel=trajectory_rel(4), name=f"{solver} sigmas {shift=}")


def test_timesteps_are_lightx2v_denoising_step_list():
  """lightx2v's WanStepDistillScheduler at shift 5: sigmas = shift(linspace(1, 0, 1001)[:-1]) taken
  at index 1000 - t, the model fed sigma x 1000; its last step goes to sigma 0 (x0)."""
  n, sigmas = flow_schedule.custom_sigmas(None, None, LIGHTX2V_STEPS, 1000)
  assert n == 4
  schedule = schedulers.FlowEulerConfig(shift=5.0).set_timesteps(n, sigmas=sigmas)
  ref = torch.linspace(1.0, 0.0, 1001)[:-1]
  ref = 5.0 * ref / (1 + 4.0 * ref)
  index = [1000 - t for t in LIGHTX2V_STEPS]
  # 1e-6: torch's float32 linspace and t / 1000 round differently by an ulp or so.
  np.testing.assert_allclose(schedule.sigmas[:-1], ref[index].numpy(), rtol=1e-6)
  np.testing.assert_allclose(schedule.timesteps, (ref * 1000)[index].numpy(), rtol=1e-6)
  assert schedule.sigmas[-1] == 0
  assert schedule.timesteps[0] == 1000 and abs(schedule.timesteps[1] - 937.5) < 1e-3  # shifted, not 750


@pytest.mark.parametrize("kwargs,match", [
    (dict(sigmas=[1.0, 0.5], timesteps=[1000, 500]), "not both"),
    (dict(timesteps=[1000, 750, 750, 250]), "strictly decreasing"),
    (dict(timesteps=[250, 500, 750, 1000]), "strictly decreasing"),
    (dict(timesteps=[1200, 750]), r"\(0, 1000\]"),
    (dict(sigmas=[1.0, 0.5, 0.0]), r"\(0, 1\]"),
    (dict(sigmas=[1.0, float("nan")]), "NaN"),
    (dict(sigmas=[]), "non-empty"),
    (dict(sigmas="1.0,0.5"), "list of numbers"),
    (dict(timesteps=[1000, 750, 500, 250], num_inference_steps=8), "num_inference_steps=8 but timesteps=.* holds 4"),
])
def test_bad_custom_schedules_are_refused(kwargs, match):
  steps = kwargs.pop("num_inference_steps", None)
  with pytest.raises(ValueError, match=match):
    flow_schedule.custom_sigmas(steps, kwargs.get("sigmas"), kwargs.get("timesteps"), 1000)


def test_no_custom_schedule_keeps_the_step_count():
  assert flow_schedule.custom_sigmas(None, None, None, 1000) == (50, None)
  assert flow_schedule.custom_sigmas(8, None, None, 1000) == (8, None)
  n, sigmas = flow_schedule.custom_sigmas(2, [0.9, 0.1], None, 1000)
  assert n == 2 and sigmas.tolist() == [0.9, 0.1]
