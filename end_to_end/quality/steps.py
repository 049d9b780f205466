r"""Few steps vs quality: each sampler at N steps against the model's own sampler at many steps.

  python -m end_to_end.quality.steps                               # trained tiny default, its settings
  python -m end_to_end.quality.steps --steps 4,8,16,32 --reference-steps 50 --json r.json --plot r.png

Runs the pipeline with the reference setting (the model folder's scheduler, `--reference-steps`)
and with every `--scheduler` (unipc, dpm++, euler) at every `--steps` count, plus flow-match Euler on
lightx2v's 4-step list (timesteps 1000,750,500,250: what a step-distilled model is run with; on a
model that is not distilled it shows what that schedule costs), all with the same prompts, seed and
settings, and prints per setting the PSNR and SSIM of the video against the reference
(`end_to_end.quality.video_metrics`: per-frame values, averaged over frames, then over the prompts; the
worst frame of any prompt too). `--model tiny` (default) is the trained embedded default
`WanPipeline.tiny()` at its own settings (64x64 x 17 frames, the `tiny` preset's guidance, 64 text tokens) on three
prompts of its shapes world.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipelines.commands.help import HelpFormatter
from pipelines.storage.video_io import write_json

LIGHTX2V_STEPS = (1000.0, 750.0, 500.0, 250.0)


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.quality.steps", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--model", default="tiny", help="'tiny' (the trained default), 'tiny-random' or a diffusers Wan folder")
  ap.add_argument("--steps", default="4,8,16,32", help="step counts of the candidates")
  ap.add_argument("--reference-steps", type=int, default=50, help="steps of the reference video")
  ap.add_argument("--scheduler", action="append", choices=("unipc", "dpm++", "euler"),
                  help="samplers of the candidates (repeatable; default all three)")
  ap.add_argument("--prompt", action="append", help="prompts (repeatable; default: three of the tiny world)")
  ap.add_argument("--size", default=None, help="WIDTHxHEIGHT (default: the model's, 64x64 for tiny)")
  ap.add_argument("--frames", type=int, default=None, help="video frames (default: the model's, 17 for tiny)")
  ap.add_argument("--seed", type=int, default=0, help="noise seed of every run")
  ap.add_argument("--json", help="write the report here")
  ap.add_argument("--plot", help="write a PNG of PSNR and SSIM against steps here")
  return ap


def _mean_metrics(reference: list[Any], videos: list[Any]) -> dict[str, float]:
  """PSNR / SSIM of each prompt's video against its reference: the means over prompts of the
  per-video frame means, and the worst frame of any prompt."""
  import numpy as np

  from end_to_end.quality import video_metrics

  rows = [video_metrics.compare_videos(r, v) for r, v in zip(reference, videos)]
  return {"psnr_mean": float(np.mean([r["psnr_mean"] for r in rows])),
          "psnr_min": float(min(r["psnr_min"] for r in rows)),
          "ssim_mean": float(np.mean([r["ssim_mean"] for r in rows])),
          "ssim_min": float(min(r["ssim_min"] for r in rows))}


def write_plot(path: str, rows: list[dict[str, Any]], reference: str) -> None:
  """PSNR and SSIM against steps, one line per sampler (the lightx2v list as a lone marker)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from pipelines.storage import video_io

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
  for ax, key, label in ((axes[0], "psnr_mean", "PSNR (dB)"), (axes[1], "ssim_mean", "SSIM")):
    for name in dict.fromkeys(r["scheduler"] for r in rows):
      points = [(r["steps"], r[key]) for r in rows if r["scheduler"] == name and r["timesteps"] is None]
      if points:
        ax.plot(*zip(*points), marker="o", label=name)
    for r in rows:
      if r["timesteps"] is not None:
        ax.plot([r["steps"]], [r[key]], marker="*", ms=12, ls="", label=f"{r['scheduler']} 1000,750,500,250")
    ax.set(xscale="log", xlabel="steps", ylabel=label, title=f"{label} vs {reference}")
    ax.minorticks_off()
    ax.set_xticks(sorted({r["steps"] for r in rows}), [str(s) for s in sorted({r["steps"] for r in rows})])
    ax.legend(fontsize=8)
  with video_io.atomic_file(path, ".png", True) as temp:
    fig.savefig(temp, format="png", dpi=100)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  from end_to_end.train import calibrate_cache
  from pipelines.cli.flags import parse_size
  from pipelines.commands.presets import TINY_MODELS
  from pipelines.pipeline import WanPipeline
  from pipelines.wan import schedulers

  own = calibrate_cache.model_settings(args.model)
  tiny = args.model in TINY_MODELS
  pipe = (WanPipeline.tiny(random=args.model == "tiny-random") if tiny
          else WanPipeline.from_pretrained(args.model, dtype="bfloat16"))
  pipe.set_progress_bar_config(disable=True)
  width, height = parse_size(args.size) if args.size else (own["width"], own["height"])
  prompts = args.prompt or list(calibrate_cache.TINY_PROMPTS)
  call = dict(height=height, width=width, num_frames=args.frames or own["frames"], guidance_scale=own["guidance"],
              seed=args.seed, max_sequence_length=own["max_sequence_length"])
  ref_name = f"{schedulers.solver_name(pipe.scheduler_config)} x {args.reference_steps}"
  reference = [pipe(p, num_inference_steps=args.reference_steps, **call)[0] for p in prompts]
  settings = [(name, int(n), None) for name in (args.scheduler or ["unipc", "dpm++", "euler"])
              for n in args.steps.split(",")] + [("euler", len(LIGHTX2V_STEPS), LIGHTX2V_STEPS)]
  print(f"steps_report: {pipe.name}, {call['num_frames']} x {height} x {width}, guidance {call['guidance_scale']}, "
        f"flow shift {schedulers.flow_shift(pipe.scheduler_config):g}, {len(prompts)} prompts, reference {ref_name}",
        file=sys.stderr)
  rows = []
  for name, n, timesteps in settings:
    extra = {"timesteps": list(timesteps)} if timesteps else {"num_inference_steps": n}
    videos = [pipe(p, scheduler=name, **extra, **call)[0] for p in prompts]
    row = {"scheduler": name, "steps": n, "timesteps": timesteps, **_mean_metrics(reference, videos)}
    rows.append(row)
    print(f"  {name:<6} {n:>3} steps{' (1000,750,500,250)' if timesteps else '':<20} PSNR mean "
          f"{row['psnr_mean']:5.1f} / min {row['psnr_min']:5.1f} dB, SSIM mean {row['ssim_mean']:.4f} / min "
          f"{row['ssim_min']:.4f}", flush=True)
  if args.json:
    write_json({"model": pipe.name, "settings": call, "prompts": prompts, "reference": ref_name, "rows": rows},
               args.json, overwrite=True)
  if args.plot:
    write_plot(args.plot, rows, ref_name)
  return 0


if __name__ == "__main__":
  sys.exit(main())
