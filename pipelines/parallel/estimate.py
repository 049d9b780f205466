"""About how long the denoising of a run will take, from its shapes, before any compute.

The estimate is the transformer's arithmetic (matmul FLOPs of every block, both CFG rows, every
step) over a throughput per device kind. It is meant to catch the hour-long run started by
mistake (a real model's preset on a laptop CPU), not to predict to the second: text encoding and
VAE decoding come on top, and the first step also compiles.
"""

from __future__ import annotations

import dataclasses
import os

from pipelines.parallel.token_facts import TokenFacts

# Sustained FLOP/s of one CPU core on the transformer step (XLA:CPU; float32 and bfloat16 alike).
# Measured with the tiny model at 832x480 x 81 frames (32760 tokens, attention-bound, 2.3 TFLOP per
# step) on 2 cores of x86 machines: 61-64 s per step (18 GFLOP/s per core), 85 s (13), and 125 s
# (9) with the cores shared with other work; at 7800 tokens 4.2 s (17), float32 and bfloat16 alike.
# 13 is the middle. Simulated devices share these cores: the mesh does not divide the work on CPU.
CPU_FLOPS_PER_CORE = 13e9
# One GPU or TPU device, by dtype: an assumption (~40 % of a current datacentre accelerator's
# dense peak), not a measurement; the mesh's devices divide the work.
ACCELERATOR_FLOPS = {"bfloat16": 2e14, "float32": 5e13}
# Runs whose denoising is estimated at this many seconds or more get a line before they start.
LONG_S = 120.0


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The estimate and what it was computed from.

  Attributes:
    seconds_per_step: one denoising step.
    steps: denoising steps.
    tokens: T, video tokens per frame set (after the patch embedding).
    layers: transformer blocks a forward runs (a VACE model's VACE blocks too).
    rows: transformer rows per step (2 under classifier-free guidance).
    basis: the throughput assumed, in words (e.g. "2 CPU cores").
  """
  seconds_per_step: float
  steps: int
  tokens: int
  layers: int
  rows: int
  basis: str

  @property
  def seconds(self) -> float:
    return self.seconds_per_step * self.steps


def forward_blocks(config) -> int:
  """Transformer blocks one forward runs: the `num_layers` main blocks, and a VACE model's V VACE
  blocks (`WanTransformerConfig.vace_layers`: the same block over the VACE context's tokens)."""
  return config.num_layers + len(config.vace_layers or ())


def held_kv_bytes(config, token_facts: TokenFacts, *, rows: int, dtype_bytes: int) -> int:
  """Bytes of the cross-attention K/V one device holds for the whole run (`transformer.text_kv`,
  computed once before the loop): keys and values of the text [Z, rows, L, N, H] and, with an image
  branch, of the image [Z, rows, P, N, H] (L + P: `token_facts.context_tokens`), in the model dtype;
  `rows` the device's rows (2 under CFG, 1 on a CFG-split mesh). One expert's: the pipeline keeps
  only the current expert's K/V. A VACE model's VACE blocks hold their text K/V too."""
  return 2 * forward_blocks(config) * rows * token_facts.context_tokens * config.dim * dtype_bytes


def step_flops(config, tokens: int, text_tokens: int, rows: int) -> float:
  """Matmul FLOPs of one transformer forward on `rows` videos of `tokens` tokens.

  Per block and row, with D = N * H: self-attention projections 8 T D^2 and scores + values
  4 T^2 D; cross-attention q/o projections 4 T D^2, k/v projections of the text 4 L D^2, scores +
  values 4 T L D; feed-forward 4 T D ffn; the VACE blocks as many more (`forward_blocks`). Norms,
  RoPE and the embeddings are left out (a few %).

  Args:
    config: a `WanTransformerConfig`.
  """
  d, t, l = config.dim, tokens, text_tokens
  block = 12 * t * d * d + 4 * t * t * d + 4 * l * d * d + 4 * t * l * d + 4 * t * d * config.ffn_dim
  return float(block * forward_blocks(config) * rows)


def estimate(config, token_facts: TokenFacts, *, frames: int, height: int, width: int, steps: int, cfg: bool,
             dtype: str, backend: str, devices: int, cpu_cores: int | None = None) -> Estimate:
  """The denoising time of a run (module docstring).

  Args:
    config: the `WanTransformerConfig`.
    token_facts: how the model's videos become tokens, L the run's text length (`TokenFacts`).
    frames, height, width, steps: the run's video size and step count.
    cfg: classifier-free guidance on (two transformer rows per step).
    dtype: "float32" or "bfloat16" (matters on accelerators only).
    backend: "cpu", "gpu", "tpu", ...
    devices: devices of the mesh (divide the work on an accelerator, not on CPU).
    cpu_cores: cores available to this process (default: the ones it may run on).
  """
  tokens = token_facts.video_tokens(frames, height, width)
  rows = 2 if cfg else 1
  flops = step_flops(config, tokens, token_facts.text_tokens, rows)
  if backend == "cpu":
    cores = max(cpu_cores or _usable_cores(), 1)
    rate, basis = CPU_FLOPS_PER_CORE * cores, f"{cores} CPU core{'s' if cores > 1 else ''}"
  else:
    rate = ACCELERATOR_FLOPS.get(dtype, ACCELERATOR_FLOPS["float32"]) * devices
    basis = f"{devices} {backend} device{'s' if devices > 1 else ''}, assumed {rate / devices / 1e12:.0f} TFLOP/s each"
  return Estimate(flops / rate, steps, tokens, forward_blocks(config), rows, basis)


def _usable_cores() -> int:
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def _duration(seconds: float) -> str:
  if seconds < 120:
    return f"{seconds:.0f} s"
  if seconds < 2 * 3600:
    return f"{seconds / 60:.0f} min"
  return f"{seconds / 3600:.1f} h"


def long_run_line(e: Estimate) -> str | None:
  """One line for a run whose denoising is estimated at `LONG_S` or more; None for a short run."""
  if e.seconds < LONG_S:
    return None
  return (f"this run is long: denoising alone takes about {_duration(e.seconds)} ({e.steps} steps x "
          f"~{_duration(e.seconds_per_step)}: {e.tokens} tokens x {e.layers} layers x {e.rows} "
          f"row{'s' if e.rows > 1 else ''} on {e.basis}; a rough estimate); a smaller --size, "
          "--frames or --steps is faster")
