r"""Quality check: does a faster setting (bf16, a mesh, the fixed-m path) give the same video?

  python -m end_to_end.quality.check                                   # tiny model, bf16 on U=2,R=2
  python -m end_to_end.quality.check --model tiny-random               # the random-weight tiny model
  python -m end_to_end.quality.check --dtype float32 --mesh U=2,R=2 --min-psnr 60
  python -m end_to_end.quality.check --matrix --json quality.json      # {fp32, bf16} x 5 meshes x 2 paths
  python -m end_to_end.quality.check --plots quality_plots              # + contact sheets and per-frame plot
  python -m end_to_end.quality.check --dtype bfloat16 --dtype float32 --quantize none --quantize int8 \
      --quantize fp8 --quantize int8-w8a8 --mesh U=1,R=1                 # quantized weights
  python -m end_to_end.quality.check --model ./Wan2.1-T2V-1.3B-Diffusers --height 480 --width 832 \
      --frames 81 --steps 50 --dtype bfloat16 --mesh U=4,R=2

Runs `WanPipeline` once as the REFERENCE (float32, one device, attention forced onto the LSE
path: online softmax, the textbook algorithm) and once per CANDIDATE (a dtype, a (ring, ulysses)
mesh, an attention path: "auto" = the pipeline's default, fixed-m whenever the mesh-uniform gate
admits it; "lse" = forced LSE), all with the same prompt, negative prompt, settings and the same
explicit initial latents (drawn once from --seed; `--candidate-seed` draws the candidate's from
another seed: a positive control that must fail). For each candidate it prints PSNR (dB, data
range 1) and SSIM (scikit-image, data_range=1.0, channel_axis=-1) per frame, their mean and their
minimum over frames, and the max abs difference of the final latents (before the VAE).

A candidate passes when, for its dtype, PSNR >= --min-psnr and SSIM >= --min-ssim, both taken
over frames as --gate says (mean, the default, or min), and max |latent diff| <= --max-latent-diff
when that is given. Exit status: 0 when every candidate passes, 1 when any fails, 2 on a usage
error. A mesh larger than the visible device count is simulated on CPU (fake devices, set before
JAX starts); on an accelerator the default mesh (U=2,R=2) falls back to a ring over the visible
devices (U=1,R=1 on one chip), with a note, and a larger --mesh is refused naming one that fits.

Models (`--model`): 'tiny', the embedded trained tiny default (`WanPipeline.tiny()`, the shapes
world of end_to_end/train/synthetic_world.py; run at its own settings unless given: "a red square moving
right", 64x64, 17 frames, 8 steps, its 64 text tokens); 'tiny-random', the random-weight tiny model
(`WanPipeline.tiny(random=True)`); or a diffusers-format folder. For the last two the defaults are
48x64, 9 frames, 4 steps, "a red fox running through snow", 512 text tokens.

Thresholds belong to the content (`--content`, default from --model):
  noise    the random-weight tiny model (`--model tiny-random`): its video is low-contrast noise
           (pixel std ~0.10), on which bf16 rounding costs SSIM: float32 60 dB / 0.99,
           bfloat16 45 dB / 0.95 (measured: see THRESHOLDS).
  trained  a trained checkpoint (`--model tiny`, `--model FOLDER`): structured video: float32
           60 dB / 0.99, bfloat16 35 dB / 0.98.
--min-psnr / --min-ssim replace them.

Plots (`--plots DIR`, created if needed): per candidate a contact sheet `NN_<dtype>_<mesh>_<attention>.png`
(frame grid: the reference row over the candidate row, `pipelines.storage.contact_sheet.contact_sheet`) and
`per_frame.png` (matplotlib): PSNR and SSIM per frame of every candidate, with each dtype's
threshold dashed. Existing files of those names are refused before any compute.

Quantization (`--quantize`, repeatable: none, int8, fp8, int8-w8a8): each candidate's transformer
block weights quantized (`WanPipeline.quantize`); a quantized candidate is judged by bfloat16's
thresholds (its error is of bf16's order), whatever its activation dtype. `--attention-exchange fp8`
(repeatable with bf16) sends Q, V and the attention output across the Ulysses all-to-alls in e4m3
(`attention_exchange`; no effect on a mesh without Ulysses); judged by bfloat16's thresholds too.

Matrix (`--matrix`): dtypes {float32, bfloat16} x meshes {U=1,R=1; U=2,R=2; U=4,R=1; U=1,R=4;
U=4,R=2} x attention {auto, lse}: 20 candidates, one reference.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any

# JAX's backend has not started yet, so fake devices can still be requested here.
from attention.mesh import DEVICE_FLAG, MeshSpec, request_cpu_devices
from pipelines.commands.help import HelpFormatter, warnings_as_lines
from pipelines.commands.presets import TINY_MODELS, default_text_length
from pipelines.storage.video_io import write_json

DTYPES = ("float32", "bfloat16")
MATRIX_MESHES = ("U=1,R=1", "U=2,R=2", "U=4,R=1", "U=1,R=4", "U=4,R=2")
MATRIX_ATTENTION = ("auto", "lse")
REFERENCE_ATTENTION = "lse"

# Pass thresholds (mean over frames) by the content of the video: how far a correct bf16 video may
# drift from the fp32 one depends on what the video shows.
THRESHOLDS = {
    # The embedded random-weight tiny model: low-contrast noise (pixel std ~0.10), where bf16
    # rounding shows up strongly in SSIM. Measured at this tool's defaults (48x64, 9 frames, 4
    # steps, guidance 5, L=512, U=2,R=2, auto) over seeds 0-5: bf16 vs the fp32 reference mean PSNR
    # 55.5-70.7 dB, mean SSIM 0.986-0.998 (51.9 dB and 0.977 at worst with the attention code
    # before its rework: one block layout, q scaled once); fp32 ~148 dB, SSIM 1.0000; a different
    # seed's latents (the positive control, fp32 or bf16) 36.8-38.2 dB, SSIM 0.867-0.900. The bf16
    # bars sit between the two: 45 dB (10 dB below the worst correct run, 7 dB above the best
    # control) and 0.95 (1 - SSIM 3.6x the worst correct run's, half the best control's).
    "noise": dict(psnr={"float32": 60.0, "bfloat16": 45.0}, ssim={"float32": 0.99, "bfloat16": 0.95}),
    # A trained checkpoint: structured video, where both metrics discriminate and bf16 keeps the
    # structure. The bars of a visibly identical video, 60 dB ~ RMS error 1/1000 of the range,
    # 35 dB ~ 1/56. Measured on the trained tiny default at this tool's defaults for it (64x64, 17
    # frames, 8 steps, U=2,R=2): fp32 134.9 dB / SSIM 1.0000 (auto and fixed_m), bf16 50.3 dB mean,
    # 47.6 dB worst frame, SSIM 0.9993.
    "trained": dict(psnr={"float32": 60.0, "bfloat16": 35.0}, ssim={"float32": 0.99, "bfloat16": 0.98}),
}
CONTENT = {"noise": "noise-like video of the random-weight tiny model",
           "trained": "structured video of a trained checkpoint"}


class UsageError(ValueError):
  """A bad command line (exit status 2)."""


def parse_thresholds(text: str | None, flag: str) -> dict[str, float]:
  """'35' (every dtype) or 'float32=60,bfloat16=35' -> {dtype: value}; None -> {}.

  Raises:
    UsageError: malformed text or an unknown dtype.
  """
  if text is None:
    return {}
  text = text.replace(" ", "")
  try:
    if "=" not in text:
      return {dtype: float(text) for dtype in DTYPES}
    out = {}
    for part in text.split(","):
      dtype, value = part.split("=")
      if dtype not in DTYPES:
        raise UsageError(f"{flag} {text!r}: unknown dtype {dtype!r}; use {' / '.join(DTYPES)}")
      out[dtype] = float(value)
    return out
  except ValueError as e:
    if isinstance(e, UsageError):
      raise
    raise UsageError(f"{flag} {text!r} is malformed; write e.g. '35' or 'float32=60,bfloat16=35'") from e


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.quality.check", description=__doc__,
                               formatter_class=HelpFormatter)
  ap.add_argument("--model", default="tiny",
                  help="'tiny' (the embedded trained model), 'tiny-random' (embedded random weights) or a "
                       "diffusers Wan folder")
  ap.add_argument("--prompt", default=None,
                  help="the prompt of every run (default: 'a red square moving right' for tiny, 'a red fox "
                       "running through snow' otherwise)")
  ap.add_argument("--negative-prompt", default=None, help="'' when not given (as diffusers)")
  ap.add_argument("--height", type=int, default=None, help="pixels, a multiple of 16 (default: 64 for tiny, 48 otherwise)")
  ap.add_argument("--width", type=int, default=None, help="pixels, a multiple of 16 (default: 64)")
  ap.add_argument("--frames", type=int, default=None,
                  help="4k + 1; other counts become frames // 4 * 4 + 1 as in diffusers (16 -> 17, 10 -> 9) "
                       "(default: 17 for tiny, 9 otherwise)")
  ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: 8 for tiny, 4 otherwise)")
  ap.add_argument("--guidance", type=float, default=5.0, help="CFG scale")
  ap.add_argument("--max-sequence-length", type=int, default=None,
                  help="text tokens L (default: the folder's tokenizer's length: 64 for tiny, 512 for Wan)")
  ap.add_argument("--seed", type=int, default=0, help="seed of the initial latents (reference and candidates)")
  ap.add_argument("--candidate-seed", type=int, default=None,
                  help="draw the candidates' initial latents from this seed instead (positive control: must fail)")
  ap.add_argument("--dtype", action="append", choices=DTYPES, help="candidate dtype (repeatable; bfloat16 if none)")
  ap.add_argument("--mesh", action="append", help="candidate mesh such as U=2,R=2 (repeatable; U=2,R=2 if none)")
  ap.add_argument("--quantize", action="append", choices=("none", "int8", "fp8", "int8-w8a8"),
                  help="candidate weight quantization (repeatable; none if not given)")
  ap.add_argument("--attention-exchange", action="append", choices=("bf16", "fp8"),
                  help="candidate Ulysses exchange dtype of Q, V and the output (repeatable; bf16 if none)")
  ap.add_argument("--attention", action="append", choices=("auto", "lse", "fixed_m"),
                  help="candidate attention path (repeatable; auto if none)")
  ap.add_argument("--matrix", action="store_true",
                  help=f"candidates = {{float32, bfloat16}} x {{{'; '.join(MATRIX_MESHES)}}} x {{auto, lse}}")
  ap.add_argument("--content", choices=tuple(THRESHOLDS), default=None,
                  help="what the video shows, which picks the thresholds: 'noise' (random weights) or "
                       "'trained' (a trained checkpoint); when not given, noise for --model tiny-random, "
                       "trained otherwise")
  ap.add_argument("--min-psnr", default=None,
                  help="dB: '35' (every dtype) or 'float32=60,bfloat16=35'; replaces --content's")
  ap.add_argument("--min-ssim", default=None,
                  help="'0.98' (every dtype) or 'float32=0.99,bfloat16=0.98'; replaces --content's")
  ap.add_argument("--gate", choices=("mean", "min"), default="mean",
                  help="compare the thresholds with the mean over frames or with the worst frame")
  ap.add_argument("--max-latent-diff", default=None,
                  help="max |final latents - reference| allowed, e.g. 'float32=1e-4' (not checked if not given)")
  ap.add_argument("--per-frame", action="store_true", help="print per-frame values in matrix mode too")
  ap.add_argument("--json", help="write the report here")
  ap.add_argument("--plots", metavar="DIR",
                  help="write a contact sheet per candidate (reference row over candidate row) and a per-frame "
                       "PSNR/SSIM plot (per_frame.png) into DIR")
  return ap


def plan(args: argparse.Namespace) -> dict[str, Any]:
  """Validated candidates and thresholds from the command line (no JAX).

  Raises:
    UsageError: --matrix with explicit candidate axes, bad meshes or thresholds.
  """
  if args.matrix and (args.dtype or args.mesh or args.attention):
    raise UsageError("--matrix sets --dtype, --mesh and --attention itself; drop them or drop --matrix")
  dtypes = list(DTYPES) if args.matrix else (args.dtype or ["bfloat16"])
  meshes = list(MATRIX_MESHES) if args.matrix else (args.mesh or [DEFAULT_MESH])
  attentions = list(MATRIX_ATTENTION) if args.matrix else (args.attention or ["auto"])
  try:
    specs = {text: MeshSpec.parse(text) for text in meshes}
  except ValueError as e:
    raise UsageError(str(e)) from e
  fill_defaults(args)
  if args.steps < 1 or args.frames < 1 or args.max_sequence_length < 1:
    raise UsageError(f"--steps ({args.steps}), --frames ({args.frames}) and --max-sequence-length "
                     f"({args.max_sequence_length}) must be positive")
  content = args.content or ("noise" if args.model == "tiny-random" else "trained")
  min_psnr = (parse_thresholds(args.min_psnr, "--min-psnr") if args.min_psnr is not None
              else dict(THRESHOLDS[content]["psnr"]))
  min_ssim = (parse_thresholds(args.min_ssim, "--min-ssim") if args.min_ssim is not None
              else dict(THRESHOLDS[content]["ssim"]))
  quantizes = [None if q == "none" else q for q in (args.quantize or ["none"])]
  exchanges = args.attention_exchange or ["bf16"]
  candidates = [dict(dtype=d, quantize=q, exchange=x, mesh=m, spec=specs[m], attention=a)
                for d, q, x, m, a in itertools.product(dtypes, quantizes, exchanges, meshes, attentions)]
  plots = None
  if args.plots is not None:
    names = [sheet_name(i, c) for i, c in enumerate(candidates)] + [PER_FRAME_PLOT]
    if os.path.exists(args.plots) and not os.path.isdir(args.plots):
      raise UsageError(f"--plots {args.plots!r} is a file, not a directory")
    taken = [n for n in names if os.path.lexists(os.path.join(args.plots, n))]
    if taken:
      raise UsageError(f"--plots {args.plots!r} already holds {', '.join(taken)}; remove them or choose another "
                       "directory")
    plots = args.plots
  return dict(candidates=candidates, devices=max(c["spec"].devices for c in candidates), plots=plots,
              content=content, min_psnr=min_psnr, min_ssim=min_ssim,
              max_latent_diff=parse_thresholds(args.max_latent_diff, "--max-latent-diff"))


DEFAULT_MESH = "U=2,R=2"


def fit_devices(p: dict[str, Any], args: argparse.Namespace, device_count: int, platform: str
                ) -> tuple[dict[str, Any], str | None]:
  """The plan `p` for the `device_count` visible devices of `platform` (JAX up), and a note when it
  changed. Meshes that fit are kept. On an accelerator, whose devices cannot be simulated, the
  default mesh (no --mesh, no --matrix) falls back to a ring over the visible devices (U=1,R=n, which
  fits any model; one device: U=1,R=1), said in the note.

  Raises:
    UsageError: a candidate mesh larger than the visible devices, naming what to run: on CPU the
      device-count flag (as `main` sets it when JAX has not started), elsewhere smaller meshes.
  """
  if device_count >= p["devices"]:
    return p, None
  if platform == "cpu":
    raise UsageError(f"the largest candidate mesh needs {p['devices']} devices but JAX sees {device_count}; "
                     f"start with XLA_FLAGS=--{DEVICE_FLAG}={p['devices']} on CPU")
  devices = f"{device_count} visible {platform} device{'s' if device_count != 1 else ''}"
  fits = MeshSpec(ring=device_count)
  if args.mesh or args.matrix:
    given = "--matrix's meshes need" if args.matrix else "the largest --mesh needs"
    raise UsageError(f"{given} {p['devices']} devices but there are {device_count} ({devices}); give meshes of "
                     f"at most {device_count} devices, e.g. --mesh {fits}")
  candidates = [dict(c, mesh=str(fits), spec=fits) for c in p["candidates"]]
  note = (f"the default mesh {DEFAULT_MESH} needs {p['devices']} devices but there are {device_count} "
          f"({devices}): checking on mesh {fits} instead (--mesh chooses another)")
  return dict(p, candidates=candidates, devices=fits.devices), note


PER_FRAME_PLOT = "per_frame.png"
# --model tiny: the trained default's own settings (generate's "tiny" preset, the text length it
# was trained with); anything else: a small size every Wan runs in seconds on a CPU.
TINY_DEFAULTS = dict(prompt="a red square moving right", height=64, width=64, frames=17, steps=8)
OTHER_DEFAULTS = dict(prompt="a red fox running through snow", height=48, width=64, frames=9, steps=4)


def fill_defaults(args: argparse.Namespace) -> None:
  """Sets the settings left at None from --model (`TINY_DEFAULTS` / `OTHER_DEFAULTS`; the text
  length as generate takes it: `pipelines.commands.presets.default_text_length`)."""
  for name, value in (TINY_DEFAULTS if args.model == "tiny" else OTHER_DEFAULTS).items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.max_sequence_length is None:
    args.max_sequence_length = default_text_length(args.model)


def sheet_name(index: int, candidate: dict[str, Any]) -> str:
  """File name of a candidate's contact sheet: '00_bfloat16_U2R2_auto.png' (CFG/U/R degrees)."""
  spec = candidate["spec"]
  mesh = (f"C{spec.cfg}" if spec.cfg > 1 else "") + f"U{spec.ulysses}R{spec.ring}"
  quantize = f"_{candidate['quantize']}" if candidate.get("quantize") else ""
  exchange = "_fp8x" if candidate.get("exchange") == "fp8" else ""
  return f"{index:02d}_{candidate['dtype']}{quantize}{exchange}_{mesh}_{candidate['attention']}.png"


