"""End-to-end runtime of text-to-video generation by stage, ours and (optionally) diffusers'.

  python -m end_to_end.bench.pipeline --preset tiny --compare diffusers
  python -m end_to_end.bench.pipeline --preset 1.3b-width --compare diffusers --json bench.json   # CPU
  python -m end_to_end.bench.pipeline --preset wan2.1-1.3b --compare diffusers --steps 10          # 1 GPU
  python -m end_to_end.bench.pipeline --preset wan2.1-14b --mesh U=4,R=2                           # 8 chips
  python -m end_to_end.bench.pipeline --model ./Wan2.1-T2V-1.3B-Diffusers --compare diffusers      # real weights
  python -m end_to_end.bench.pipeline --aot v6e:2x4 --json aot.json       # TPU compile report, no TPU needed

Presets (`end_to_end/bench/presets.py`): tiny; 1.3b-width (the real Wan 1.3B block width with 2
of its 30 blocks, at a CPU-sized video); wan2.1-1.3b and wan2.1-14b (the real architectures at
480p / 720p x 81 frames) for accelerators; mlperf-wan22-t2v (MLPerf Inference v6.0's text-to-video
settings, Wan 2.2 A14B: its warm total compares with the published latency per video; on a CPU
backend it runs reduced and says it is not comparable). Weights are random (timing depends on
shapes only).

Stages (`end_to_end/bench/timed_runs.py`): load (our random init, or from_pretrained of a folder), text
encode, compile (our jitted denoise step; diffusers is eager: 0), denoise per step (min and
median over steps), all steps, VAE decode, total (the call, load excluded). `--runs 2` (default)
calls each pipeline twice with the same inputs: run 1 is what one video costs from a fresh
process (ours compiles text encoder, step and VAE there), run 2 is the steady state. The ratio
column is ours / diffusers on the last run (< 1: ours is faster).

`--compare diffusers` builds diffusers' random-weight pipeline for the preset with torch's
default init, saves it with `save_pretrained` (to --folder, default a temporary folder), and loads
BOTH pipelines from it: the very same weights. Both run the same prompt, negative prompt, size,
steps, guidance, sequence length and the same explicit initial latents, in this process, one
after the other; their videos are compared (PSNR) as a check that the settings match. diffusers
runs on --torch-device (default: cuda when available, else cpu), ours on JAX's default backend.

`--aot TOPOLOGY` (e.g. v6e:2x4, v5e:4x4; needs libtpu, see `end_to_end/aot/step.py`) compiles the denoise
step of Wan 1.3B at 480p and Wan 14B at 720p (81 frames, bf16, CFG) for that TPU topology here and prints
per-device memory and cost analysis, compile time and collectives: a compile-time report, not a runtime
measurement. A topology not initialised within --aot-init-timeout seconds, or at all: why, and status 3.
Exit status: 0 on success, 2 on a usage error, 3 when the TPU topology is unavailable.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

from attention.mesh import MeshSpec, request_cpu_devices  # before JAX's backend starts: fake devices can be requested
from pipelines.commands.help import HelpFormatter  # no JAX import either
from pipelines.storage.video_io import write_json  # nor this

PRESET_NAMES = ("tiny", "1.3b-width", "wan2.1-1.3b", "wan2.1-1.3b-step", "wan2.1-14b", "wan2.2-ti2v-5b",
                "mlperf-wan22-t2v")
ROWS = ("load", "text_encode", "compile", "denoise_step_min", "denoise_step_median", "denoise", "decode", "total")
# libtpu offline (no metadata server, no TPU). ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu's one-process lock
# (/tmp/libtpu_lockfile) guards real TPU chips; an AOT compile touches none, so two may run at once.
def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m end_to_end.bench.pipeline", description=__doc__,
                               formatter_class=HelpFormatter)
  _add_run_flags(ap)
  _add_aot_flags(ap)
  ap.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas"),
                  help="attention kernels (auto: Pallas on TPU/GPU, so the Pallas kernels for --aot; XLA on CPU)")
  ap.add_argument("--json", help="write the report here")
  return ap


def _add_run_flags(ap: argparse.ArgumentParser) -> None:
  """The timed run's flags, in their own --help group."""
  g = ap.add_argument_group("the timed run (ours and, with --compare, diffusers')")
  g.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                 help="architecture and video size (table in docs/measurements/pipeline.md)")
  g.add_argument("--model", help="a diffusers Wan folder to load instead of the preset's random weights "
                 "(the preset still gives the run settings)")
  g.add_argument("--height", type=int)
  g.add_argument("--width", type=int)
  g.add_argument("--frames", type=int,
                 help="4k + 1; other counts become frames // 4 * 4 + 1 as in diffusers (16 -> 17)")
  g.add_argument("--steps", type=int)
  g.add_argument("--layers", type=int, help="override the transformer's number of blocks")
  g.add_argument("--dtype", choices=("float32", "bfloat16"))
  g.add_argument("--vae-dtype", choices=("float32", "bfloat16"), default="float32",
                 help="ours: the VAE's dtype (float32: full fp32 products, several bf16 passes each on a TPU)")
  g.add_argument("--quantize", choices=("int8", "fp8", "int8-w8a8"),
                 help="the transformer's block Linear weights quantized (WanPipeline.quantize); with --aot "
                      "the compiled step holds them in one byte a value")
  g.add_argument("--guidance", type=float)
  g.add_argument("--max-sequence-length", type=int)
  g.add_argument("--prompt", default="a red fox running through snow, cinematic", help="the prompt")
  g.add_argument("--negative-prompt", help="the negative prompt (default: the preset's, else 'blurry, low quality')")
  g.add_argument("--seed", type=int, help="weights and initial latents (default: the preset's, else 0)")
  g.add_argument("--mesh", help="our (ring, ulysses) mesh, e.g. 'U=2,R=2' (default: one device)")
  g.add_argument("--placement", default="auto", choices=("auto", "resident", "encoder-offloaded", "encoder-on-host"),
                 help="our memory plan's placement (WanPipeline.set_memory_placement); each run prints its plan "
                      "and the device's peak memory")
  g.add_argument("--runs", type=int, default=2, help="calls per pipeline (1: cold only; 2: cold + warm)")
  g.add_argument("--cold-steps", type=int,
                 help="denoising steps of run 1 only (it compiles every program: the step count changes none), "
                      "so a 50-step warm run needs no 50-step cold one before it (default: --steps)")
  g.add_argument("--compare", choices=("diffusers",), help="also run diffusers' WanPipeline with the same weights")
  g.add_argument("--torch-device", help="diffusers' device (default cuda when available, else cpu)")
  g.add_argument("--folder", help="where to save the random diffusers pipeline (default: a temp folder, "
                 "removed); a folder already holding one (model_index.json) is reused as it is")


