"""Per-chunk time of a causal stream (`pipelines.wan.causal.CausalStream`), random weights: the
cache must make chunk k cost what chunk 3 costs once the window is full (chunks 1 and 2 compile and warm up).

  python -m end_to_end.bench.stream                                   # tiny, 10 chunks, window 6
  python -m end_to_end.bench.stream --model wan2.1-t2v-1.3b --dtype bfloat16 --size 480x832 --window 21

Prints each chunk's wall time (its 4 denoising forwards and the cache pass, `block_until_ready`),
its ratio to the median of chunks 3.. in the same run, its useful matmul FLOPs (keys: the
chunk's and the valid cached ones; `parallel.estimate.step_flops` per forward with the attention
term over those keys) and the fraction of the chip's peak, and the cache's bytes for this run and
for one minute of video at 16 fps. Numbers: docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pipelines.storage.video_io import write_json

TOKENS_PER_LATENT = 4  # (patch 2 x 2) tokens per latent pixel are 1 / 4
VIDEO_FPS = 16


def _forward_flops(config, tokens: int, keys: int, text_tokens: int) -> float:
  """Matmul FLOPs of one chunk forward: `step_flops` with the T x T attention term over `keys` keys."""
  from pipelines.parallel.estimate import step_flops

  square = 4.0 * tokens * tokens * config.dim * config.num_layers
  return step_flops(config, tokens, text_tokens, 1) - square + 4.0 * tokens * keys * config.dim * config.num_layers


def run(args: argparse.Namespace) -> dict:
  import jax
  import jax.numpy as jnp

  from pipelines.parallel.planner import chip_of
  from pipelines.wan.causal import CacheWindow, CausalStream, cache_bytes
  from pipelines.wan.pretrained import TINY_TRANSFORMER
  from pipelines.wan.transformer import PRESETS, init_transformer

  config = TINY_TRANSFORMER if args.model == "tiny" else PRESETS[args.model]
  if args.layers is not None:
    config = dataclasses.replace(config, num_layers=args.layers)
  model = init_transformer(config, seed=0, dtype=jnp.dtype(args.dtype), on_device=args.model != "tiny")
  height, width = (int(n) // 8 for n in args.size.split("x"))
  window = CacheWindow(args.chunk, args.window, args.sink)
  per_frame = height * width // TOKENS_PER_LATENT
  text = jax.random.normal(jax.random.key(1), (1, args.text_tokens, config.text_dim), jnp.dtype(args.dtype))
  stream = CausalStream(model, window)
  chip = chip_of(jax.devices()[0].device_kind)
  rows, start = [], time.perf_counter()
  for index, latents in enumerate(stream.latents(text, num_chunks=args.chunks, latent_size=(height, width),
                                                 key=jax.random.key(0))):
    latents.block_until_ready()
    seconds, start = time.perf_counter() - start, time.perf_counter()
    past = min(index * args.chunk, window.capacity(args.chunks * args.chunk))
    tokens = args.chunk * per_frame
    flops = 5 * _forward_flops(config, tokens, tokens + past * per_frame, args.text_tokens)
    rows.append({"chunk": index + 1, "seconds": seconds, "past_frames": past, "tflops": flops / 1e12,
                 "mfu": flops / seconds / chip.peak_flops if chip else None})
  warm = [r["seconds"] for r in rows[2:]] or [rows[-1]["seconds"]]
  base = sorted(warm)[len(warm) // 2]
  for row in rows:
    row["vs_median"] = row["seconds"] / base
  full = [r["seconds"] for r in rows[2:] if r["past_frames"] == window.capacity(args.chunks * args.chunk)]
  minute = VIDEO_FPS * 60 // 4 + 1  # latent frames of one minute
  capacity = window.capacity(minute)
  return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": args.model, "layers": config.num_layers,
          "dtype": args.dtype,
          "size": args.size, "window": [args.chunk, args.window, args.sink], "chunks": rows,
          "flat_spread": (max(full) / min(full) - 1) if len(full) > 1 else None,
          "cache_bytes_run": cache_bytes(model, batch=1, capacity_frames=window.capacity(args.chunks * args.chunk),
                                         tokens_per_frame=per_frame),
          "cache_bytes_one_minute": cache_bytes(model, batch=1, capacity_frames=capacity, tokens_per_frame=per_frame)}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="tiny", help="tiny, or a transformer preset (wan2.1-t2v-1.3b, ...)")
  p.add_argument("--layers", type=int, default=None, help="the model's blocks cut to this many (CPU runs)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--size", default="64x64", help="video HxW in pixels (multiples of 16)")
  p.add_argument("--chunks", type=int, default=10)
  p.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
  p.add_argument("--window", type=int, default=6, help="latent frames a chunk attends to (None: all)")
  p.add_argument("--sink", type=int, default=0)
  p.add_argument("--text-tokens", type=int, default=512)
  p.add_argument("--json", default=None, help="also write the result here")
  args = p.parse_args(argv)
  result = run(args)
  for row in result["chunks"]:
    mfu = "" if row["mfu"] is None else f", {100 * row['mfu']:.1f} % of peak"
    print(f"chunk {row['chunk']:3d}: {row['seconds'] * 1e3:9.1f} ms ({row['vs_median']:.3f} x the median), "
          f"{row['past_frames']} past frames, {row['tflops']:.4f} TFLOP{mfu}")
  spread = result["flat_spread"]
  print(f"{result['device']}, JAX {result['jax']}: from chunk 3 on with the window full, the slowest chunk is "
        f"{'n/a' if spread is None else f'{100 * spread:.1f} %'} above the fastest; cache "
        f"{result['cache_bytes_run'] / 2**20:.1f} MiB (one minute at {VIDEO_FPS} fps: "
        f"{result['cache_bytes_one_minute'] / 2**30:.2f} GiB)")
  if args.json:
    write_json(result, args.json, overwrite=True)


if __name__ == "__main__":
  main()
