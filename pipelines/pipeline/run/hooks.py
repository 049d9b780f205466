"""The denoising loop's hooks: progress, the NaN guard, the resume writer, per-step callbacks,
step-cache statistics and the LoRA scale of one call (`loop.StepHook`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from pipelines.parallel import distributed
from pipelines.pipeline.run import resume as resume_state
from pipelines.pipeline.run.loop import LoopState, StepHook
from pipelines.wan import step_cache as wan_step_cache


class NonFiniteLatentsError(FloatingPointError):
  """The latents became NaN or inf during denoising; the run stopped before decoding."""


class ProgressBar(StepHook):
  """diffusers' tqdm bar over the denoising steps, on stderr."""

  def __init__(self):
    self._bar = None

  def before_step(self, state: LoopState) -> None:
    if self._bar is None:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=state.steps, initial=state.first_step, desc="denoise", unit="step")

  def after_step(self, state: LoopState) -> None:
    self._bar.update(1)

  def on_end(self, state: LoopState, completed: bool) -> None:
    if self._bar is not None:
      self._bar.close()


class NanGuard(StepHook):
  """Stops the run with `NonFiniteLatentsError` after the first step whose latents hold NaN/inf
  (the flag is one reduction the compiled step returns anyway: a scalar read per step)."""

  def after_step(self, state: LoopState) -> None:
    if bool(distributed.to_host(state.finite)):
      return
    k = state.step
    raise NonFiniteLatentsError(
        f"latents hold NaN/inf after denoising step {k + 1}/{state.steps} (timestep "
        f"{float(state.timesteps[k]):.1f}, expert {state.experts[k]}); stopped before decoding, "
        "nothing was written. Usual causes: NaN/inf in the weights, or overflow in bfloat16 "
        "(try dtype='float32'); nan_guard=False (generate --no-nan-guard) lets it finish anyway")


class CheckpointSaver(StepHook):
  """Saves the denoising state every `every` steps and after the last (`resume.Writer`: a device
  copy now, the host copy and the atomic write on a thread while the next step runs)."""

  def __init__(self, writer: resume_state.Writer, every: int, *, tokens: int, mesh: Any,
               cache_stats: StepCacheStats | None = None):
    self.writer, self.every, self.tokens, self.mesh = writer, every, tokens, mesh
    self.cache_stats = cache_stats

  def after_step(self, state: LoopState) -> None:
    done = state.step + 1
    if done % self.every and done != state.steps:
      return
    saved = {"latents": state.latents, "solver": state.solver}
    if state.cache is not None:
      saved["step_cache"] = wan_step_cache.for_checkpoint(state.cache, tokens=self.tokens, mesh=self.mesh)
      record = None if self.cache_stats is None or not self.writer.enabled else self.cache_stats.device_record()
      if record is not None:
        saved[StepCacheStats.CHECKPOINT_KEY] = record
    self.writer.save(done, saved)

  def on_end(self, state: LoopState, completed: bool) -> None:
    self.writer.close()  # the last state is on disk before anything else can fail


class OnStep(StepHook):
  """Calls `fn(step, seconds)` after each step."""

  def __init__(self, fn: Callable[[int, float], None]):
    self.fn = fn

  def after_step(self, state: LoopState) -> None:
    self.fn(state.step, state.step_times[-1])


class CurrentTimestep(StepHook):
  """Keeps diffusers' `pipe.current_timestep` (the running step's timestep; None outside)."""

  def __init__(self, pipe: Any):
    self.pipe = pipe

  def before_step(self, state: LoopState) -> None:
    self.pipe._current_timestep = state.timesteps[state.step]

  def on_end(self, state: LoopState, completed: bool) -> None:
    self.pipe._current_timestep = None


class StepCacheStats(StepHook):
  """Collects the step cache's per-step (step, skipped, metric) device values, read at the end
  (no extra sync per step). A resumed run starts from the record saved in its checkpoint
  (`restore`), so the record covers every step of the video, not only those after the resume."""

  CHECKPOINT_KEY = "step_cache_record"  # float32 [steps, 3]: (step, skipped, metric) rows

  def __init__(self):
    self.per_step: list[tuple[int, Any]] = []
    self.earlier: list[tuple[int, bool, float]] = []

  def after_step(self, state: LoopState) -> None:
    if state.stats is not None:
      self.per_step.append((state.step, state.stats))

  def restore(self, rows: Any) -> None:
    """The record before a resume: float32 [n, 3] rows as `device_record` saved them (None: none)."""
    self.earlier = [] if rows is None else [(int(k), bool(s), float(m)) for k, s, m in np.asarray(rows)]

  def device_record(self) -> Any:
    """float32 [n, 3] (step, skipped, metric) of every step so far, earlier ones included, as one
    device array for the checkpoint (no host sync), or None when there is none."""
    local = lambda x: x.addressable_data(0).astype(jnp.float32)  # noqa: E731 (a replicated value's copy here)
    rows = [jnp.asarray(row, jnp.float32) for row in self.earlier]
    rows += [jnp.stack([jnp.float32(k), local(s["skipped"]), local(s["metric"])]) for k, s in self.per_step]
    return jnp.stack(rows) if rows else None

  def record(self) -> list[tuple[int, bool, float]]:
    """[(step, skipped, metric)] of every step of the video (a resumed run's earlier ones first)."""
    return self.earlier + [(k, bool(distributed.to_host(s["skipped"])), float(distributed.to_host(s["metric"])))
                           for k, s in self.per_step]


class CallLoraScale(StepHook):
  """The LoRA scale of one call (diffusers' `attention_kwargs={"scale": s}`, which multiplies its
  LoRA layers' scaling by s for the call): the pipeline's scale becomes `previous * s` before the
  first step and is restored to `previous` at the end, however the loop ends.

  Args:
    pipe: has `lora_scale` and `set_lora_scale(s) -> previous` (`LoraLoaderMixin`).
    scale: s.
  """

  def __init__(self, pipe: Any, scale: float):
    self.pipe, self.scale = pipe, scale
    self.previous: float | None = None

  def before_step(self, state: LoopState) -> None:
    if self.previous is None:
      self.previous = self.pipe.set_lora_scale(self.pipe.lora_scale * self.scale)

  def on_end(self, state: LoopState, completed: bool) -> None:
    if self.previous is not None:
      self.pipe.set_lora_scale(self.previous)
      self.previous = None