def write_plots(directory: str, reference, candidates: list[tuple[str, Any, dict[str, Any]]],
                thresholds: dict[str, Any]) -> list[str]:
  """Contact sheets and the per-frame plot of one quality run; returns the paths written.

  Args:
    directory: created if missing.
    reference: float [F, H, W, 3] frames in [0, 1] (the reference video).
    candidates: (file name, frames [F, H, W, 3], report row with dtype, mesh, attention and
      psnr/ssim_per_frame) per candidate.
    thresholds: the plan's min_psnr / min_ssim by dtype (drawn dashed).
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from end_to_end.quality.video_metrics import PSNR_CAP_DB
  from pipelines.storage import video_io
  from pipelines.storage import contact_sheet

  os.makedirs(directory, exist_ok=True)
  written = []
  fig, (ax_p, ax_s) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
  axes = ((ax_p, "psnr_per_frame", "min_psnr"), (ax_s, "ssim_per_frame", "min_ssim"))
  for name, frames, row in candidates:
    label = f"{row['dtype']}{' ' + row['quantize'] if row.get('quantize') else ''} {row['mesh']['spec']} {row['attention']}"
    written.append(contact_sheet.write_contact_sheet(
        [reference, frames], os.path.join(directory, name), labels=["reference fp32 1 dev lse", label]))
    for ax, key, _ in axes:
      ax.plot(range(len(row[key])), row[key], marker="o", ms=3, label=label)
  for dtype in sorted({row["dtype"] for _, _, row in candidates}):
    for ax, _, bar in axes:
      if dtype in thresholds[bar]:
        ax.axhline(thresholds[bar][dtype], ls="--", lw=1, color="gray")
        ax.annotate(f"{dtype} bar", (0, thresholds[bar][dtype]), fontsize=7, color="gray")
  ax_p.set(xlabel="frame", ylabel=f"PSNR (dB, data range 1; identical frames at {PSNR_CAP_DB:g})",
           title="PSNR vs reference")
  ax_s.set(xlabel="frame", ylabel="SSIM (scikit-image)", title="SSIM vs reference")
  ax_p.legend(fontsize=7)
  path = os.path.join(directory, PER_FRAME_PLOT)
  with video_io.atomic_file(path, ".png", False) as temp:
    fig.savefig(temp, format="png", dpi=100)
  plt.close(fig)
  return written + [path]


def judge(metrics: dict[str, Any], dtype: str, thresholds: dict[str, Any], gate: str) -> list[str]:
  """The threshold failures of one candidate (empty when it passes); gate "mean" or "min"."""
  failures = []
  psnr, ssim = metrics[f"psnr_{gate}"], metrics[f"ssim_{gate}"]
  if dtype in thresholds["min_psnr"] and psnr < thresholds["min_psnr"][dtype]:
    failures.append(f"{gate} PSNR {psnr:.2f} dB < {thresholds['min_psnr'][dtype]} dB")
  if dtype in thresholds["min_ssim"] and ssim < thresholds["min_ssim"][dtype]:
    failures.append(f"{gate} SSIM {ssim:.5f} < {thresholds['min_ssim'][dtype]}")
  limit = thresholds["max_latent_diff"].get(dtype)
  if limit is not None and metrics["max_abs_latent_diff"] > limit:
    failures.append(f"max |latent diff| {metrics['max_abs_latent_diff']:.3e} > {limit:.3e}")
  return failures


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    p = plan(args)
  except UsageError as e:
    parser.print_usage(sys.stderr)
    print(f"error: {e}", file=sys.stderr)
    return 2
  request_cpu_devices(p["devices"])
  with warnings_as_lines("quality"):
    return _run(args, p)


class _Runs:
  """The tiny or folder pipeline of each (dtype, quantization), loaded once, and one call of it with
  the check's settings."""

  def __init__(self, args: argparse.Namespace):
    self.args, self.pipes = args, {}
    self.call = dict(height=args.height, width=args.width, num_frames=args.frames,
                     num_inference_steps=args.steps, guidance_scale=args.guidance,
                     max_sequence_length=args.max_sequence_length)

  def pipeline(self, dtype: str, quantize: str | None = None):
    from pipelines.pipeline.wan_pipeline import WanPipeline

    model = self.args.model
    if (dtype, quantize) not in self.pipes:
      self.pipes[dtype, quantize] = (
          WanPipeline.tiny(dtype, random=model == "tiny-random", quantize=quantize) if model in TINY_MODELS
          else WanPipeline.from_pretrained(model, dtype=dtype, quantize=quantize))
    return self.pipes[dtype, quantize]

  def generate(self, dtype: str, mesh: str | None, implementation: str, latents: Any, quantize=None,
               exchange="bf16"):
    return self.pipeline(dtype, quantize).run(self.args.prompt, self.args.negative_prompt, latents=latents, mesh=mesh,
                                              attention_implementation=implementation, progress=False,
                                              attention_exchange=exchange, **self.call)


