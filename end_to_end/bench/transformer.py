r"""Benchmark: compile time and per-step time of the Wan transformer (random init), not a test.

Default: the Wan 2.1 1.3B architecture (30 layers, D 1536, N 12, ffn 8960) at 17 frames 128x128
(latents [1, 16, 5, 16, 16] -> 320 tokens) with 512 text tokens, fp32, one device:

  python -m end_to_end.bench.transformer
  python -m end_to_end.bench.transformer --dtype bfloat16 --batch 2
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m end_to_end.bench.transformer \
      --ring 2 --ulysses 2       # sequence-parallel (fake CPU devices)

Compile time is `jit(...).lower(...).compile()` wall time; the step time is the mean over
`--steps` calls after one warm-up call. `--quantize none --quantize int8` times both settings of
the same random weights in one process, their steps interleaved:

  python -m end_to_end.bench.transformer --dtype bfloat16 --layers 2 --height 64 --width 64 \
      --text-len 64 --steps 10 --quantize none --quantize int8 --quantize int8-w8a8
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import attention
from attention.mesh import MeshSpec
from pipelines.commands.help import HelpFormatter
from pipelines.parallel.plan import ParallelPlan
from pipelines.wan.transformer import count_params, forward, init_transformer, PRESETS, quantize_transformer


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
  parser.add_argument("--preset", default="wan2.1-t2v-1.3b", choices=sorted(PRESETS))
  parser.add_argument("--frames", type=int, default=17)
  parser.add_argument("--height", type=int, default=128)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--text-len", type=int, default=512)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--ring", type=int, default=0, help="ring degree R (0: no mesh)")
  parser.add_argument("--ulysses", type=int, default=0, help="Ulysses degree U (0: no mesh)")
  parser.add_argument("--layers", type=int, default=None, help="override the number of blocks")
  parser.add_argument("--quantize", action="append", choices=("none", "int8", "fp8", "int8-w8a8"),
                      help="weight quantization (repeatable: each is timed, steps interleaved; default none)")
  args = parser.parse_args()

  config = PRESETS[args.preset]
  if args.layers is not None:
    config = dataclasses.replace(config, num_layers=args.layers)
  dtype = jnp.dtype(args.dtype)
  mesh = None
  if args.ring or args.ulysses:
    mesh = attention.make_mesh(ulysses=max(args.ulysses, 1), ring=max(args.ring, 1))
  plan = ParallelPlan.build(mesh, heads=config.num_attention_heads)
  frames = (args.frames - 1) // 4 + 1
  latent_shape = (args.batch, config.in_channels, frames, args.height // 8, args.width // 8)
  tokens = np.prod([n // p for n, p in zip(latent_shape[2:], config.patch_size)])
  print(f"{args.preset}: {config.num_layers} layers, D={config.dim}, N={config.num_attention_heads}, "
        f"ffn={config.ffn_dim}; {dtype.name}; latents {latent_shape} -> {tokens} tokens, "
        f"text {args.text_len}; mesh {'none' if mesh is None else MeshSpec(ulysses=max(args.ulysses, 1), ring=max(args.ring, 1))}; "
        f"backend {jax.default_backend()} x{jax.device_count()}")

  rng = np.random.default_rng(0)
  latents = jnp.asarray(rng.standard_normal(latent_shape, np.float32))
  timestep = jnp.full((args.batch,), 500.0, jnp.float32)
  text = jnp.asarray(rng.standard_normal((args.batch, args.text_len, config.text_dim), np.float32))
  step = jax.jit(forward, static_argnames=("plan",))
  runs = {}
  for mode in args.quantize or ["none"]:  # the same random weights, quantized or not
    start = time.perf_counter()
    model = quantize_transformer(init_transformer(config, seed=0, dtype=dtype), None if mode == "none" else mode)
    jax.block_until_ready(jax.tree.leaves(model))
    print(f"{mode}: random init: {count_params(model) / 1e9:.3f} B params in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    compiled = step.lower(model, latents, timestep, text, plan=plan).compile()
    print(f"{mode}: compile: {time.perf_counter() - start:.1f} s")
    out = compiled(model, latents, timestep, text)
    print(f"{mode}: output {out.shape} {out.dtype}, finite={bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))}")
    runs[mode] = (compiled, model, [])
  for _ in range(args.steps):  # interleaved, so a busy host slows every setting alike
    for compiled, model, times in runs.values():
      start = time.perf_counter()
      compiled(model, latents, timestep, text).block_until_ready()
      times.append(time.perf_counter() - start)
  first = next(iter(runs))
  for mode, (_, _, times) in runs.items():
    ratio = np.median(times) / np.median(runs[first][2])
    print(f"{mode}: step {np.mean(times):.3f} s mean over {args.steps} (min {np.min(times):.3f} s, median "
          f"{np.median(times):.3f} s; {ratio:.2f}x the median of {first})")

if __name__ == "__main__":
  main()