def _add_aot_flags(ap: argparse.ArgumentParser) -> None:
  """--aot and the flags of the TPU compile report, in their own --help group."""
  g = ap.add_argument_group("a TPU compile report instead of a timed run (--aot)")
  g.add_argument("--aot", metavar="TOPOLOGY", help="TPU AOT compile report, e.g. v6e:2x4 (no runtime benchmark)")
  g.add_argument("--aot-models", default="1.3b,14b",
                 help="which --aot targets, comma-separated: 1.3b (480x832), 14b (720x1280), a14b (Wan 2.2 "
                      "A14B, 720x1280, both experts resident), i2v-14b (Wan 2.1 I2V 14B, 720x1280, CLIP "
                      "image tokens), ti2v-5b (Wan 2.2 TI2V-5B, 704x1280 x 121 frames, per-token timesteps), vace-14b "
                      "(Wan 2.1 VACE 14B, 720x1280: 8 VACE blocks over the 96-channel context)")
  g.add_argument("--aot-kv-in-step", action="store_true",
                 help="with --aot: compile the step that computes the text (and image) cross-attention K/V "
                      "itself (CallOptions(text_kv_once=False)) instead of receiving them")
  g.add_argument("--stages", default="step",
                 help="with --aot, the programs compiled, comma-separated: text (the UMT5-XXL encoder), step (the "
                      "denoise step of each --aot-models), decode (the VAE decoder's first and later chunk programs, "
                      "one device and split over the topology)")
  g.add_argument("--compile-cache", metavar="DIR",
                 help="with --aot, JAX's persistent compilation cache in DIR; each row says whether its entry was "
                      "found (a second process, same programs) or written")
  g.add_argument("--compile-effort", type=float, metavar="E",
                 help="with --aot, XLA's execution-time optimization effort in [-1, 1] for every compile "
                      "(jax_exec_time_optimization_effort): below 0 trades the programs' speed for compile "
                      "time. Default: the pipeline's (0, and -0.5 for the VAE decoder on TPU: "
                      "vae.decode_compile_effort)")
  g.add_argument("--aot-frames", type=int, help="with --aot: the video's frames instead of each target's (4k + 1)")
  g.add_argument("--aot-context", metavar="FRAMES,OVERLAP",
                 help="with --aot: the step on context windows of FRAMES video frames overlapping by OVERLAP "
                      "(e.g. 81,32 with --aot-frames 241; W in --aot-mesh runs W windows at once)")
  g.add_argument("--aot-mesh", help="mesh for --aot, e.g. 'U=4,R=2' (default: largest U dividing the heads)")
  g.add_argument("--shard-weights", action="store_true",
                 help="with --aot-mesh: the transformer's block weights sharded over the mesh (FSDP)")
  g.add_argument("--breakdown", action="store_true",
                 help="with --aot and the step or decode stage: where each of those programs' modelled time goes, "
                      "by op class (libtpu's estimated cycles, the Pallas kernels' grid model, the collectives' ICI "
                      "model), each against the chip's roofline, and a modelled MFU (end_to_end/aot/breakdown.py)")
  g.add_argument("--aot-init-timeout", type=float, default=120.0,
                 help="seconds allowed for libtpu to build the topology before giving up")


