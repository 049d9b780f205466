"""diffusers' `callback_on_step_end` as a loop hook (`WanPipeline.__call__` documents the contract)."""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pipelines.parallel import distributed
from pipelines.pipeline.checked.inputs import CALLBACK_TENSOR_INPUTS, host_array, not_a
from pipelines.pipeline.run.loop import LoopState, StepHook


def check_callback(callback: Any, tensor_inputs: Any) -> list[str]:
  """Checks diffusers' `callback_on_step_end` and `callback_on_step_end_tensor_inputs`.

  Returns:
    the tensor names as a list.

  Raises:
    ValueError: a callback that is not callable, or names outside `CALLBACK_TENSOR_INPUTS`.
  """
  if callback is not None and not callable(callback):
    raise ValueError(f"callback_on_step_end={callback!r} must be None or a callable "
                     f"callback(pipe, step_index, timestep, callback_kwargs) -> dict{not_a(callback)}")
  if (not isinstance(tensor_inputs, (list, tuple))
      or any(not isinstance(k, str) or k not in CALLBACK_TENSOR_INPUTS for k in tensor_inputs)):
    bad = (tensor_inputs if not isinstance(tensor_inputs, (list, tuple))
           else [k for k in tensor_inputs if not isinstance(k, str) or k not in CALLBACK_TENSOR_INPUTS])
    raise ValueError(f"callback_on_step_end_tensor_inputs={tensor_inputs!r} must be a list of names "
                     f"from {list(CALLBACK_TENSOR_INPUTS)}; not allowed: {bad!r}")
  return list(tensor_inputs)


class StepEndCallback(StepHook):
  """Calls `callback(pipe, k, timestep, tensors)` after step k and applies its replacements.

  Args:
    pipe: passed to the callback (diffusers passes the pipeline).
    callback: diffusers' `callback_on_step_end`.
    tensor_inputs: names from `CALLBACK_TENSOR_INPUTS` handed to it.
    videos: B', the rows of the cond half of the text states.
    cfg: whether the text states hold uncond rows too.
    sharding: where replacements are put (replicated over the mesh).
  """

  def __init__(self, pipe: Any, callback: Callable, tensor_inputs: Sequence[str], *, videos: int, cfg: bool,
               sharding: Any):
    self.pipe, self.callback, self.tensor_inputs = pipe, callback, list(tensor_inputs)
    self.videos, self.cfg, self.sharding = videos, cfg, sharding

  def after_step(self, state: LoopState) -> None:
    """Raises ValueError: the callback returned something other than a dict, or a replacement that
    is not a real array of the current shape, or holds NaN/inf."""
    k, videos, text = state.step, self.videos, state.text
    available = {"latents": lambda: jnp.copy(state.latents),  # a copy: the next step donates them
                 "prompt_embeds": lambda: text[:videos],
                 "negative_prompt_embeds": lambda: text[videos:] if self.cfg else None}
    given = {name: available[name]() for name in self.tensor_inputs}
    out = self.callback(self.pipe, k, state.timesteps[k], dict(given))
    if not isinstance(out, dict):
      raise ValueError(f"callback_on_step_end returned {reprlib.repr(out)} after step {k}; it must return "
                       "a dict (diffusers' contract): its callback_kwargs, replacements, or {} for none")
    latents = _replacement(out, given, "latents", tuple(state.latents.shape), k)
    if latents is not None:
      state.latents = distributed.put_replicated(latents.astype(np.float32), self.sharding)
    rows = (videos, *text.shape[1:])
    cond = _replacement(out, given, "prompt_embeds", rows, k)
    uncond = _replacement(out, given, "negative_prompt_embeds", rows, k) if self.cfg else None
    if cond is not None or uncond is not None:
      host = distributed.to_host(text).copy()
      for part, start in ((cond, 0), (uncond, videos)):
        if part is not None:
          host[start:start + videos] = np.asarray(jnp.asarray(part).astype(text.dtype))
      state.text = distributed.put_replicated(host, self.sharding)


def _replacement(out: dict, given: dict, name: str, shape: tuple[int, ...], k: int) -> np.ndarray | None:
  """The callback's replacement for `name` as a host array, or None when it returned none (or the
  tensor it was given)."""
  value = out.get(name)
  if value is None or value is given.get(name):
    return None
  array = host_array(value)
  if array is None or array.shape != shape or not np.isfinite(array).all():
    what = ("not an array of real numbers" if array is None else f"shape {array.shape}"
            if array.shape != shape else f"{int((~np.isfinite(array)).sum())} NaN/inf values")
    raise ValueError(f"callback_on_step_end returned {name} ({what}) after step {k}; a replacement "
                     f"must be a finite array of the current shape {shape}")
  return array
