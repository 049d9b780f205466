r"""Step caching: skipped steps vs video quality (and denoise time) against the uncached run.

  python -m end_to_end.quality.step_cache                        # trained tiny default, its settings
  python -m end_to_end.quality.step_cache --spec first-block:0.1 --spec mag:0.05 --json report.json
  python -m end_to_end.quality.step_cache --preset 1.3b-width --steps 20 --spec first-block:0.1 \
      --spec mag:0.05 --calibrate                              # wall time on the 1.3B-width preset

Runs the pipeline once uncached (the reference) and once per `--spec` (pipelines/wan/step_cache/forward.py
grammar), all with the same prompt, seed and settings, and prints per setting: the skipped steps
(fraction of transformer evaluations whose blocks 1..Z-1 (first-block) or all blocks (MagCache)
were skipped; the fraction of block evaluations skipped), PSNR and SSIM of the video against the
uncached one (`end_to_end.quality.video_metrics`: mean and min over frames), and the denoise wall time with
its speedup over the uncached run (compile excluded: `run` compiles before its loop). On a shared
machine whose load drifts between runs, the in-run estimate is steadier: it compares the median
times of the full and the skipped steps of the same run (`in_run_speedup`). The JSON also holds
each setting's per-step change measures (`metrics`), to pick thresholds for another model.

`--model tiny` (default) is the trained embedded default `WanPipeline.tiny()` at its own settings
(generate's "tiny" preset: 64x64 x 17 frames, 8 steps, 64 text tokens; `train.calibrate_cache.
model_settings`), `tiny-random` the random-weight model (same size and steps, 512 tokens); MagCache
uses the shipped ratios, calibrated for the trained default at those settings on other prompts
(`pipelines/wan/step_cache/calibration.py`). A folder runs at 256x256 x 17, 50 steps, 512 tokens unless
told otherwise.
`--preset NAME` builds an `end_to_end.bench.presets` pipeline (random weights) instead; with
`--calibrate` its MagCache ratios are measured first (one uncached run, `train.calibrate_cache.calibrate`,
on another seed) and used by every "mag" spec without a file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

from attention.mesh import MeshSpec, request_cpu_devices
from pipelines.commands.help import HelpFormatter
from pipelines.storage.video_io import write_json

DEFAULT_SPECS = ("first-block:0.09", "first-block:0.12", "first-block:0.2", "mag:0.005", "mag:0.01",
                 "mag:0.05")


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.quality.step_cache", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--model", default="tiny", help="'tiny' (the trained default), 'tiny-random' or a "
                  "diffusers Wan folder (ignored with --preset)")
  ap.add_argument("--preset", default=None, help="an end_to_end.bench.presets name, e.g. 1.3b-width")
  ap.add_argument("--spec", action="append", help=f"step-cache setting (repeatable; default {DEFAULT_SPECS})")
  ap.add_argument("--prompt", default="a red fox running through snow", help="the prompt of every run")
  ap.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the tiny models' 64x64, the "
                  "preset's, or 256x256)")
  ap.add_argument("--frames", type=int, default=None, help="video frames (default 17, or the preset's)")
  ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: 8 for the tiny models, else 50)")
  ap.add_argument("--guidance", type=float, default=5.0, help="CFG scale")
  ap.add_argument("--seed", type=int, default=0, help="noise seed of every run")
  ap.add_argument("--max-sequence-length", type=int, default=None,
                  help="text tokens L (default: the model's, 64 for tiny, else 512)")
  ap.add_argument("--mesh", default="U=1,R=1", help="sequence-parallel mesh, e.g. U=2,R=2")
  ap.add_argument("--no-decode", action="store_true",
                  help="skip the VAE (timing only: no PSNR/SSIM; the latents' max difference is reported)")
  ap.add_argument("--calibrate", action="store_true",
                  help="measure MagCache ratios for this model first (needed for a --preset or folder)")
  ap.add_argument("--json", help="write the report here")
  return ap


def _timed_run(pipe, spec, kwargs) -> tuple[Any, list[float]]:
  """One run and its per-step seconds; "denoise" excludes the compile (`run` compiles first)."""
  seconds: list[float] = []
  result = pipe.run(**kwargs, step_cache=spec, on_step=lambda k, s: seconds.append(s))
  return result, seconds


def in_run_speedup(seconds: list[float], skipped: list[int]) -> float | None:
  """Speedup estimated inside one cached run, robust to a machine whose load drifts between runs:
  S * median(full step) / (n_full * median(full step) + n_skipped * median(skipped step)).
  None when no step (or every step) was skipped."""
  import numpy as np

  skip = set(skipped)
  full = [t for k, t in enumerate(seconds) if k not in skip]
  cached = [t for k, t in enumerate(seconds) if k in skip]
  if not full or not cached:
    return None
  t_full, t_skip = float(np.median(full)), float(np.median(cached))
  return len(seconds) * t_full / (len(full) * t_full + len(cached) * t_skip)


def _model(args: argparse.Namespace) -> tuple[Any, str, tuple[int, int, int], int, int]:
  """(the pipeline, its name, (width, height, frames), steps, text length): the bench preset's random
  weights, the tiny model at its own calibration settings, or a folder at 256x256 x 17; a preset's
  or a folder's steps and text length are 50 and 512."""
  from end_to_end.bench import presets as bench_presets
  from end_to_end.train import calibrate_cache
  from pipelines.commands.presets import TINY_MODELS
  from pipelines.pipeline import WanPipeline

  if args.preset is not None:
    preset = bench_presets.PRESETS[args.preset]
    video = (preset.width, preset.height, preset.frames)
    return bench_presets.init_ours(preset), f"preset {args.preset}", video, 50, 512
  if args.model in TINY_MODELS:
    own = calibrate_cache.model_settings(args.model)
    return (WanPipeline.tiny(random=args.model == "tiny-random"), args.model,
            (own["width"], own["height"], own["frames"]), own["steps"], own["max_sequence_length"])
  pipe = WanPipeline.from_pretrained(args.model, dtype="bfloat16")
  return pipe, pipe.name, (256, 256, 17), 50, 512


