"""Flow-match Euler (pipelines/wan/schedulers/euler.py) against diffusers' `FlowMatchEulerDiscreteScheduler`
over whole trajectories, driven by test_unipc.py's fake model: bit-exact tables, samples to float32
rounding (`trajectory_rel`)."""

import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler

from pipelines.wan import schedulers
from tests.numerics import assert_close_scaled
from tests.pipelines.wan.schedulers.test_unipc import run_diffusers, run_jax, trajectory_rel

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 12.0])
@pytest.mark.parametrize("n", [1, 2, 10, 50])
def test_euler_trajectory_matches_diffusers(n, shift):
  t_ref, s_ref, x_ref = run_diffusers(FlowMatchEulerDiscreteScheduler(shift=shift), n)
  schedule, x = run_jax(schedulers.FlowEulerConfig(shift=shift), n)
  assert schedule.timesteps.dtype == t_ref.dtype == np.float32
  np.testing.assert_array_equal(schedule.timesteps, t_ref)
  np.testing.assert_array_equal(schedule.sigmas, s_ref)
  assert np.all(np.isfinite(x))
  assert_close_scaled(x, x_ref, rel=trajectory_rel(n), name=f"Euler {n=} {shift=}")
