"""The VAE decode alone, timed on the device at hand: a preset's VAE (random weights) on random latents
of its video's shape, by one decode path, cold then warm, each run's seconds split into XLA's
compiles (JAX's backend-compile events: how many, how long) and the rest, with the device's peak,
and the rest's rate: the decode's matmul FLOPs (`vae.decode_flops`) per second, and in bf16 the
fraction of the chip's peak.

A pipeline run reaches its decode only after the text encoder, the transformer and every step; this
loads only the VAE (seconds), so a slow decode on a lent chip is measured and split in one short
command.

  python -m end_to_end.bench.decode --preset wan2.2-ti2v-5b --path streamed     # TI2V-5B's VAE, 704x1280 x 121
  python -m end_to_end.bench.decode --preset wan2.2-ti2v-5b --vae-dtype bfloat16
  python -m end_to_end.bench.decode --preset wan2.1-1.3b --path whole           # Wan 2.1 VAE, 480x832 x 81
  python -m end_to_end.bench.decode --preset tiny --frames 9 --runs 2           # CPU smoke run

Paths (`pipeline.run.decoding.decode_videos`): `whole` (`vae.decode`: one program per time chunk),
`streamed` (`vae.decode_streamed`: one program per decoder layer and frame, the memory plan's choice
where a chunk's program does not fit), `bands` (`vae.decode_banded`, `--band-rows` latent rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pipelines.storage.video_io import write_json

PATHS = ("whole", "streamed", "bands")
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


def build_parser() -> argparse.ArgumentParser:
  from end_to_end.bench.presets import PRESETS

  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="whose VAE and video size")
  ap.add_argument("--frames", type=int, help="video frames (4k + 1; default: the preset's)")
  ap.add_argument("--height", type=int, help="pixels (default: the preset's)")
  ap.add_argument("--width", type=int, help="pixels (default: the preset's)")
  ap.add_argument("--path", choices=PATHS, default="streamed")
  ap.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default="float32",
                  help="the VAE's weights and activations (float32: the pipelines' default, full fp32 products "
                       "under pipeline.run.precision's rule, several bf16 passes each on a TPU)")
  ap.add_argument("--precision", choices=("auto", "highest", "high", "default"), default="auto",
                  help="the decode's matmul precision: auto as the pipeline runs it (`precision.matmul_precision`: "
                       "highest for float32), or JAX's named one (on a TPU, high = 3 bf16 passes, highest = 6; "
                       "float32 480p x 81 on a v5e: 15.5 against 21.9 s, 2026-12-08)")
  ap.add_argument("--band-rows", type=int, default=16, help="latent rows per band (--path bands)")
  ap.add_argument("--runs", type=int, default=2, help="decodes in one process: the first compiles")
  ap.add_argument("--json", help="also write the result here")
  return ap


class CompileClock:
  """Counts XLA compiles and their seconds while entered (a JAX monitoring listener)."""

  def __init__(self) -> None:
    self.count, self.seconds = 0, 0.0

  def __call__(self, event: str, duration: float, **_: Any) -> None:
    if event == COMPILE_EVENT:
      self.count, self.seconds = self.count + 1, self.seconds + duration

  def __enter__(self) -> "CompileClock":
    import jax

    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *_: Any) -> None:
    import jax

    jax.monitoring.unregister_event_duration_listener(self)


def latent_shape(preset: Any, frames: int, height: int, width: int) -> tuple[int, int, int, int, int]:
  """[1, z_dim, F, Hl, Wl] of a `frames` x `height` x `width` video for the preset's VAE.

  Raises:
    ValueError: frames not 4k + 1, or a size not a multiple of the VAE's spatial factor."""
  config = preset.vae
  factor = config.spatial_factor
  if frames < 1 or (frames - 1) % 4:
    raise ValueError(f"--frames must be 4k + 1 (the VAE's time factor 4), got {frames}")
  if height % factor or width % factor:
    raise ValueError(f"--height/--width must be multiples of {factor} for this VAE, got {height}x{width}")
  return (1, config.z_dim, (frames - 1) // 4 + 1, height // factor, width // factor)


def decode_once(vae: Any, z: Any, path: str, band_rows: int) -> Any:
  """One decode of VAE-space latents z [B, C, F, Hl, Wl] by `path`, the video on the host."""
  import numpy as np

  from pipelines.wan import vae as wan_vae

  if path == "streamed":
    return wan_vae.decode_streamed(vae, z, video_layout="BFHWC")
  if path == "bands":
    return wan_vae.decode_banded(vae, z, band_rows=band_rows, video_layout="BFHWC")
  return np.asarray(wan_vae.decode(vae, z, video_layout="BFHWC"))  # the copy to the host waits for it


def run(args: argparse.Namespace) -> dict[str, Any]:
  """Builds the VAE and times `--runs` decodes: {"runs": [{seconds, compiles, compile_seconds,
  peak_device_gib}], ...} as printed."""
  import jax
  import jax.numpy as jnp

  from end_to_end.bench.presets import PRESETS
  from end_to_end.bench.timed_runs import decode_rate, peak_device_gib
  from pipelines.pipeline.run.precision import matmul_precision
  from pipelines.wan import vae as wan_vae

  preset = PRESETS[args.preset]
  frames, height, width = args.frames or preset.frames, args.height or preset.height, args.width or preset.width
  shape = latent_shape(preset, frames, height, width)
  start = time.perf_counter()
  vae = jax.block_until_ready(wan_vae.init_vae(preset.vae, jax.random.key(0), dtype=jnp.dtype(args.vae_dtype)))
  z = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(vae.dtype)
  print(f"{args.preset}'s VAE ({vae.dtype}), {frames}x{height}x{width} from latents {shape}, path {args.path}; "
        f"init {time.perf_counter() - start:.1f} s; {jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
  flops = wan_vae.decode_flops(preset.vae.decode_layers(), *shape[2:])
  print(f"decode matmuls: {flops / 1e12:.3g} TFLOP (`vae.decode_flops`)", flush=True)
  result = dict(preset=args.preset, path=args.path, vae_dtype=args.vae_dtype, precision=args.precision, frames=frames,
                height=height, width=width, latents=list(shape), device=jax.devices()[0].device_kind,
                jax=jax.__version__, flops=flops, runs=[])
  for i in range(args.runs):
    named = args.precision != "auto"
    precision = jax.default_matmul_precision(args.precision) if named else matmul_precision(vae.dtype)
    with CompileClock() as clock, precision:  # auto: as the pipeline's decode runs
      result["matmul_precision"] = jax.config.jax_default_matmul_precision  # in effect (None: the backend's)
      start = time.perf_counter()
      video = decode_once(vae, z, args.path, args.band_rows)
      seconds = time.perf_counter() - start
    rate = decode_rate(flops, max(seconds - clock.seconds, 0.0), args.vae_dtype)
    row = dict(seconds=seconds, compiles=clock.count, compile_seconds=clock.seconds, peak_device_gib=peak_device_gib(),
               frames_out=int(video.shape[1]), tflops_per_s=rate.get("decode_tflops_per_s"), mfu=rate.get("decode_mfu"))
    result["runs"].append(row)
    mfu = f", {row['mfu']:.0%} of the chip's bf16 peak" if row["mfu"] else ""
    print(f"run {i + 1}: {seconds:.2f} s, of which {clock.seconds:.2f} s in {clock.count} compiles; "
          f"{row['frames_out']} frames; {row['tflops_per_s'] or 0:.3g} TFLOP/s outside compiles{mfu}; "
          f"device peak {row['peak_device_gib']} GiB", flush=True)
  return result


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if args.runs < 1:
    print(f"error: --runs must be >= 1, got {args.runs}", file=sys.stderr)
    return 2
  try:
    result = run(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    write_json(result, args.json, overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
