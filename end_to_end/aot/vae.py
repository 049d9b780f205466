"""Ahead-of-time compile of the VAE decoder's two chunk programs for a TPU topology, without a TPU.

What is compiled: the programs `pipelines.wan.vae.decode` runs (`vae.lower_decode_programs`: the
first chunk, latent frame 0 -> 1 video frame, and the later chunk, each later latent frame -> 4
frames with the causal feature cache donated), or with `split` the programs of `decode_parallel`
(the latent rows split over every device of this process). A decode of F latent frames runs the
first program once and the later one F - 1 times, so these two compiles are the whole decode stage.
They compile at the optimization effort the pipeline uses on the devices' platform
(`vae.decode_compile_effort`: -0.5 on TPU), or at the one given. Weights, latents and cache are
`jax.ShapeDtypeStruct`s: nothing is allocated.

Reported per program (XLA's numbers, per device): compile wall and CPU seconds, `memory_analysis()`,
`cost_analysis()`, the collectives in the compiled HLO, libtpu's estimate of the run time in cycles
(`aot.collectives.estimated_cycles`, to compare two efforts), and the number of distinct convolutions in the
lowered program (a TPU compile pays per distinct convolution: shape, kernel and padding; the same
convolution repeated is nearly free). A COMPILE-TIME report, not a runtime measurement.
libtpu and its environment: `end_to_end/aot/step.py`.
"""

from __future__ import annotations

import re
import time
from typing import Any

_CONV = re.compile(r"stablehlo\.convolution.*?window = \{([^}]*)\}.*?:\s*\(([^)]*)\)")


def distinct_convolutions(stablehlo: str) -> tuple[int, int]:
  """(convolutions, distinct convolutions) in a lowered program's StableHLO text; distinct by
  window (strides, padding, dilation) and operand types."""
  found = [m.groups() for m in map(_CONV.search, stablehlo.splitlines()) if m]
  return len(found), len(set(found))


def abstract_vae(config: Any, dtype: Any) -> Any:
  """A `WanVAE` whose parameters are `jax.ShapeDtypeStruct`s in `dtype` (nothing allocated)."""
  import jax
  import numpy as np

  from pipelines.wan import vae as V

  return V.WanVAE(config, {k: jax.ShapeDtypeStruct(V.to_jax_layout(k, np.empty(s, np.bool_)).shape, dtype)
                           for k, s in config.param_shapes().items()})


def compile_vae_decode(devices: list[Any], *, height: int, width: int, vae: str = "wan2.1",
                       dtype: str = "bfloat16", split: bool = False,
                       programs: tuple[str, ...] = ("first", "later"),
                       compile_effort: float | None = None, breakdown: bool = False) -> list[dict[str, Any]]:
  """AOT-compiles the VAE decoder's first-chunk and later-chunk programs (module docstring).

  Args:
    devices: the topology's devices (`step.topology_devices`) or local ones.
    height, width: the video's size in pixels (multiples of the VAE's spatial factor: 8 for
      "wan2.1", 16 for "wan2.2").
    vae: a `vae.VAE_PRESETS` name: "wan2.1" (Wan 2.1 and 2.2 A14B), "wan2.2" (TI2V-5B),
      "tiny" (tests).
    dtype: "bfloat16" or "float32", the VAE's weights and activations.
    split: False: one device (`decode`); True: the latent rows over every device of this process
      (`decode_parallel`; a TPU host of v6e:2x4 holds 4 of the 8 chips).
    programs: which of "first" and "later" to compile.
    compile_effort: XLA's optimization effort; None: the pipeline's on the devices' platform
      (`vae.decode_compile_effort`: -0.5 on TPU, JAX's own setting elsewhere).
    breakdown: also each program's modelled time by op class (`end_to_end.aot.breakdown.analyse`,
      the whole program: a decode has no block loop).

  Returns:
    One dict per program (program "first", "later"): stage "decode", vae, dtype, height, width, devices,
    split, compile_effort, convolutions and distinct_convolutions (lowered program), compile_s (wall),
    compile_cpu_s (this process's CPU seconds, steadier on a shared host), memory_analysis,
    cost_analysis, collectives (`step.compiled_analysis`); with `breakdown`, breakdown.

  Raises:
    ValueError: an unknown vae or dtype, or a size that is not a multiple of the spatial factor.
  """
  import jax
  import jax.numpy as jnp

  from pipelines.wan import vae as V
  from pipelines.wan.vae import VAE_PRESETS, effective_compile_effort

  if vae not in VAE_PRESETS:
    raise ValueError(f"vae {vae!r}: use one of {sorted(VAE_PRESETS)}")
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"dtype {dtype!r} must be 'bfloat16' or 'float32'")
  config = VAE_PRESETS[vae]
  s = config.spatial_factor
  if height % s or width % s or min(height, width) < s:
    raise ValueError(f"{height}x{width} must be positive multiples of {s} for the {vae} VAE")
  lowered_programs = V.lower_decode_programs(abstract_vae(config, jnp.dtype(dtype)), batch=1,
                                             latent_height=height // s, latent_width=width // s, devices=devices,
                                             split=split, compile_effort=compile_effort)
  effort = effective_compile_effort(compile_effort, devices[0].platform)
  decoding = sum(d.process_index == jax.process_index() for d in devices)  # `row_mesh`: this process's
  meta = dict(stage="decode", vae=vae, dtype=dtype, height=height, width=width, devices=decoding if split else 1,
              split=split, compile_effort=effort)
  return [_program_row(name, lowered, meta, devices[0].device_kind, breakdown)
          for name, lowered in lowered_programs.items() if name in programs]


def _program_row(name: str, lowered: Any, meta: dict[str, Any], device_kind: str, breakdown: bool) -> dict[str, Any]:
  """One decode program compiled: `meta`, its convolutions, compile times, XLA's analyses and, with
  `breakdown`, its modelled time by op class (the whole program)."""
  from end_to_end.aot.step import compiled_analysis

  convs, distinct = distinct_convolutions(lowered.as_text())
  start, cpu_start = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  row = dict(meta, program=name, convolutions=convs, distinct_convolutions=distinct,
             compile_s=time.perf_counter() - start, compile_cpu_s=time.process_time() - cpu_start,
             **compiled_analysis(compiled))
  if breakdown:
    from end_to_end.aot.breakdown import analyse
    row["breakdown"] = analyse(compiled.as_text(), device_kind, meta["devices"],
                               program=f"decode {name}-chunk program", loop=False)
  return row
