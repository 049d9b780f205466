"""The tail of a schedule (`Schedule.tail(start)`, video-to-video's strength): the steps from `start`
on, run by a fresh solver, against diffusers doing what `WanVideoToVideoPipeline` does: set_timesteps(N)
and step `timesteps[start:]` (no begin index: the scheduler finds its step from the timestep), for each
solver, its warm-up orders restarting at `start` and its final-order caps read from the full N.
"""

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from pipelines.wan import schedulers
from tests.numerics import assert_close_scaled
from tests.pipelines.wan.schedulers.test_unipc import SHAPE, X_INIT, fake_model, trajectory_rel

pytestmark = pytest.mark.numerics

FLOW = dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=5.0)
SOLVERS = {
    "unipc": (lambda: UniPCMultistepScheduler(**FLOW), schedulers.UniPCConfig(flow_shift=5.0)),
    "unipc-o3-disabled": (lambda: UniPCMultistepScheduler(**FLOW, solver_order=3, disable_corrector=[4]),
                          schedulers.UniPCConfig(flow_shift=5.0, solver_order=3, disable_corrector=(4,))),
    "dpm": (lambda: DPMSolverMultistepScheduler(**FLOW, algorithm_type="dpmsolver++", solver_order=2),
            schedulers.DPMSolverConfig(flow_shift=5.0, solver_order=2)),
    "euler": (lambda: FlowMatchEulerDiscreteScheduler(shift=5.0), schedulers.FlowEulerConfig(shift=5.0)),
}


def _diffusers_tail(make, n: int, start: int) -> np.ndarray:
  sched = make()
  sched.set_timesteps(n)
  x = torch.tensor(X_INIT)
  for t in sched.timesteps[start:]:
    x = sched.step(fake_model(x, t.to(torch.float32)), t, x, return_dict=False)[0]
  return x.numpy()


def _ours_tail(config, n: int, start: int) -> np.ndarray:
  import jax.numpy as jnp

  full = config.set_timesteps(n)
  schedule = full.tail(start)
  np.testing.assert_array_equal(schedule.timesteps, full.timesteps[start:])
  np.testing.assert_array_equal(schedule.sigmas, full.sigmas[start:])
  state = schedule.init_state(SHAPE)
  x = jnp.asarray(X_INIT)
  for _ in range(n - start):
    t = state.timestep()
    x, state = state.step(fake_model(x, t.astype(jnp.float32)), x)
  return np.asarray(x)


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize("n,start", [(10, 3), (10, 9), (20, 6), (6, 0)])
def test_tail_matches_diffusers_stepping_timesteps_from_start(solver, n, start):
  make, config = SOLVERS[solver]
  reference = _diffusers_tail(make, n, start)
  assert_close_scaled(_ours_tail(config, n, start), reference, rel=trajectory_rel(n - start),
                      name=f"{solver} tail {start}:{n}")
  if start:  # positive control: the full schedule's state at `start` (warm history) is another trajectory
    other = _ours_tail(config, n, 0)
    assert np.abs(other - reference).max() > 1e-3


def test_tail_refuses_a_start_outside_the_schedule():
  schedule = schedulers.UniPCConfig(flow_shift=5.0).set_timesteps(4)
  for start in (-1, 4):
    with pytest.raises(ValueError, match=rf"start={start} must be in \[0, 4\)"):
      schedule.tail(start)
