"""Two things the quality check needs from `WanPipeline` that its public API does not offer yet.

1. `forced_attention(implementation)`: run the transformer's attention on one path ("lse",
   "fixed_m" or "auto", as `attention.local_attention` / `attention.usp_attention` take it). The
   pipeline always uses the default ("auto": the fixed-m gate decides, mesh-uniformly).
2. `captured_latents(pipe)`: the final denoised latents of a call (`run` returns only frames).

Both are stopgaps until the pipeline grows the hooks (requested: an `attention_implementation`
argument of `WanPipeline.run` / `transformer.forward` that is part of the compiled-step cache key,
and `GenerationResult.latents`). They are kept in this one module so that switching to the hooks
is one edit. How they work, and why it is safe:
- The transformer looks `attention.usp_attention` / `attention.local_attention` up on the
  `attention` package at trace time, so binding `implementation=` there while the pipeline traces
  changes the traced program. Compiled programs are cached by JAX (trace cache) and by the
  pipeline (`_COMPILED_STEPS`, keyed by shapes and mesh, not by the attention path), so both caches
  are emptied on entry and on exit: a program traced under one path is never reused under another.
  The cost is one recompile of the denoise step per forced run.
- `captured_latents` wraps the instance's `decode`, which `run` calls exactly once, with the final
  latents, before mapping them to pixels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import numpy as np

import attention
from attention.blockwise import IMPLEMENTATIONS
from pipelines import pipeline as pipeline_module


def _clear_compiled_programs() -> None:
  jax.clear_caches()
  pipeline_module._COMPILED_STEPS.clear()  # stopgap: see the module docstring


@contextlib.contextmanager
def forced_attention(implementation: str) -> Iterator[None]:
  """Within the block, every self- and cross-attention the pipeline traces uses `implementation`.

  Args:
    implementation: "auto" (the pipeline's default: fixed-m when the global gate admits it, else
      LSE), "lse" (online softmax, forced) or "fixed_m" (forced; NaN where the gate rejects).

  Raises:
    ValueError: an unknown implementation (before anything is patched).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown {implementation=}; expected one of {IMPLEMENTATIONS}")
  originals = {name: getattr(attention, name) for name in ("usp_attention", "local_attention")}
  _clear_compiled_programs()
  for name, fn in originals.items():
    setattr(attention, name, functools.partial(fn, implementation=implementation))
  try:
    yield
  finally:
    for name, fn in originals.items():
      setattr(attention, name, fn)
    _clear_compiled_programs()


@contextlib.contextmanager
def captured_latents(pipe: pipeline_module.WanPipeline) -> Iterator[list[np.ndarray]]:
  """Yields a list that receives the final latents (float32 [B, C, F, Hl, Wl]) of each call."""
  store: list[np.ndarray] = []
  decode = pipe.decode

  def decode_and_keep(latents):
    store.append(np.array(latents, np.float32))
    return decode(latents)

  pipe.decode = decode_and_keep
  try:
    yield store
  finally:
    del pipe.decode  # the class method shows through again
