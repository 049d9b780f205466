r"""MagCache calibration: the per-step magnitude ratios of a model, written as JSON.

  python -m end_to_end.train.calibrate_cache --out pipelines/wan/step_cache/mag_ratios_tiny.json   # the trained default
  python -m end_to_end.train.calibrate_cache --model ./Wan2.1-T2V-1.3B-Diffusers --dtype bfloat16 \
      --size 832x480 --frames 81 --steps 50 --mesh U=4,R=2 --out wan21_1.3b_mag.json

Runs the pipeline with every step computed (MagCache with threshold 0) and records, per step s,
gamma_s = mean over tokens of ||R_s|| / ||R_{s-1}||, R the whole-transformer residual (last block's
output minus the first block's input; gamma_0 = 1), as diffusers' `MagCacheConfig(calibrate=True)`
(hooks/mag_cache.py) and MagCache (arXiv:2506.09045) calibrate. Under classifier-free guidance
the cond and uncond rows are one batch (one decision covers both), so the mean runs over both.
With several prompts (--prompt repeated) the ratios are averaged over them. The file is what
`step_cache="mag:THRESH[:K]@FILE"` (and `generate --step-cache`) loads; ratios for another step
count are resampled by nearest index.

Defaults are the model's own settings (`pipelines.cli.generate`): for `tiny` (the trained embedded
default, `WanPipeline.tiny()`) and `tiny-random` the "tiny" preset, 64x64 x 17 frames, 8 steps, flow
shift 3, guidance 2; for a folder diffusers' `WanPipeline.__call__` defaults (832x480 x 81, 50
steps). Text length: `presets.default_text_length` (64 for `tiny`, 512 otherwise). Ratios belong to
the model and settings they were measured with: the file records the model's name and fingerprint
(`WanPipeline.fingerprint`), size, frames, steps and text length, which
`pipelines.wan.step_cache.check_calibration` compares with a run's.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from attention.mesh import MeshSpec, request_cpu_devices
from pipelines.commands.help import HelpFormatter
from pipelines.storage.video_io import write_json

DEFAULT_PROMPTS = ("a lighthouse on a cliff at dusk, waves crashing", "a bowl of ramen, steam rising, close-up")
# The trained tiny default draws end_to_end.train.synthetic_world's shapes; calibrate on prompts it knows
# (not the ones quality.step_cache was measured with: "a red square moving right", "a blue square
# moving left", "a red triangle moving down").
TINY_PROMPTS = ("a green circle moving down", "a yellow triangle standing still", "a white circle moving up")


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.train.calibrate_cache", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--model", default="tiny",
                  help="'tiny' (the trained embedded default, WanPipeline.tiny()), 'tiny-random' "
                       "(embedded random weights) or a diffusers Wan folder")
  ap.add_argument("--out", required=True, help="the JSON file to write")
  ap.add_argument("--prompt", action="append", help="calibration prompt (repeatable; default: "
                  f"{TINY_PROMPTS} for tiny, else {DEFAULT_PROMPTS})")
  ap.add_argument("--size", default=None, help="WIDTHxHEIGHT in pixels, multiples of 16 (default: the "
                  "model's, 64x64 for tiny)")
  ap.add_argument("--frames", type=int, default=None, help="video frames, 4k + 1 (default: the model's, 17 for tiny)")
  ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's, 8 for tiny)")
  ap.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the model's, 5.0)")
  ap.add_argument("--shift", type=float, default=None, help="flow shift (default: the model's scheduler)")
  ap.add_argument("--seed", type=int, default=100, help="noise seed of the first prompt (prompt i: seed + i)")
  ap.add_argument("--max-sequence-length", type=int, default=None,
                  help="text tokens L (default: the model's, 64 for tiny, 512 otherwise)")
  ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                  help="model dtype (default float32 for tiny, bfloat16 for a folder)")
  ap.add_argument("--mesh", default="U=1,R=1", help="sequence-parallel mesh, e.g. U=2,R=2")
  return ap


def calibrate(pipe: Any, prompts: list[str], *, width: int, height: int, frames: int, steps: int,
              guidance: float, shift: float | None, seed: int, max_sequence_length: int,
              mesh: Any = None) -> list[float]:
  """MagCache ratios of `pipe`: gamma_s per step, averaged over `prompts` (prompt i with seed + i).

  Returns:
    `steps` floats (gamma_0 = 1.0).
  """
  import numpy as np

  from pipelines.wan.step_cache import StepCacheSpec

  never = StepCacheSpec("mag", 0.0, max_skips=1, retention=1.0, ratios=(1.0,), ratios_source="calibration")
  runs = []
  for i, prompt in enumerate(prompts):
    result = pipe.run(prompt, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                      guidance_scale=guidance, flow_shift=shift, seed=seed + i,
                      max_sequence_length=max_sequence_length, mesh=mesh, step_cache=never,
                      progress=False, decode=False)
    record = result.settings["step_cache"]
    assert not record["skipped_steps"], record  # threshold 0 never skips
    runs.append(record["metrics"])
  return [float(x) for x in np.mean(np.asarray(runs, np.float64), axis=0)]


def model_settings(model: str) -> dict[str, Any]:
  """The settings `model` ("tiny", "tiny-random" or a folder) runs at by default, as `generate`
  picks them: {"width", "height", "frames", "steps", "guidance", "max_sequence_length"}. Loads no
  model (reads the tokenizer config of a folder at most)."""
  from pipelines.commands import presets

  preset = presets.PRESETS["tiny"] if model in presets.TINY_MODELS else presets.model_preset(model)
  return {"width": preset.width, "height": preset.height, "frames": preset.frames, "steps": preset.steps,
          "guidance": preset.guidance[0], "max_sequence_length": presets.default_text_length(model)}


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  mesh_spec = MeshSpec.parse(args.mesh)
  request_cpu_devices(mesh_spec.devices)  # before JAX's backend starts
  from pipelines.cli.flags import parse_size
  from pipelines.commands.presets import TINY_MODELS
  from pipelines.pipeline import WanPipeline
  from pipelines.wan.step_cache import record_fields

  own = model_settings(args.model)
  width, height = parse_size(args.size) if args.size else (own["width"], own["height"])
  frames = args.frames or own["frames"]
  steps = args.steps or own["steps"]
  guidance = own["guidance"] if args.guidance is None else args.guidance
  text_length = args.max_sequence_length or own["max_sequence_length"]
  tiny = args.model in TINY_MODELS
  dtype = args.dtype or ("float32" if tiny else "bfloat16")
  pipe = (WanPipeline.tiny(dtype, random=args.model == "tiny-random") if tiny
          else WanPipeline.from_pretrained(args.model, dtype=dtype))
  prompts = args.prompt or list(TINY_PROMPTS if args.model == "tiny" else DEFAULT_PROMPTS)
  mesh = None if mesh_spec.devices == 1 else str(mesh_spec)
  ratios = calibrate(pipe, prompts, width=width, height=height, frames=frames, steps=steps,
                     guidance=guidance, shift=args.shift, seed=args.seed,
                     max_sequence_length=text_length, mesh=mesh)
  # What check_calibration compares with a run's settings.
  record = {
      "method": "mag",
      **record_fields(
          model=args.model if tiny else os.path.basename(os.path.abspath(args.model)),
          fingerprint=pipe.fingerprint(), width=width, height=height, frames=frames, steps=steps,
          max_sequence_length=text_length),
      "ratios": ratios,
      "calibration": {"prompts": prompts, "size": f"{width}x{height}", "frames": frames,
                      "guidance": guidance, "shift": args.shift, "seed": args.seed,
                      "max_sequence_length": text_length, "dtype": dtype, "mesh": args.mesh},
      "command": "python -m end_to_end.train.calibrate_cache " + " ".join(argv if argv is not None else sys.argv[1:]),
  }
  write_json(record, args.out, overwrite=True)
  print(f"calibrate_cache: wrote {len(ratios)} ratios to {args.out} (min {min(ratios):.4f}, "
        f"max {max(ratios):.4f})", file=sys.stderr)
  return 0

if __name__ == "__main__":
  sys.exit(main())
