"""What saving the denoising state after every step costs: step time with and without checkpoints.

  python -m end_to_end.bench.checkpoint --preset 1.3b-width --steps 6 --rounds 3

One pipeline (a benchmark preset's architecture, random weights), one compile, then `--rounds`
pairs of runs in alternating order (without, with `checkpoint_every=1`; the VAE is skipped), so
that drift of a noisy machine falls on both sides. Prints the mean denoising step time of each side,
their ratio, and the checkpoint's size. The state is written to a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
  from end_to_end.bench.presets import PRESETS

  ap = argparse.ArgumentParser(prog="bench_checkpoint", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", choices=list(PRESETS), default="1.3b-width")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (without, with)")
  ap.add_argument("--every", type=int, default=1, help="checkpoint_every of the runs with checkpoints")
  args = ap.parse_args(argv)
  if args.steps < 1 or args.rounds < 1 or args.every < 1:
    ap.error("--steps, --rounds and --every must be >= 1")

  import numpy as np

  from end_to_end.bench import presets as bench_presets
  from pipelines.pipeline.run import resume

  preset = bench_presets.PRESETS[args.preset]
  pipe = bench_presets.init_ours(preset, seed=0)
  folder = tempfile.mkdtemp(prefix="wan_ckpt_bench_")
  call = dict(height=preset.height, width=preset.width, num_frames=preset.frames,
              num_inference_steps=args.steps, guidance_scale=preset.guidance, seed=0,
              max_sequence_length=preset.max_sequence_length, progress=False, decode=False)
  times: dict[str, list[float]] = {"without": [], "with": []}
  size = 0
  try:
    pipe.run("a red fox running through snow", **call)  # compile
    for r in range(args.rounds):
      for side in (("without", "with") if r % 2 == 0 else ("with", "without")):
        extra = {} if side == "without" else dict(checkpoint_dir=os.path.join(folder, "c"),
                                                  checkpoint_every=args.every, keep_checkpoint=True)
        result = pipe.run("a red fox running through snow", **call, **extra)
        times[side].append(result.timings["denoise_per_step"])
        if side == "with":
          size = os.path.getsize(resume.state_path(os.path.join(folder, "c")))
          resume.remove(os.path.join(folder, "c"))
        print(f"round {r + 1} {side:>7} checkpoints: {result.timings['denoise_per_step'] * 1e3:.1f} ms/step",
              flush=True)
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  without, with_ = float(np.mean(times["without"])), float(np.mean(times["with"]))
  print(f"preset {args.preset}: {preset.tokens} tokens, {args.steps} steps; checkpoint {size / 2**20:.1f} MiB "
        f"every {args.every} step(s)")
  print(f"mean step: without {without * 1e3:.1f} ms, with {with_ * 1e3:.1f} ms; ratio with/without "
        f"{with_ / without:.3f} ({(with_ / without - 1) * 100:+.1f} %)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