def resolve_preset(args: argparse.Namespace, backend: str | None = None):
  """The preset with the command-line overrides applied (ValueError on bad values); a preset that
  reproduces a published benchmark is first cut to CPU size when `backend` is "cpu"
  (`bench.presets.reduced_for_cpu`)."""
  from end_to_end.bench.presets import PRESETS, reduced_for_cpu

  preset = PRESETS[args.preset]
  if args.compare and preset.boundary_ratio is not None:
    raise ValueError(f"--compare builds a one-transformer diffusers pipeline; --preset {args.preset} has two "
                 "experts (run it without --compare)")
  if preset.reference and backend == "cpu":
    preset = reduced_for_cpu(preset)
  overrides = {k: getattr(args, a) for k, a in (
      ("height", "height"), ("width", "width"), ("frames", "frames"), ("steps", "steps"), ("dtype", "dtype"),
      ("guidance", "guidance"), ("max_sequence_length", "max_sequence_length")) if getattr(args, a) is not None}
  if args.layers is not None:
    if args.layers < 1:
      raise ValueError(f"--layers {args.layers} must be >= 1")
    overrides["transformer"] = dataclasses.replace(preset.transformer, num_layers=args.layers)
  return dataclasses.replace(preset, **overrides)


def changed_settings(args: argparse.Namespace) -> list[str]:
  """The options given that change a preset's run settings (a comparable run leaves them unset)."""
  names = ("height", "width", "frames", "steps", "layers", "dtype", "guidance", "max_sequence_length", "quantize",
           "negative_prompt")
  return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None]


def _versions() -> dict[str, str]:
  import importlib.metadata as md

  out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": str(os.cpu_count())}
  for name in ("jax", "jaxlib", "flax", "torch", "diffusers", "transformers"):
    try:
      out[name] = md.version(name)
    except md.PackageNotFoundError:
      out[name] = "not installed"
  return out


def _fmt(v: float | None) -> str:
  return "-" if v is None else f"{v:.3f}"


