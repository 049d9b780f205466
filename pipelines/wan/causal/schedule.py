"""The few-step denoising of each chunk of a causal Wan stream (Self-Forcing, CausVid).

Each chunk starts from noise and runs K steps at the checkpoint's timesteps t_0 > ... > t_{K-1}:
the model's flow prediction v gives the clean estimate x0 = x_t - sigma(t) v; before the next step
x0 is noised again to sigma(t_{k+1}) with fresh noise, x = (1 - sigma) x0 + sigma * noise; the last
x0 is the chunk. Then the clean chunk runs once more at the context timestep (0: clean) to fill the
KV cache. sigma(t) is the training grid's: `FlowMatchScheduler(shift, sigma_min=0,
extra_one_step=True)` over 1000 steps (sigmas linspace(1, 0, 1001)[:-1] shifted by
shift * s / (1 + (shift - 1) s), timesteps 1000 * sigma), read at the grid timestep nearest t; with
`warp_denoising_step` the listed steps are indices into that grid (t_k = grid[1000 - step_k]).
Source: guandeh17/Self-Forcing pipeline/causal_inference.py, utils/wan_wrapper.py
(`_convert_flow_pred_to_x0`), utils/scheduler.py (`FlowMatchScheduler`). No JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TRAIN_TIMESTEPS = 1000


@dataclasses.dataclass(frozen=True)
class ChunkSchedule:
  """A checkpoint's per-chunk denoising (module doc); Self-Forcing's defaults.

  Attributes:
    denoising_step_list: the steps, descending (Self-Forcing 1000, 750, 500, 250).
    warp_denoising_step: the steps index the training grid (Self-Forcing: True; CausVid: False).
    shift: the flow shift of the training grid (Self-Forcing's `timestep_shift`, 5.0).
    context_noise: the timestep of the clean pass that fills the cache (0).

  Raises:
    ValueError: steps that are not descending within (0, 1000], or a shift <= 0.
  """
  denoising_step_list: tuple[float, ...] = (1000, 750, 500, 250)
  warp_denoising_step: bool = True
  shift: float = 5.0
  context_noise: float = 0.0

  def __post_init__(self):
    steps = tuple(float(s) for s in self.denoising_step_list)
    object.__setattr__(self, "denoising_step_list", steps)
    if not steps or any(not 0 < s <= TRAIN_TIMESTEPS for s in steps) or list(steps) != sorted(steps, reverse=True):
      raise ValueError(f"denoising_step_list={steps} must be descending timesteps in (0, {TRAIN_TIMESTEPS}]")
    if self.warp_denoising_step and any(s != int(s) for s in steps):
      raise ValueError(f"warp_denoising_step indexes the training grid: denoising_step_list={steps} must be ints")
    if not self.shift > 0:
      raise ValueError(f"shift must be > 0, got {self.shift}")

  def grid(self) -> tuple[np.ndarray, np.ndarray]:
    """The training grid's (timesteps, sigmas), float64 [1000] each, descending."""
    sigmas = np.linspace(1.0, 0.0, TRAIN_TIMESTEPS + 1)[:-1]
    sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
    return sigmas * TRAIN_TIMESTEPS, sigmas

  def timesteps(self) -> np.ndarray:
    """float64 [K] the timesteps the model is called at."""
    steps = np.asarray(self.denoising_step_list)
    if not self.warp_denoising_step:
      return steps
    grid = np.concatenate([self.grid()[0], [0.0]])
    return grid[TRAIN_TIMESTEPS - steps.astype(np.int64)]

  def sigma(self, timestep: float) -> float:
    """sigma of the grid timestep nearest `timestep` (the reference's argmin)."""
    grid, sigmas = self.grid()
    return float(sigmas[np.argmin(np.abs(grid - timestep))])

  def sigmas(self) -> np.ndarray:
    """float64 [K] sigma of each step's timestep."""
    return np.array([self.sigma(t) for t in self.timesteps()])
