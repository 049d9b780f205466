"""The XLA optimization effort the VAE decoder's programs compile at (JAX-free to import, so that
the command line checks its flag without loading JAX).

XLA's `exec_time_optimization_effort` is a number in [-1, 1], default 0. On TPU libtpu spends 10-30 s
of code generation per distinct large convolution at 0, and the decoder has 10. Wan 2.1 VAE 720p
bf16, v6e, compile CPU s at 0 -> -0.5 (libtpu's run-time estimate, `end_to_end.aot.collectives.
estimated_cycles`): one device, first chunk 216 -> 41 s (+15 %), later 201 -> 58 s (+9 %, +1.8 GiB
temp); split over 4 chips 173 -> 39 s (+33 %), 201 -> 59 s (+19 %): ~4x faster, +9 / +19 % decode.
"""

from __future__ import annotations

import numbers
from typing import Any

TPU_DECODE_COMPILE_EFFORT = -0.5


def decode_compile_effort(platform: str) -> float | None:
  """The effort the decoder's programs compile at on `platform` (a JAX device's `.platform`):
  `TPU_DECODE_COMPILE_EFFORT` on "tpu"; None elsewhere: JAX's own `jax_exec_time_optimization_effort`."""
  return TPU_DECODE_COMPILE_EFFORT if platform == "tpu" else None


def check_compile_effort(compile_effort: Any, platform: str) -> float | None:
  """The effort a decode on `platform` compiles at: `compile_effort` (a number, applied whatever
  JAX's global setting), or the platform's when None. Raises ValueError for a non-number or a
  number outside [-1, 1]."""
  if compile_effort is None:
    return decode_compile_effort(platform)
  if isinstance(compile_effort, bool) or not isinstance(compile_effort, numbers.Real) \
      or not -1.0 <= float(compile_effort) <= 1.0:
    raise ValueError(f"compile_effort={compile_effort!r} must be a number in [-1, 1] (XLA's "
                     "exec_time_optimization_effort), or None for the platform's")
  return float(compile_effort)


def effective_compile_effort(compile_effort: Any, platform: str) -> float:
  """The number the decoder's programs compile at on `platform` (what a video's settings record):
  `check_compile_effort`'s, or JAX's global `jax_exec_time_optimization_effort` where that is None
  (XLA's default 0 on a JAX without that setting: JAX 0.11 removed it). Raises as
  `check_compile_effort`."""
  effort = check_compile_effort(compile_effort, platform)
  if effort is not None:
    return effort
  import jax

  return float(getattr(jax.config, "jax_exec_time_optimization_effort", 0.0))
