"""Which mesh for a Wan model, video size and device count: every valid choice, its cost, one pick.

  python -m end_to_end.plan --preset wan2.1-t2v-14b --devices 8 --chip v5e
  python -m end_to_end.plan --preset wan2.2-t2v-a14b --topology v6e:2x4 --json plan.json

Prints one row per (CFG, U, R, weight sharding): memory per device, collective bytes per step by
kind, FLOPs per device, a modelled step time, whether it fits, and the recommendation
(pipelines/parallel/planner.py documents the model and the chip numbers). `--topology NAME:AxB` takes the
chip from the name and the device count from the shape, and compiles every candidate's denoising
step for that TPU topology ahead of time (libtpu, no TPU needed; `end_to_end/aot/step.py`): its memory
is then XLA's own analysis of the compiled program (arguments + temporaries + outputs not aliased
to donated inputs, plus the second expert's weights for Wan 2.2 A14B), and a candidate fits when
that is at most the planner's fraction of the chip's memory (or XLA refuses it for running out of
memory). Compiling takes about 30-80 s per 14B candidate on a 2-core host; `--estimate` skips it
and uses the planner's estimate, which the output then says. With `--devices` the memory is always
the estimate. `generate --mesh auto` uses the estimate's recommendation for the visible devices.
Exit status: 0 with a recommendation, 1 when nothing fits, 2 for a bad argument, 3 when the
topology cannot be built here (libtpu missing: the message says how to install it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pipelines.commands.help import HelpFormatter


def _topology(text: str) -> tuple[str, int]:
  """"v6e:2x4" -> ("v6e", 8)."""
  chip, _, shape = text.partition(":")
  try:
    dims = [int(x) for x in shape.lower().split("x")]
  except ValueError:
    dims = []
  if not chip or not dims or min(dims) < 1:
    raise ValueError(f"--topology {text!r} must be CHIP:AxB (e.g. v6e:2x4, v5e:2x4)")
  return chip.lower(), math.prod(dims)


def _windows(args: argparse.Namespace, frames: int):
  """--context-frames / --context-overlap as `ContextWindows` (`window_inputs.context_windows`; None
  without them or for a window as long as the video).

  Raises:
    ValueError: the request's own refusals (a window not 4k + 1, longer than the video, an overlap
      not a multiple of 4 below it, an overlap without a window).
  """
  from pipelines.pipeline.checked.window_inputs import context_windows
  return context_windows(args.context_frames, args.context_overlap, "pyramid", num_frames=frames)


def build_parser() -> argparse.ArgumentParser:
  from pipelines.parallel import planner
  from pipelines.commands.presets import PRESETS
  from pipelines.wan.transformer import PRESETS as MODELS

  p = argparse.ArgumentParser(prog="plan", description=__doc__, formatter_class=HelpFormatter)
  p.add_argument("--preset", required=True, choices=[m for m in MODELS if m in PRESETS],
                 help="the model (its published size, steps and guidance are the defaults)")
  where = p.add_mutually_exclusive_group(required=True)
  where.add_argument("--devices", type=int, help="devices in the mesh")
  where.add_argument("--topology", help="CHIP:AxB, e.g. v6e:2x4 (chip and device count)")
  p.add_argument("--chip", choices=sorted(planner.CHIPS), default=None,
                 help="the accelerator with --devices (default v6e)")
  p.add_argument("--height", type=int)
  p.add_argument("--width", type=int)
  p.add_argument("--frames", type=int)
  p.add_argument("--context-frames", type=int, metavar="L",
                 help="the video in context windows of L frames (4k + 1): memory by a window's tokens, meshes "
                      "with W (windows at once) up to the windows' count")
  p.add_argument("--context-overlap", type=int, metavar="O",
                 help="with --context-frames: frames neighbouring windows share (default: a quarter of L)")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  p.add_argument("--max-sequence-length", type=int, default=512, help="text tokens")
  p.add_argument("--quantize", choices=("int8", "fp8", "int8-w8a8"), default=None,
                 help="the block Linear weights in one byte a value (+ fp32 scales per output channel)")
  p.add_argument("--estimate", action="store_true",
                 help="with --topology: the planner's memory estimate, no AOT compiles")
  p.add_argument("--json", help="write the candidates and the recommendation here")
  return p


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  from pipelines.parallel import planner

  try:
    chip_name, devices, (height, width, frames), found = _candidates(args)
  except ValueError as e:
    parser.print_usage(sys.stderr)
    print(f"plan: error: {e}", file=sys.stderr)
    return 2
  chip = planner.CHIPS[chip_name]
  memory_kind = "estimate"
  if args.topology and not args.estimate:
    try:
      found = _compiled_memory(found, args, height=height, width=width, frames=frames, chip=chip)
    except RuntimeError as e:
      print(f"plan: error: {e}", file=sys.stderr)
      return 3
    memory_kind = "xla"
  best = planner.recommend(found)
  _print_plan(args, found, best, chip, devices, (height, width, frames), memory_kind)
  if args.json:
    try:
      f = open(args.json, "w", encoding="utf-8")
    except OSError as e:
      print(f"plan: error: --json {args.json!r}: {e}", file=sys.stderr)
      return 2
    with f:
      json.dump({"preset": args.preset, "devices": devices, "chip": chip_name, "height": height,
                 "width": width, "frames": frames, "dtype": args.dtype, "memory": memory_kind,
                 "candidates": [c.to_dict() for c in found],
                 "recommended": None if best is None else str(best.mesh),
                 "recommended_shard_weights": None if best is None else best.mesh.shard_weights}, f, indent=2)
  return 0 if best is not None else 1


def _candidates(args: argparse.Namespace) -> tuple[str, int, tuple[int, int, int], list]:
  """(the chip's name, the device count, (height, width, frames), every candidate mesh with the
  planner's estimates) for the flags (ValueError names a bad one)."""
  from pipelines.parallel import planner
  from pipelines.commands.presets import PRESETS
  from pipelines.pipeline.checked.inputs import check_size, round_num_frames
  from pipelines.pipeline.checked.model_facts import token_facts
  from pipelines.wan.pretrained import TINY_TRANSFORMER
  from pipelines.wan.transformer import param_counts, PRESETS as MODELS, quantized_counts
  from pipelines.wan.vae import VAE_PRESETS

  if args.topology and args.chip:
    raise ValueError(f"--topology {args.topology} names the chip; drop --chip {args.chip}")
  chip_name, devices = _topology(args.topology) if args.topology else (args.chip or "v6e", args.devices)
  if chip_name not in planner.CHIPS:
    raise ValueError(f"unknown chip {chip_name!r}; known: {', '.join(sorted(planner.CHIPS))}")
  preset = PRESETS[args.preset]
  height = preset.height if args.height is None else args.height
  width = preset.width if args.width is None else args.width
  check_size(height, width)
  frames = round_num_frames(preset.frames if args.frames is None else args.frames)
  if args.max_sequence_length < 1:
    raise ValueError(f"--max-sequence-length {args.max_sequence_length} must be >= 1")
  experts = 2 if args.preset == "wan2.2-t2v-a14b" else 1
  model = TINY_TRANSFORMER if args.preset == "tiny" else MODELS[args.preset]  # what WanPipeline.tiny() runs
  # The VAE of each preset's folder: Wan 2.2's for TI2V-5B (16x spatial), Wan 2.1's for the others.
  vae = VAE_PRESETS[{"tiny": "tiny", "wan2.2-ti2v-5b": "wan2.2"}.get(args.preset, "wan2.1")]
  facts = token_facts(model, spatial_factor=vae.spatial_factor, temporal_factor=vae.temporal_factor,
                      text_tokens=args.max_sequence_length)
  windows = _windows(args, frames)
  found = planner.candidates(model, facts, param_counts=param_counts(model), devices=devices, frames=frames,
                             windows=None if windows is None else (windows.video_frames()[0], len(windows.starts)),
                             height=height, width=width, cfg=preset.guidance[0] > 1, dtype=args.dtype,
                             experts=experts, chip=planner.CHIPS[chip_name],
                             quantized=quantized_counts(model) if args.quantize else (0, 0))
  return chip_name, devices, (height, width, frames), found


def _print_plan(args: argparse.Namespace, found: list, best, chip, devices: int, video: tuple[int, int, int],
                memory_kind: str) -> None:
  """The plan's header, one row per candidate (fitting ones first, fastest first), the pick."""
  from pipelines.parallel import planner

  height, width, frames = video
  print(f"{args.preset}, {frames} frames {width}x{height}"
        f"{'' if args.context_frames is None else f' in windows of {args.context_frames}'}, {args.dtype}"
        f"{', ' + args.quantize if args.quantize else ''}, {devices} x {chip.name} "
        f"({chip.memory_bytes / planner.GiB:.0f} GiB each; {chip.source})")
  print("memory: the planner's estimate (pipelines/parallel/planner.py), not XLA's analysis" if memory_kind == "estimate"
        else f"memory: XLA's memory analysis of each candidate's step compiled for TPU {args.topology} "
             f"(fits: <= {planner.FIT_FRACTION:g} x {chip.memory_bytes / planner.GiB:.0f} GiB)")
  print(f"{'mesh':>16} {'weights':>8} {'GiB/dev':>8} {'fits':>5} {'a2a GB':>7} {'ring GB':>8} "
        f"{'cfg MB':>7} {'wgath GB':>9} {'TFLOP/dev':>10} {'step s':>7}")
  for c in sorted(found, key=lambda c: (not c.fits, c.step_s_model)):
    comm = c.collective_bytes
    print(f"{str(c.mesh):>16} {'sharded' if c.mesh.shard_weights else 'replic.':>8} "
          f"{c.bytes_per_device / planner.GiB:8.2f} {'yes' if c.fits else 'NO':>5} "
          f"{comm['all_to_all'] / 1e9:7.2f} {comm['ring_permute'] / 1e9:8.2f} {comm['cfg_exchange'] / 1e6:7.2f} "
          f"{comm['weight_all_gather'] / 1e9:9.2f} {c.flops_per_device / 1e12:10.1f} {c.step_s_model:7.2f}"
          + (f"  ({c.memory_note})" if c.memory_note else ""))
  if best is None:
    print(f"recommended: none fits on {devices} x {chip.name}; use more devices or a smaller video")
  else:
    flag = " --shard-weights" if best.mesh.shard_weights else ""
    print(f"recommended: --mesh {best.mesh}{flag} (modelled {best.step_s_model:.2f} s/step, "
          f"{best.bytes_per_device / planner.GiB:.1f} GiB per device)")


def _compiled_memory(found, args, *, height: int, width: int, frames: int, chip):
  """Each candidate with XLA's per-device memory of its step compiled for `args.topology`.

  Raises:
    RuntimeError: the topology cannot be built (no libtpu), saying how to fix it.
  """
  import dataclasses

  from end_to_end.aot import step as aot_step
  from pipelines.parallel import planner
  from pipelines.commands.presets import PRESETS

  try:
    devices = aot_step.topology_devices(args.topology, timeout_s=120)
  except aot_step.TopologyUnavailable as e:
    raise RuntimeError(f"{e}; or pass --estimate") from e
  preset, windows = PRESETS[args.preset], _windows(args, frames)
  out = []
  for i, c in enumerate(found):
    print(f"  compiling {i + 1}/{len(found)}: {c.mesh}{' sharded' if c.mesh.shard_weights else ''} ...",
          end="", flush=True, file=sys.stderr)
    try:
      report = aot_step.compile_denoise_step(devices, preset=args.preset, height=height, width=width, frames=frames,
                                        dtype=args.dtype, text_len=args.max_sequence_length,
                                        flow_shift=preset.shift, mesh_spec=c.mesh, quantize=args.quantize,
                                        context=None if windows is None else windows.video_frames())
      code = report["memory_analysis"]["generated_code_size_in_bytes"] / 2**20
      held, note = float(report["resident_bytes_per_device"]), f"{report['compile_s']:.0f} s, code {code:.1f} MiB"
      fits = held <= planner.FIT_FRACTION * chip.memory_bytes
    except Exception as e:  # noqa: BLE001 - e.g. XLA "ran out of memory in memory space hbm"
      first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
      held, fits, note = float("nan"), False, f"not compiled: {first}"
    print(f" {held / planner.GiB:.2f} GiB ({note})", flush=True, file=sys.stderr)
    out.append(dataclasses.replace(c, bytes_per_device=held, fits=fits, memory="xla", memory_note=note))
  return out


if __name__ == "__main__":
  sys.exit(main())
