"""Each chunk's few-step schedule against Self-Forcing's training grid, written out by hand."""

import numpy as np
import pytest

from pipelines.wan.causal import ChunkSchedule


def test_warped_steps_are_the_shifted_grid():
  """Self-Forcing's 1000/750/500/250 with warp and shift 5 are grid[0, 250, 500, 750]:
  t = 1000 * 5s / (1 + 4s) at s = 1, 0.75, 0.5, 0.25, and sigma(t) = t / 1000 there."""
  schedule = ChunkSchedule()
  s = np.array([1.0, 0.75, 0.5, 0.25])
  expected = 1000 * 5 * s / (1 + 4 * s)  # 1000, 937.5, 833.3, 625
  np.testing.assert_allclose(schedule.timesteps(), expected, rtol=1e-12)
  np.testing.assert_allclose(schedule.sigmas(), expected / 1000, rtol=1e-12)


def test_unwarped_steps_read_the_nearest_grid_sigma():
  """CausVid's steps are timesteps themselves; sigma is the grid's at the nearest grid timestep
  (shift 8: t = 757 lies between grid points, so sigma(757) is not 0.757 but the neighbour's)."""
  schedule = ChunkSchedule((1000, 757, 522), warp_denoising_step=False, shift=8.0)
  np.testing.assert_array_equal(schedule.timesteps(), [1000, 757, 522])
  grid, sigmas = schedule.grid()
  nearest = sigmas[np.argmin(np.abs(grid - 757))]
  assert schedule.sigma(757) == nearest and abs(nearest - 0.757) < 2e-3 and nearest != 0.757
  assert schedule.sigma(1000) == 1.0


@pytest.mark.parametrize("steps, warp, match", [((), True, "descending"), ((500, 750), True, "descending"),
                                                 ((1001,), False, "descending"), ((937.5,), True, "ints")])
def test_bad_schedules_are_refused(steps, warp, match):
  with pytest.raises(ValueError, match=match):
    ChunkSchedule(steps, warp_denoising_step=warp)
  with pytest.raises(ValueError, match="shift"):
    ChunkSchedule(shift=0.0)