def _calibrated(specs: list[str], pipe: Any, args: argparse.Namespace, width: int, height: int, frames: int,
                mesh: str | None) -> list[str]:
  """`specs` with every MagCache spec that names no ratios file reading this model's ratios,
  measured now on the prompt (another seed) and written to a temporary file."""
  from end_to_end.train import calibrate_cache

  ratios = calibrate_cache.calibrate(pipe, [args.prompt], width=width, height=height, frames=frames,
                                     steps=args.steps, guidance=args.guidance, shift=None,
                                     seed=args.seed + 1000, max_sequence_length=args.max_sequence_length,
                                     mesh=mesh)
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump({"ratios": ratios}, f)
  return [s + f"@{f.name}" if s.startswith("mag:") and "@" not in s else s for s in specs]


def _spec_row(pipe: Any, spec: str, kwargs: dict[str, Any], reference: Any, steps: int) -> dict[str, Any]:
  """One step cache's run against the uncached `reference`: what it skipped, its speedup and the
  video's distance (PSNR / SSIM, or the latents' without a decode); printed."""
  import numpy as np

  from end_to_end.quality import video_metrics

  result, seconds = _timed_run(pipe, spec, kwargs)
  record, ref_time = result.settings["step_cache"], reference.timings["denoise"]
  row = {"spec": spec.split("@")[0], "skipped_steps": record["skipped_steps"],
         "skipped_fraction": record["skipped_fraction"],
         "skipped_block_fraction": record["skipped_block_fraction"],
         "denoise_s": result.timings["denoise"], "speedup": ref_time / result.timings["denoise"],
         "in_run_speedup": in_run_speedup(seconds, record["skipped_steps"]), "metrics": record["metrics"],
         "max_abs_latent_diff": float(np.max(np.abs(result.latents - reference.latents)))}
  if result.frames is not None:
    metrics = video_metrics.compare_videos(reference.frames, result.frames)
    row.update({k: metrics[k] for k in ("psnr_mean", "psnr_min", "ssim_mean", "ssim_min")})
  quality = (f"PSNR mean {row['psnr_mean']:.1f} / min {row['psnr_min']:.1f} dB, SSIM mean "
             f"{row['ssim_mean']:.4f} / min {row['ssim_min']:.4f}" if "psnr_mean" in row
             else f"max |latent diff| {row['max_abs_latent_diff']:.3g}")
  print(f"  {row['spec']:<20} skipped {len(row['skipped_steps']):>3}/{steps} steps "
        f"({100 * row['skipped_fraction']:.0f} %; blocks {100 * row['skipped_block_fraction']:.0f} %), "
        f"{quality}, denoise {row['denoise_s']:.2f} s ({row['speedup']:.2f}x; in-run estimate "
        f"{'-' if row['in_run_speedup'] is None else format(row['in_run_speedup'], '.2f') + 'x'})")
  return row


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  mesh_spec = MeshSpec.parse(args.mesh)
  request_cpu_devices(mesh_spec.devices)  # before JAX's backend starts
  from pipelines.cli.flags import parse_size

  pipe, name, (width, height, frames), steps, text_length = _model(args)
  if args.size:
    width, height = parse_size(args.size)
  frames = args.frames or frames
  args.steps = args.steps or steps
  args.max_sequence_length = args.max_sequence_length or text_length
  mesh = None if mesh_spec.devices == 1 else str(mesh_spec)
  kwargs = dict(prompt=args.prompt, height=height, width=width, num_frames=frames,
                num_inference_steps=args.steps, guidance_scale=args.guidance, seed=args.seed,
                max_sequence_length=args.max_sequence_length, mesh=mesh, progress=False,
                decode=not args.no_decode)
  specs = args.spec or list(DEFAULT_SPECS)
  if args.calibrate:
    specs = _calibrated(specs, pipe, args, width, height, frames, mesh)
  reference, _ = _timed_run(pipe, None, kwargs)
  ref_time = reference.timings["denoise"]
  print(f"step_cache_report: {name}, {frames} x {height} x {width}, {args.steps} steps, guidance "
        f"{args.guidance}, mesh {args.mesh}; uncached denoise {ref_time:.2f} s", file=sys.stderr)
  rows = [_spec_row(pipe, spec, kwargs, reference, args.steps) for spec in specs]
  if args.json:
    write_json({"model": name, "size": f"{width}x{height}", "frames": frames, "steps": args.steps,
                "guidance": args.guidance, "seed": args.seed, "mesh": args.mesh,
                "uncached_denoise_s": ref_time, "rows": rows}, args.json, overwrite=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