def _run(args: argparse.Namespace, p: dict[str, Any]) -> int:
  """Runs the reference and every candidate of plan `p`, prints and writes the report; returns the
  exit status (`main`)."""
  import jax
  import numpy as np

  from pipelines.pipeline.checked.inputs import round_num_frames

  try:
    p, note = fit_devices(p, args, jax.device_count(), jax.default_backend())
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if note is not None:
    print(f"note: {note}", file=sys.stderr)
  args.frames = round_num_frames(args.frames)  # once, with its warning, before the latents' shape
  runs = _Runs(args)
  shape = runs.pipeline("float32").latent_shape(1, args.height, args.width, args.frames)
  # Every candidate's mesh and the call's sizes are checked before the (long) reference run.
  try:
    heads = runs.pipeline("float32").transformer_config.num_attention_heads
    for c in p["candidates"]:
      c["spec"].check(num_heads=heads, device_count=jax.device_count(), cfg_active=args.guidance > 1)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2

  def draw(seed: int) -> np.ndarray:  # the pipeline's own rule for video 0 of a seed
    return np.random.default_rng(seed).standard_normal(shape, np.float32)

  print(f"backend {jax.default_backend()} x{jax.device_count()}; model {args.model!r}; "
        f"{args.frames} frames {args.height}x{args.width}, {args.steps} steps, guidance {args.guidance}, "
        f"L={args.max_sequence_length}; latents {shape} from seed {args.seed}")
  start = time.perf_counter()
  ref = runs.generate("float32", None, REFERENCE_ATTENTION, draw(args.seed))
  print(f"reference: float32, one device, attention {REFERENCE_ATTENTION} forced "
        f"({time.perf_counter() - start:.1f} s)")
  candidate_seed = args.seed if args.candidate_seed is None else args.candidate_seed
  rows, videos = _candidates(args, p, runs, ref, draw(candidate_seed), candidate_seed)
  passed = all(r["passed"] for r in rows)
  if p["plots"] is not None:
    written = write_plots(p["plots"], ref.frames[0], videos, p)
    print(f"plots: {', '.join(written)}")
  print(f"{sum(r['passed'] for r in rows)}/{len(rows)} candidates pass "
        f"({args.gate} over frames: PSNR >= {p['min_psnr']}, SSIM >= {p['min_ssim']}"
        + (f", max latent diff {p['max_latent_diff']}" if p["max_latent_diff"] else "")
        + f"; thresholds for {CONTENT[p['content']]}, --content {p['content']}"
        + ("; --min-psnr/--min-ssim given" if args.min_psnr or args.min_ssim else "") + ")")
  if args.json:
    _write_report(args, p, ref, rows, latent_shape=shape, candidate_seed=candidate_seed, passed=passed)
  return 0 if passed else 1