def print_table(report: dict[str, Any]) -> None:
  """Stage table: ours (and diffusers) per run, ratio ours/diffusers on the last run."""
  ours, theirs = report["ours"], report.get("diffusers")
  runs = len(ours["runs"])
  names = ["cold", "warm"][:runs] if runs <= 2 else [f"run{i + 1}" for i in range(runs)]
  header = f"{'stage (s)':20s}" + "".join(f" {'ours ' + n:>11s}" for n in names)
  if theirs:
    header += "".join(f" {'diffusers ' + n:>15s}" for n in names) + f" {'ours/diffusers':>15s}"
  print(header)
  for row in ROWS:
    def value(side, i):
      return side["load_s"] if row == "load" else side["runs"][i][row]
    line = f"{row:20s}" + "".join(f" {_fmt(value(ours, i) if row != 'load' or i == 0 else None):>11s}"
                              for i in range(runs))
    if theirs:
      line += "".join(f" {_fmt(value(theirs, i) if row != 'load' or i == 0 else None):>15s}" for i in range(runs))
      ratio = report["ratios"].get(row)
      line += f" {'n/a' if ratio is None else f'{ratio:.2f}x':>15s}"
    print(line)


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
  """ours / diffusers per stage on the last run (load: the one load); None where diffusers is 0."""
  out = {}
  for row in ROWS:
    a = ours["load_s"] if row == "load" else ours["runs"][-1][row]
    b = theirs["load_s"] if row == "load" else theirs["runs"][-1][row]
    out[row] = a / b if b > 0 else None
  return out


def aot_targets() -> dict:
  from end_to_end.aot.step import AOT_TARGETS  # no JAX import: safe before the TPU environment is set
  return AOT_TARGETS


