"""What computing the text's cross-attention K/V once per prompt saves per denoising step.

  python -m end_to_end.bench.text_kv --preset 1.3b-width --steps 4 --rounds 4

One pipeline (a benchmark preset's architecture, random weights), both step programs compiled
first, then `--rounds` pairs of runs in alternating order (K/V once before the loop, the pipeline's
default; K/V recomputed inside every step, `CallOptions(text_kv_once=False)`; the VAE is skipped),
so that drift of a noisy machine falls on both sides. Prints the median and the fastest step time of
each side over all rounds, their ratios, XLA's FLOP count of each step program (the machine-free
measure of the work saved), the one-off cost of the precompute, and whether the two latents are
bit-identical.

  python -m end_to_end.bench.text_kv --image --preset 1.3b-width --steps 4 --rounds 4

`--image`: what holding the image tokens' K/V as well saves (Wan 2.1 I2V: `add_k_proj`,
`norm_added_k`, `add_v_proj` of the 257 CLIP tokens in every block). The preset's transformer gets
the image branch (36 input channels, CLIP width 1280) and the compiled step (`pipeline.run.step`, CFG
on, one video) runs with the text K/V held on both sides; one side also holds the image's (the
pipeline's default), the other makes them from the CLIP states inside every step (what every step
did before). Same report: median and fastest step, ratio, XLA's FLOPs, the precompute, equality.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
  from end_to_end.bench.presets import PRESETS

  ap = argparse.ArgumentParser(prog="bench_text_kv", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=list(PRESETS), default="1.3b-width")
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (once, every step)")
  ap.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the preset's)")
  ap.add_argument("--image", action="store_true",
                  help="measure the image tokens' K/V held (Wan 2.1 I2V) instead of the text's")
  args = ap.parse_args(argv)
  if args.steps < 1 or args.rounds < 1:
    ap.error("--steps and --rounds must be >= 1")
  if args.image:
    return _image_main(args)

  import jax

  from end_to_end.bench import presets as bench_presets
  from pipelines.pipeline.run.call_options import CallOptions
  from pipelines.pipeline.checked.request import GenerationRequest

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
  config = pipe.transformer_config
  print(f"preset {args.preset}: D {config.dim}, {config.num_layers} layers, {request.tokens} video tokens, "
        f"{request.max_sequence_length} text tokens, {request.rows} rows (guidance {guidance}), {args.steps} steps")
  _report("K/V", times, latents, flops, f"the one-off K/V precompute {once_cost * 1e3:.1f} ms")
  return 0


def _image_main(args: argparse.Namespace) -> int:
  """`--image`: the compiled I2V step with the image K/V held vs made in every step (module docstring)."""
  import jax
  import numpy as np

  from end_to_end.bench import presets as bench_presets

  preset = bench_presets.PRESETS[args.preset]
  steps, params, inputs = _image_setup(preset, args)
  plan, condition, text, guidance, noise, schedule = inputs
  start = time.perf_counter()
  kv = {"once": jax.block_until_ready(steps.text_kv(params, text, condition.image_states(cfg=True), plan=plan)),
        "every step": steps.text_kv(params, text, plan=plan)}  # both hold the text's
  once_cost = time.perf_counter() - start  # includes its compile: the first call

  def run(side: str) -> tuple[list[float], np.ndarray]:
    latents, solver = jax.numpy.asarray(noise), schedule.init_state(noise.shape, jax.numpy.float32)
    program = steps.get(params, latents, solver, kv[side], guidance, None, condition, plan=plan, cfg=True)
    times = []
    for _ in range(args.steps):
      begin = time.perf_counter()
      latents, solver, *_ = program(params, latents, solver, kv[side], guidance, None, condition)
      jax.block_until_ready(latents)
      times.append(time.perf_counter() - begin)
    return times, np.asarray(latents)

  latents = {side: run(side)[1] for side in kv}  # compile both
  flops = {side: _flops(program) for side, program in zip(kv, steps.programs()[-2:])}
  times: dict[str, list[float]] = {side: [] for side in kv}
  for r in range(args.rounds):
    for side in (list(kv) if r % 2 == 0 else list(kv)[::-1]):
      times[side] += run(side)[0]
      print(f"round {r + 1} image K/V {side:>10}: steps {', '.join(f'{t * 1e3:.0f}' for t in times[side][-args.steps:])} ms",
            flush=True)
  print(f"preset {args.preset} + image branch: D {preset.transformer.dim}, {preset.transformer.num_layers} layers, "
        f"{preset.tokens} video tokens, {preset.max_sequence_length} text + 257 image tokens, 2 rows (CFG), "
        f"{args.steps} steps")
  _report("image K/V", times, latents, flops,
          f"text + image K/V precompute (first call, with its compile) {once_cost * 1e3:.0f} ms")
  return 0


def _report(what: str, times: dict[str, list[float]], latents: dict[str, Any], flops: dict[str, float | None],
            precompute: str) -> None:
  """The comparison's summary: median and fastest step of `what` held ("once") vs made in every
  step (seconds in `times`), the precompute's cost, whether the latents are bit-identical, and
  XLA's FLOPs of each step program where it counts them."""
  import numpy as np

  medians = {side: float(np.median(t)) for side, t in times.items()}
  fastest = {side: float(np.min(t)) for side, t in times.items()}
  print(f"median step: {what} once {medians['once'] * 1e3:.1f} ms, every step {medians['every step'] * 1e3:.1f} ms; "
        f"ratio every/once {medians['every step'] / medians['once']:.3f} (saves "
        f"{(medians['every step'] - medians['once']) * 1e3:.1f} ms/step); fastest step {fastest['once'] * 1e3:.1f} vs "
        f"{fastest['every step'] * 1e3:.1f} ms (ratio {fastest['every step'] / fastest['once']:.3f}); {precompute}; "
        f"latents bit-identical: {bool(np.array_equal(latents['once'], latents['every step']))}")
  if None not in flops.values():
    print(f"XLA's FLOP count of one step: {what} once {flops['once'] / 1e9:.2f} GFLOP, every step "
          f"{flops['every step'] / 1e9:.2f} GFLOP (ratio {flops['every step'] / flops['once']:.3f})")


