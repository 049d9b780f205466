"""What computing the text's cross-attention K/V once per prompt saves per denoising step.

  python -m end_to_end.bench_text_kv --preset 1.3b-width --steps 4 --rounds 4

One pipeline (a benchmark preset's architecture, random weights), both step programs compiled
first, then `--rounds` pairs of runs in alternating order (K/V once before the loop, the pipeline's
default; K/V recomputed inside every step, `CallOptions(text_kv_once=False)`; the VAE is skipped),
so that drift of a noisy machine falls on both sides. Prints the median and the fastest step time of
each side over all rounds, their ratios, XLA's FLOP count of each step program (the machine-free
measure of the work saved), the one-off cost of the precompute, and whether the two latents are
bit-identical.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
  from end_to_end.bench_presets import PRESETS

  ap = argparse.ArgumentParser(prog="bench_text_kv", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=list(PRESETS), default="1.3b-width")
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (once, every step)")
  ap.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the preset's)")
  args = ap.parse_args(argv)
  if args.steps < 1 or args.rounds < 1:
    ap.error("--steps and --rounds must be >= 1")

  import jax
  import numpy as np

  from end_to_end import bench_presets
  from pipelines.pipeline.call_options import CallOptions
  from pipelines.pipeline.request import GenerationRequest

  preset = bench_presets.PRESETS[args.preset]
  pipe = bench_presets.init_ours(preset, seed=0)
  guidance = preset.guidance if args.guidance is None else args.guidance
  request = GenerationRequest.build(
      pipe.facts, "a red fox running through snow", height=preset.height, width=preset.width,
      num_frames=preset.frames, num_inference_steps=args.steps, guidance_scale=guidance, seed=0,
      max_sequence_length=preset.max_sequence_length, decode=False)
  times: dict[str, list[float]] = {"once": [], "every step": []}
  options = {side: CallOptions(progress=False, text_kv_once=side == "once", on_step=lambda k, s, side=side:
                               times[side].append(s)) for side in times}
  latents = {side: pipe.generate(request, option).latents for side, option in options.items()}  # compile
  flops = {side: _flops(program) for side, program in zip(options, pipe.compiled_steps.programs()[-2:])}
  for side in times:
    times[side].clear()
  for r in range(args.rounds):
    for side in (list(options) if r % 2 == 0 else list(options)[::-1]):
      pipe.generate(request, options[side])
      steps = ", ".join(f"{t * 1e3:.0f}" for t in times[side][-args.steps:])
      print(f"round {r + 1} K/V {side:>10}: steps {steps} ms", flush=True)
  text = jax.numpy.zeros((request.rows, request.max_sequence_length, pipe.transformer_config.text_dim), pipe.dtype)
  params = pipe.weights.experts[0]
  jax.block_until_ready(pipe.compiled_steps.text_kv(params, text, plan=request.plan))  # compile
  start = time.perf_counter()
  jax.block_until_ready(pipe.compiled_steps.text_kv(params, text, plan=request.plan))
  once_cost = time.perf_counter() - start
  once, every = float(np.min(times["once"])), float(np.min(times["every step"]))
  medians = {side: float(np.median(t)) for side, t in times.items()}
  config = pipe.transformer_config
  print(f"preset {args.preset}: D {config.dim}, {config.num_layers} layers, {request.tokens} video tokens, "
        f"{request.max_sequence_length} text tokens, {request.rows} rows (guidance {guidance}), {args.steps} steps")
  print(f"median step: K/V once {medians['once'] * 1e3:.1f} ms, K/V every step {medians['every step'] * 1e3:.1f} ms; "
        f"ratio every/once {medians['every step'] / medians['once']:.3f} (saves "
        f"{(medians['every step'] - medians['once']) * 1e3:.1f} ms/step); fastest step: {once * 1e3:.1f} vs "
        f"{every * 1e3:.1f} ms (ratio {every / once:.3f}); the one-off K/V precompute {once_cost * 1e3:.1f} ms; "
        f"latents bit-identical: {bool(np.array_equal(latents['once'], latents['every step']))}")
  if None not in flops.values():
    print(f"XLA's FLOP count of one step: K/V once {flops['once'] / 1e9:.1f} GFLOP, every step "
          f"{flops['every step'] / 1e9:.1f} GFLOP (ratio {flops['every step'] / flops['once']:.3f})")
  return 0


def _flops(program) -> float | None:
  """The compiled program's FLOPs by XLA's cost analysis (None where the backend gives none)."""
  cost = program.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"]) if cost and "flops" in cost else None


if __name__ == "__main__":
  sys.exit(main())