def _aot_step_row(args: argparse.Namespace, devices: list[Any], mesh: MeshSpec | None, name: str) -> dict[str, Any]:
  """The denoise step of `--aot-models` entry `name` compiled (or the error that stopped it)."""
  from end_to_end.aot import stages as aot_stages, step as aot_step

  t, once = aot_step.AOT_TARGETS[name], not args.aot_kv_in_step
  try:
    row, cache = aot_stages.with_cache_status(args.compile_cache, lambda: aot_step.compile_denoise_step(
        devices, preset=t.preset, height=t.height, width=t.width, frames=args.aot_frames or t.frames,
        dtype=args.dtype or "bfloat16", text_len=aot_step.AOT_TEXT_LEN, flow_shift=t.flow_shift, mesh_spec=mesh,
        attention_backend=args.attention_backend, quantize=args.quantize, ti2v=t.ti2v, text_kv_once=once,
        context=None if args.aot_context is None else tuple(int(v) for v in args.aot_context.split(",")),
        breakdown=args.breakdown))
    return dict(row, stage="step", cache=cache)
  except Exception as e:  # noqa: BLE001 - e.g. XLA "ran out of memory in hbm": report per model, go on
    return dict(stage="step", model=t.preset, height=t.height, width=t.width, frames=t.frames, text_kv_once=once,
                error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")


def _set_compile_effort(effort: float) -> None:
  """JAX's global `jax_exec_time_optimization_effort` for every compile that follows. Raises
  SystemExit naming the fix on a JAX without it (0.11 removed it)."""
  import jax
  if not hasattr(jax.config, "jax_exec_time_optimization_effort"):
    raise SystemExit(f"--compile-effort: JAX {jax.__version__} has no jax_exec_time_optimization_effort "
                 "(removed in 0.11); run the compile report with the setup's JAX 0.10, or leave "
                 "--compile-effort out")
  jax.config.update("jax_exec_time_optimization_effort", effort)


def run_aot(args: argparse.Namespace) -> int:
  """`--aot`: compile the `--stages` programs for the topology and print their rows (exit 3: no topology)."""
  from end_to_end.aot import step as aot_step

  if args.compile_effort is not None:
    _set_compile_effort(args.compile_effort)
  print(f"building TPU topology {args.aot!r} with libtpu (at most {args.aot_init_timeout:.0f} s) ...", flush=True)
  try:
    devices = aot_step.topology_devices(args.aot, timeout_s=args.aot_init_timeout)
  except aot_step.TopologyUnavailable as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  from end_to_end.aot import stages as aot_stages
  from end_to_end.aot.text import format_row as format_text_row

  mesh = MeshSpec.parse(args.aot_mesh, shard_weights=args.shard_weights) if args.aot_mesh else None
  stages, models, rows = aot_stages.parse_stages(args.stages), args.aot_models.split(","), []
  if args.compile_cache:
    aot_stages.enable_compile_cache(args.compile_cache)

  def emit(row: dict[str, Any]) -> None:  # after every program: a stopped run keeps the rows done so far
    rows.append(row)
    if args.json:
      write_json(dict(kind="aot", topology=args.aot, note="compile-time analysis, not a runtime measurement",
                      stages=stages, compile_effort=args.compile_effort, versions=_versions(), rows=rows),
                 args.json, overwrite=True)

  if "text" in stages:
    for row in aot_stages.text_rows(devices, mesh, args.compile_cache):
      print(format_text_row(row) + f", cache {row['cache']}", flush=True)
      emit(row)
  if "step" in stages:
    print(aot_step.format_header(args.aot), flush=True)
    for name in models:
      row = _aot_step_row(args, devices, mesh, name)
      aot_stages.print_row(aot_step.format_row(row) + (f"  cache {row['cache']}" if "cache" in row else ""), row)
      emit(row)
  if "decode" in stages:
    aot_stages.decode_rows(devices, models, args.dtype or "bfloat16", args.compile_cache,
                       lambda row: (aot_stages.print_row(aot_stages.format_decode_row(row), row), emit(row)),
                       compile_effort=args.compile_effort, breakdown=args.breakdown)
  return 0



def check_args(args: argparse.Namespace) -> None:
  """The flags' combinations, before JAX starts (ValueError names the flag)."""
  if args.mesh:
    MeshSpec.parse(args.mesh)
  if args.aot_mesh:
    MeshSpec.parse(args.aot_mesh)
  if args.shard_weights and not args.aot_mesh:
    raise ValueError("--shard-weights goes with --aot-mesh SPEC (the compiled configuration)")
  if args.runs < 1:
    raise ValueError(f"--runs {args.runs} must be >= 1")
  if args.cold_steps is not None and (args.cold_steps < 1 or args.runs < 2):
    raise ValueError(f"--cold-steps {args.cold_steps} must be >= 1 and goes with --runs 2 or more (the warm "
                     "run keeps --steps)")
  if any(name not in aot_targets() for name in args.aot_models.split(",")):
    raise ValueError(f"--aot-models {args.aot_models!r}: comma-separated from {', '.join(aot_targets())}")
  if args.compile_effort is not None and not -1.0 <= args.compile_effort <= 1.0:  # nan too
    raise ValueError(f"--compile-effort {args.compile_effort} must be in [-1, 1]")
  from end_to_end.aot.stages import parse_stages  # no JAX import
  parse_stages(args.stages)
  if args.breakdown and not (args.aot and {"step", "decode"} & set(parse_stages(args.stages))):
    raise ValueError("--breakdown models the compiled denoise step and decoder: give --aot TOPOLOGY with the "
                     "step or decode stage")
  if args.aot and (args.compare or args.model or args.mesh):
    raise ValueError("--aot is a compile-only report; drop --compare, --model and --mesh")


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    check_args(args)
  except ValueError as e:
    parser.print_usage(sys.stderr)
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.aot:
    return run_aot(args)
  if args.mesh:
    request_cpu_devices(MeshSpec.parse(args.mesh).devices)
  import jax

  try:
    preset = resolve_preset(args, backend=jax.default_backend())
  except ValueError as e:
    parser.print_usage(sys.stderr)
    print(f"error: {e}", file=sys.stderr)
    return 2
  report = run_timed(args, preset)
  print_table(report)
  if args.compare:
    a = report["agreement"]
    print(f"same video? ours vs diffusers: PSNR {a['psnr_mean_db']:.1f} dB, max |latent diff| "
          f"{a['max_abs_latent_diff']:.2e} (a check that both ran the same weights and settings)")
  if args.json:
    write_json(report, args.json, overwrite=True)
  return 0


def run_timed(args: argparse.Namespace, preset: Any) -> dict[str, Any]:
  """The timed runs of `preset` (ours; with --compare diffusers' from the same saved folder, and
  their agreement): the report `print_table` prints."""
  import jax
  import numpy as np

  from end_to_end.quality.video_metrics import max_abs_diff, psnr_per_frame

  torch_device = args.torch_device
  if args.compare and torch_device is None:
    import torch
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
  seed = args.seed if args.seed is not None else (preset.seed or 0)
  negative = args.negative_prompt
  if negative is None:
    negative = preset.negative_prompt or "blurry, low quality"
  call = dict(prompt=args.prompt, negative_prompt=negative, height=preset.height,
              width=preset.width, frames=preset.frames, steps=preset.steps, guidance=preset.guidance,
              max_sequence_length=preset.max_sequence_length)
  latents = np.random.default_rng(seed).standard_normal(preset.latent_shape, np.float32)
  comparable = _describe(args, preset, torch_device)
  folder, temporary = _diffusers_folder(args, preset, seed)
  report: dict[str, Any] = dict(
      kind="runtime", preset=args.preset, description=preset.description, model=args.model or "random",
      settings=dict(call, cold_steps=args.cold_steps, dtype=preset.dtype, quantize=args.quantize, seed=seed,
                    latent_shape=list(preset.latent_shape),
                    tokens=preset.tokens, transformer=preset.transformer.to_dict(),
                    text_encoder=dataclasses.asdict(preset.text_encoder), mesh=args.mesh,
                    guidance_2=preset.guidance_2, boundary_ratio=preset.boundary_ratio),
      backend=jax.default_backend(), device_count=jax.device_count(), versions=_versions(), comparable=comparable)
  try:
    report["ours"], ours_frames, ours_latents = _run_ours(args, preset, folder, latents, call, seed)
    if args.compare:
      import torch
      report["torch_threads"] = torch.get_num_threads()
      report["diffusers"], frames, final = _run_diffusers(args, preset, folder, torch_device, latents, call)
      report["ratios"] = ratios(report["ours"], report["diffusers"])
      report["agreement"] = dict(psnr_mean_db=float(np.mean(psnr_per_frame(frames, ours_frames))),
                                 max_abs_latent_diff=max_abs_diff(final, ours_latents))
  finally:
    if temporary:
      shutil.rmtree(folder, ignore_errors=True)
  return report


def _describe(args: argparse.Namespace, preset: Any, torch_device: str | None) -> dict[str, Any] | None:
  """Prints what runs (the preset, the backends); returns whether the run is comparable with the
  published benchmark the preset reproduces (None: it reproduces none)."""
  import jax

  from end_to_end.bench import presets as bench_presets

  print(f"preset {args.preset}: {preset.description}")
  t = preset.transformer
  print(f"  transformer {t.num_layers} layers D={t.dim} N={t.num_attention_heads} ffn={t.ffn_dim}; text encoder "
        f"{preset.text_encoder.num_layers} layers d={preset.text_encoder.d_model}; {preset.dtype}; "
        f"{preset.frames}x{preset.height}x{preset.width} -> latents {preset.latent_shape}, {preset.tokens} tokens; "
        f"{preset.steps} steps, guidance {preset.guidance}"
        + ("" if preset.boundary_ratio is None else f" / {preset.guidance_2} (two experts, boundary "
           f"{preset.boundary_ratio})") + f", L={preset.max_sequence_length}")
  comparable = None
  if preset.reference:
    comparable = bench_presets.mlperf_comparability(
        preset, reduced=jax.default_backend() == "cpu",
        changed=changed_settings(args), runs=args.runs)
    print(f"  comparable to {preset.reference}: "
          + ("yes (the warm run's total)" if comparable["comparable"] else "NO: " + "; ".join(comparable["reasons"])))
  print(f"  ours: JAX {jax.default_backend()} x{jax.device_count()}, mesh {args.mesh or 'none (one device)'}"
        + (f"; diffusers: torch {torch_device}" if args.compare else ""), flush=True)
  return comparable


def _diffusers_folder(args: argparse.Namespace, preset: Any, seed: int) -> tuple[str | None, bool]:
  """(the diffusers folder both pipelines load, whether it is a temporary one to remove): --model,
  or with --compare the preset's random weights saved (or a --folder already holding them)."""
  from end_to_end.bench import presets as bench_presets

  folder, temporary = args.model, False
  if args.compare and folder is None:
    folder = args.folder or tempfile.mkdtemp(prefix="wan_bench_")
    temporary = args.folder is None
    if os.path.isfile(os.path.join(folder, "model_index.json")):
      bench_presets.check_saved_pipeline(preset, folder)
      print(f"  reusing the pipeline saved in {folder}")
    else:
      start = time.perf_counter()
      bench_presets.save_diffusers_pipeline(preset, folder, seed=seed)
      print(f"  saved diffusers random-weight pipeline to {folder} ({time.perf_counter() - start:.1f} s)",
            flush=True)
  return folder, temporary


def _run_call(args: argparse.Namespace, call: dict[str, Any], i: int) -> dict[str, Any]:
  """Run `i`'s call: `call`, with --cold-steps steps for run 0 when given."""
  return dict(call, steps=args.cold_steps) if i == 0 and args.cold_steps else call


def _run_ours(args: argparse.Namespace, preset: Any, folder: str | None, latents: Any, call: dict[str, Any],
              seed: int) -> tuple[dict[str, Any], Any, Any]:
  """(our load and `--runs` runs' stage times, the last run's frames, its final latents)."""
  from end_to_end.bench import presets as bench_presets, timed_runs
  from pipelines.pipeline import WanPipeline

  start = time.perf_counter()
  pipe = (WanPipeline.from_pretrained(folder, dtype=preset.dtype, vae_dtype=args.vae_dtype) if folder
          else bench_presets.init_ours(preset, seed=seed, vae_dtype=args.vae_dtype))
  if args.quantize:
    pipe.quantize(args.quantize)
  pipe.set_memory_placement(args.placement)
  ours = dict(load_s=time.perf_counter() - start, load_kind="from_pretrained" if folder else "random init", runs=[],
              **timed_runs.flops_of(preset))
  for i in range(args.runs):
    stages, frames, final = timed_runs.run_ours(pipe, latents=latents, mesh=args.mesh, guidance_2=preset.guidance_2,
                                                attention_backend=args.attention_backend, **_run_call(args, call, i))
    stages.update(timed_runs.stage_rates(ours, stages, args.mesh, args.vae_dtype))
    ours["runs"].append(stages)
    print(timed_runs.run_line(i, stages, ours), flush=True)
  return ours, frames, final


def _run_diffusers(args: argparse.Namespace, preset: Any, folder: str, torch_device: str, latents: Any,
                   call: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
  """(diffusers' load and `--runs` runs' stage times, the last run's frames, its final latents)."""
  from end_to_end.bench import timed_runs

  start = time.perf_counter()
  pipe = timed_runs.load_diffusers(folder, dtype=preset.dtype, device=torch_device)
  theirs = dict(load_s=time.perf_counter() - start, load_kind="from_pretrained", device=torch_device, runs=[])
  for i in range(args.runs):
    stages, frames, final = timed_runs.run_diffusers(pipe, latents=latents, device=torch_device,
                                                     **_run_call(args, call, i))
    theirs["runs"].append(stages)
    print(f"  diffusers run {i + 1}: total {stages['total']:.2f} s", flush=True)
  return theirs, frames, final


if __name__ == "__main__":
  sys.exit(main())