def _image_setup(preset, args):
  """(CompiledSteps, weights, (plan, ImageConditioning, text states [2, L, text_dim], guidance, noise
  [1, C, F, Hl, Wl], UniPC schedule)) for the preset's transformer with a Wan 2.1 I2V image branch."""
  import dataclasses

  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from pipelines.parallel.plan import ParallelPlan
  from pipelines.pipeline.run.step import CompiledSteps
  from pipelines.wan import schedulers
  from pipelines.wan.conditioning import ImageConditioning
  from pipelines.wan.transformer import init_transformer

  base = preset.transformer
  config = dataclasses.replace(base, in_channels=2 * base.out_channels + 4, image_dim=1280, added_kv_proj_dim=base.dim)
  dtype = jnp.dtype(preset.dtype)
  graphdef, params = nnx.split(init_transformer(config, 0, dtype))
  _, c, f, hl, wl = preset.latent_shape
  rng = np.random.default_rng(0)
  condition = ImageConditioning(
      video_BCFHW=jnp.asarray(rng.standard_normal((1, config.in_channels - c, f, hl, wl)), jnp.float32),
      image_BJI=jnp.asarray(rng.standard_normal((1, 257, 1280)), dtype))
  text = jnp.asarray(rng.standard_normal((2, preset.max_sequence_length, config.text_dim)), dtype)
  guidance = jnp.float32(preset.guidance if args.guidance is None else args.guidance)
  noise = rng.standard_normal(preset.latent_shape).astype(np.float32)
  schedule = schedulers.UniPCConfig(flow_shift=preset.flow_shift).set_timesteps(args.steps)
  return CompiledSteps(graphdef), params, (ParallelPlan.single(), condition, text, guidance, noise, schedule)


def _flops(program) -> float | None:
  """The compiled program's FLOPs by XLA's cost analysis (None where the backend gives none)."""
  cost = program.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"]) if cost and "flops" in cost else None


if __name__ == "__main__":
  sys.exit(main())