def _write_report(args: argparse.Namespace, p: dict[str, Any], ref: Any, rows: list[dict], *,
                  latent_shape: tuple[int, ...], candidate_seed: int, passed: bool) -> None:
  """--json: the settings, the reference, the thresholds and every candidate's row."""
  import jax

  report = dict(
      backend=jax.default_backend(), device_count=jax.device_count(), model=args.model,
      settings=dict(prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height,
                    width=args.width, frames=args.frames, steps=args.steps, guidance=args.guidance,
                    max_sequence_length=args.max_sequence_length, seed=args.seed,
                    candidate_seed=candidate_seed, latent_shape=list(latent_shape)),
      reference=dict(dtype="float32", mesh=None, attention=REFERENCE_ATTENTION, timings=ref.timings),
      thresholds=dict(content=p["content"], min_psnr=p["min_psnr"], min_ssim=p["min_ssim"],
                      max_latent_diff=p["max_latent_diff"], gate=f"{args.gate} over frames"),
      metric_notes=dict(psnr="dB, data range 1, identical frames capped at 200 dB",
                        ssim="skimage structural_similarity, data_range=1.0, channel_axis=-1, 7x7 window"),
      candidates=rows, passed=passed)
  write_json(report, args.json, overwrite=True)


def _candidates(args: argparse.Namespace, p: dict[str, Any], runs: _Runs, ref: Any, latents: Any,
                seed: int) -> tuple[list[dict], list[tuple]]:
  """Every candidate of plan `p` run from `latents` and judged against the reference `ref`, a table
  row printed for each: (the report's rows, the (sheet name, frames, row) of each for the plots)."""
  from end_to_end.quality.video_metrics import compare_videos, max_abs_diff

  # The quantize column only when asked for (any quantized or fp8-exchange candidate).
  quantized = any(c["quantize"] or c["exchange"] != "bf16" for c in p["candidates"])
  print(f"{'dtype':9s} {'quantize  ' if quantized else ''}{'mesh':8s} {'attention':9s} {'PSNR mean':>9s} {'PSNR min':>9s} "
        f"{'SSIM mean':>9s} {'SSIM min':>9s} {'max|dlat|':>10s} {'sec':>6s}  verdict")
  rows, videos = [], []
  for index, c in enumerate(p["candidates"]):
    start = time.perf_counter()
    out = runs.generate(c["dtype"], c["mesh"], c["attention"], latents, c["quantize"], c["exchange"])
    seconds = time.perf_counter() - start
    metrics = compare_videos(ref.frames, out.frames)
    metrics["max_abs_latent_diff"] = max_abs_diff(ref.latents, out.latents)
    failures = judge(metrics, "bfloat16" if c["quantize"] or c["exchange"] != "bf16" else c["dtype"], p, args.gate)
    rows.append(dict(dtype=c["dtype"], quantize=c["quantize"], attention_exchange=c["exchange"],
                     mesh=c["spec"].describe(), attention=c["attention"],
                     seed=seed, seconds=seconds, timings=out.timings, passed=not failures,
                     failures=failures, **metrics))
    if p["plots"] is not None:
      videos.append((sheet_name(index, c), out.frames[0], rows[-1]))
    verdict = "pass" if not failures else "FAIL: " + "; ".join(failures)
    mesh = str(c["spec"])
    label = (c["quantize"] or "none") + ("+fp8x" if c["exchange"] == "fp8" else "")
    column = f"{label:9s} " if quantized else ""
    print(f"{c['dtype']:9s} {column}{mesh:8s} {c['attention']:9s} {metrics['psnr_mean']:9.2f} "
          f"{metrics['psnr_min']:9.2f} {metrics['ssim_mean']:9.5f} {metrics['ssim_min']:9.5f} "
          f"{metrics['max_abs_latent_diff']:10.3e} {seconds:6.1f}  {verdict}")
    if args.per_frame or len(p["candidates"]) == 1:
      print("  per-frame PSNR dB: " + " ".join(f"{v:.2f}" for v in metrics["psnr_per_frame"]))
      print("  per-frame SSIM:    " + " ".join(f"{v:.5f}" for v in metrics["ssim_per_frame"]))
  return rows, videos


if __name__ == "__main__":
  sys.exit(main())
