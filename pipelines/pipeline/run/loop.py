"""The denoising loop: steps the latents through the schedule; side work is done by hooks.

A hook (`StepHook`) sees the loop's state before each step, after each step and at the end; it
may read the state and replace the latents or text states (diffusers' `callback_on_step_end` does),
raise to stop the run (the NaN guard), or write something out (the resume writer). A new feature
is a new hook or a new step function, not a block in this loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class LoopState:
  """What the loop carries from step to step (hooks read it and may replace latents / text).

  Attributes:
    timesteps: the schedule's timesteps, one per step (numpy).
    experts: the expert of each step (0, or 1 for Wan 2.2's low-noise expert).
    latents: float32 [B', C, F, Hl, Wl], replicated over the mesh.
    solver: the scheduler's state.
    text: [B' or 2 B', L, text_dim] text states in the model dtype.
    cache: the step-cache state or None.
    condition: the step's conditioning beyond the text (`conditioning.ImageConditioning` for
      image-to-video), or None; replicated, read by every step.
    first_step: the step the loop starts at (> 0 when resuming).
    step: the step running or just run (-1 before the first).
    finite: bool [] device flag of the last step: all latents finite.
    stats: the last step's step-cache statistics (None without a cache).
    step_times: seconds of each step run (dispatch to latents ready).
  """
  timesteps: np.ndarray
  experts: list[int]
  latents: Any
  solver: Any
  text: Any
  cache: Any = None
  condition: Any = None
  first_step: int = 0
  step: int = -1
  finite: Any = None
  stats: Any = None
  step_times: list[float] = dataclasses.field(default_factory=list)

  @property
  def steps(self) -> int:
    return len(self.experts)


class StepHook:
  """Side work of the denoising loop; each method does nothing unless overridden."""

  def before_step(self, state: LoopState) -> None:
    """Before step `state.step` runs."""

  def after_step(self, state: LoopState) -> None:
    """After step `state.step` ran (latents ready on the device)."""

  def on_end(self, state: LoopState, completed: bool) -> None:
    """Once, however the loop ends (`completed`: no exception; the loop may have been interrupted)."""


StepFn = Callable[[LoopState], tuple[Any, Any, Any, Any, Any]]


def denoise(state: LoopState, step: StepFn, hooks: Sequence[StepHook] = (),
            interrupted: Callable[[], bool] = lambda: False) -> LoopState:
  """Runs steps `state.first_step` .. `state.steps - 1`, calling the hooks around each.

  Args:
    state: the loop's state; updated in place and returned.
    step: runs step `state.step` and returns (latents, solver, finite, cache, stats).
    hooks: called in order before and after each step, and in reverse order at the end.
    interrupted: checked before each step; once True the remaining steps are skipped (diffusers'
      `interrupt`: the latents reached so far are the result).

  Returns:
    `state`, after the last step run.
  """
  completed = False
  try:
    for k in range(state.first_step, state.steps):
      if interrupted():
        break
      state.step = k
      for hook in hooks:
        hook.before_step(state)
      start = time.perf_counter()
      state.latents, state.solver, state.finite, state.cache, state.stats = step(state)
      jax.block_until_ready(state.latents)
      state.step_times.append(time.perf_counter() - start)
      for hook in hooks:
        hook.after_step(state)
    completed = True
  finally:
    _end(hooks, state, completed)
  return state


def _end(hooks: Sequence[StepHook], state: LoopState, completed: bool) -> None:
  """Every hook's `on_end`, in reverse order, each even when an earlier one raised; the first
  error is raised after all ran (unless the loop is already raising one)."""
  error = None
  for hook in reversed(hooks):
    try:
      hook.on_end(state, completed)
    except BaseException as e:  # noqa: BLE001 (re-raised below)
      error = error or e
  if error is not None and completed:
    raise error
