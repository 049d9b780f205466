"""`generate`: a Wan text-to-video clip from the command line, sequence-parallel over a mesh.

  generate --prompt "a red square moving right" --mesh U=2,R=2 --out square.mp4
  generate --model ./Wan2.1-T2V-1.3B-Diffusers --preset wan2.1-t2v-1.3b --mesh U=2,R=4 --prompt "..."

`--model tiny` (the default) is the embedded trained tiny model: it needs no download and draws the
shapes world it was trained on (end_to_end/synthetic_world.py: "a red square moving right", "a
yellow triangle standing still", ...; 64x64 x 17 frames by default); `--model tiny-random` is the
random-weight tiny model (noise-like videos); a diffusers-format folder gives real videos. On the
CPU backend a mesh needing more devices than are visible is simulated with that many CPU devices (XLA's
--xla_force_host_platform_device_count, set before JAX starts); `--devices N` asks for N explicitly.

Multi-host: start the same command once per process with `--coordinator HOST:PORT
--num-processes N --process-id I` (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID);
the mesh spans every process's devices (U*R = all of them), and only process 0 writes the output:

  generate --prompt "..." --mesh U=2,R=2 --seed 1 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
  generate --prompt "..." --mesh U=2,R=2 --seed 1 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1

Every argument is checked before any model is loaded, and every weight file's header before any
compute. A run whose denoising is estimated to take minutes or more says so in one line before it
starts; then a line or a bar shows each stage (text encode, compile, denoise, decode). Python
warnings print as `generate: warning: ...` lines and are kept in the sidecar. Output (mp4 via
imageio-ffmpeg, .gif, .npy float32 frames, or a folder of PNG frames) and its JSON sidecar (the
output's name + .json: fox.mp4.json) are written to a temporary name and renamed into place; an
existing output is replaced only with --overwrite, and a failed or interrupted run leaves neither.
`--contact-sheet` also writes a PNG grid of the frames beside it (fox.mp4.contact.png). The latents are checked for NaN/inf after every step (--no-nan-guard turns that off).

Compiled programs are kept in JAX's persistent compilation cache, so a second run of the same
shapes skips most compiling: in $XDG_CACHE_HOME/wan-usp-jax/jax (~/.cache/wan-usp-jax/jax), moved
with --compile-cache DIR or $WAN_USP_JAX_COMPILE_CACHE=DIR, off with --no-compile-cache or
WAN_USP_JAX_COMPILE_CACHE=off; the sidecar says whether it was hit.

Every numeric argument is checked for finiteness and range before compute. The video is read back
before it is renamed into place: an encoder failure or an output that does not decode to the frames
sent is an error, and nothing is left under --out. A GIF stores frame delays in whole centiseconds:
an --fps that is not 100 / an integer is rounded to the nearest delay, with a warning.

Meshes: --mesh U=4,R=2 (Ulysses x ring), CFG=2,U=2,R=2 (the guidance's cond and uncond halves on
separate halves of the devices), --shard-weights (block weights split over the devices), or
--mesh auto (the planner's pick for the visible devices; python -m end_to_end.plan shows why).

Resuming: --checkpoint-dir DIR saves the denoising state after every step (--checkpoint-every N;
runs estimated at two minutes or more save to OUT.resume unless --no-checkpoint); after Ctrl-C, a
lost process or a crash, `generate --resume DIR` continues it (flags left out are read from DIR,
given ones must match, except the mesh, devices and output) and makes the same video. The
checkpoint is removed once the video is written (--keep-checkpoint keeps it).

A multi-process run whose process dies (or whose host goes away) stops on every other process
within --heartbeat-timeout seconds (default 30) with one line naming the lost process and exit
status 3; nothing is written, and the runtime's own log (a C++ stack dump) goes to a file
(--runtime-log) instead of the terminal.

Exit status: 0 success; 2 a usage or checkpoint error (before any compute); 1 a failure while
running (non-finite latents, coordinator unreachable, the video encoder failing); 3 a process of a
multi-process run was lost; 130 interrupted (Ctrl-C or SIGTERM).

Also `python -m pipelines.cli.generate ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import signal
import sys
import time
import warnings
from typing import Any

from pipelines.storage import weights
from pipelines.pipeline import compile_cache
from pipelines.parallel import distributed
from pipelines.parallel import estimate
from pipelines.parallel import supervisor
from pipelines.storage import video_io
from attention.mesh import DEVICE_FLAG as _DEVICE_FLAG, MeshSpec, request_cpu_devices
from pipelines.cli.help import HelpFormatter, warnings_as_lines



@dataclasses.dataclass(frozen=True)
class Preset:
  """Published sampling defaults of a Wan release.

  Attributes:
    width, height: pixels.
    frames: video frames (4k + 1).
    steps: denoising steps.
    shift: flow shift of the scheduler.
    guidance: one CFG scale, or (high-noise, low-noise) for the two Wan 2.2 experts.
    source: where the numbers come from.
  """
  width: int
  height: int
  frames: int
  steps: int
  shift: float
  guidance: tuple[float, ...]
  source: str

  def __post_init__(self):
    if len(self.guidance) not in (1, 2):
      raise ValueError(f"{self.guidance=} needs one scale or two (high-noise, low-noise expert)")


PRESETS: dict[str, Preset] = {
    # diffusers Wan docs / Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler config (flow_shift 3.0 at 480p).
    "wan2.1-t2v-1.3b": Preset(832, 480, 81, 50, 3.0, (5.0,), "diffusers WanPipeline docs (480p: shift 3.0)"),
    # Wan2.1 generate.py defaults for t2v-14B (shift 5.0, guide scale 5.0, 50 steps) at 1280*720.
    "wan2.1-t2v-14b": Preset(1280, 720, 81, 50, 5.0, (5.0,), "Wan2.1 generate.py; diffusers docs (720p: shift 5.0)"),
    # Wan2.2 wan/configs/wan_t2v_A14B.py: sample_shift 12.0, 40 steps, sample_guide_scale (3.0 low
    # noise, 4.0 high noise), boundary 0.875 (read from the folder's model_index.json).
    "wan2.2-t2v-a14b": Preset(1280, 720, 81, 40, 12.0, (4.0, 3.0), "Wan2.2 configs/wan_t2v_A14B.py"),
    # The embedded tiny models: the size and sampler settings the trained default was trained and
    # accepted at (end_to_end/train_tiny.py); seconds on a laptop CPU.
    "tiny": Preset(64, 64, 17, 8, 3.0, (5.0,), "this project (the trained tiny default)"),
}
# The embedded models (`--model`): the trained default and the random-weight one.
TINY_MODELS = ("tiny", "tiny-random")


def default_text_length(model: str) -> int:
  """Text tokens per prompt when none are asked for: the length `model` (a `TINY_MODELS` name or a
  folder) was trained with, from its tokenizer's `model_max_length` (`tokenizer.folder_text_length`:
  64 for the trained tiny default, 512 for Wan folders); Wan's 512 for the random-weight tiny model.
  Reads one JSON file at most; loads no model."""
  from pipelines.wan import tokenizer as tokenization
  if model == "tiny-random":
    return tokenization.WAN_TEXT_LENGTH
  if model == "tiny":
    from pipelines.wan.tiny import TINY_DEFAULT_FOLDER  # a constant: no model is loaded
    model = TINY_DEFAULT_FOLDER
  return tokenization.folder_text_length(model)


# A folder without --preset: diffusers WanPipeline.__call__ defaults, shift from scheduler/.
FOLDER_DEFAULTS = Preset(832, 480, 81, 50, 0.0, (5.0,), "diffusers WanPipeline.__call__ defaults")


class UsageError(ValueError):
  """A command-line argument that cannot work; the message says what to do instead."""


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="generate", description=__doc__, formatter_class=HelpFormatter)
  p.add_argument("--prompt", default=None, help="what the video shows (required, except with --resume)")
  p.add_argument("--negative-prompt", default="", help="what to avoid (classifier-free guidance); default ''")
  p.add_argument("--model", default="tiny",
                 help="a diffusers-format Wan folder, 'tiny' (embedded trained shapes-world model; default) or "
                      "'tiny-random' (embedded random weights)")
  p.add_argument("--preset", default=None,
                 help=f"published defaults: {', '.join(PRESETS)} (default: 'tiny' for the tiny model, "
                      "diffusers' defaults for a folder)")
  p.add_argument("--size", default=None, help="WIDTHxHEIGHT in pixels, multiples of 16, e.g. 832x480 "
                                               "(Wan's 832*480 also accepted)")
  p.add_argument("--frames", type=int, default=None,
                 help="frames, 4k+1 (e.g. 81); other counts become frames // 4 * 4 + 1, as in diffusers "
                      "(16 -> 17, 10 -> 9)")
  p.add_argument("--steps", type=int, default=None, help="denoising steps")
  p.add_argument("--guidance", default=None,
                 help="CFG scale, or 'HIGH,LOW' for the two Wan 2.2 experts; <= 1 turns CFG off")
  p.add_argument("--shift", type=float, default=None, help="scheduler flow shift")
  p.add_argument("--seed", type=int, default=None,
                 help="noise seed; -1 or none for a random one (printed and recorded in the sidecar)")
  p.add_argument("--mesh", default="U=1,R=1",
                 help="device mesh, e.g. U=2,R=2 (also R=2,U=2, U=4): U Ulysses degree, R ring degree; "
                      "CFG=2,U=2,R=2 runs the guidance's cond and uncond halves on separate halves of the "
                      "devices; 'auto' takes the planner's pick for the visible devices (end_to_end.plan)")
  p.add_argument("--shard-weights", action="store_true",
                 help="shard the transformer's block weights over the mesh's devices (FSDP; for models "
                      "too big to replicate on each device)")
  p.add_argument("--vae-parallel", action=argparse.BooleanOptionalAction, default=True,
                 help="decode the latents split by rows over the mesh's devices (default); "
                      "--no-vae-parallel decodes on one device")
  p.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas"),
                 help="attention kernels: auto (Pallas kernels on TPU and GPU, XLA loops on CPU), xla, or "
                      "pallas (on CPU: interpret mode, slow; for checks); the same video either way")
  p.add_argument("--devices", type=int, default=None,
                 help="simulate N CPU devices (must equal the devices of --mesh); automatic when the mesh "
                      "needs it")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="transformer/text-encoder dtype (default float32 for tiny, bfloat16 for a folder)")
  p.add_argument("--max-sequence-length", type=int, default=None,
                 help="text tokens per prompt (default: 512 as Wan, or the shorter length the model folder's "
                      "tokenizer says it was trained with, model_max_length)")
  p.add_argument("--out", default="output.mp4",
                 help="*.mp4, *.gif, *.npy (float32 frames, unquantised), or a folder for PNG frames")
  p.add_argument("--fps", type=float, default=16.0,
                 help="frames per second of the output, %g to %g, as Wan (a GIF stores the nearest "
                      "whole-centisecond delay)" % video_io.FPS_RANGE)
  p.add_argument("--overwrite", action="store_true", help="replace an existing output and sidecar")
  p.add_argument("--contact-sheet", action="store_true",
                 help="also write a PNG grid of the video's frames next to it (--out + .contact.png: at most 9 "
                      "evenly spaced frames, small videos enlarged)")
  p.add_argument("--compile-cache", metavar="DIR", default=None,
                 help=f"JAX's persistent compilation cache (when not given: ${compile_cache.ENV}, else "
                      f"{compile_cache.default_dir()})")
  p.add_argument("--no-compile-cache", action="store_true", help="compile everything, keep nothing")
  p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                 help="a Wan LoRA (.safetensors file, or a folder holding one; diffusers or original Wan "
                      "keys) fused into the transformer with weight SCALE (default 1); repeatable")
  p.add_argument("--lora-2", action="append", default=[], metavar="PATH[:SCALE]",
                 help="as --lora, into transformer_2, the low-noise expert of a two-expert Wan 2.2 model "
                      "(diffusers' load_into_transformer_2=True)")
  p.add_argument("--step-cache", default=None, metavar="SPEC",
                 help="skip transformer blocks on steps whose change is small, reusing a cached residual: "
                      "first-block:THRESH (first-block cache, e.g. first-block:0.05) or "
                      "mag:THRESH[:K][@RATIOS.json] (MagCache; ratios from `python -m "
                      "end_to_end.calibrate_cache`, built in for the tiny model); off when omitted. "
                      "The skipped steps go into the sidecar")
  p.add_argument("--no-nan-guard", dest="nan_guard", action="store_false",
                 help="do not stop when the latents become NaN/inf (checked after every step)")
  c = p.add_argument_group("resumable denoising")
  c.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                 help="save the denoising state to DIR as the run goes (default for runs estimated "
                      f"at {estimate.LONG_S:g} s or more: OUT.resume beside the output)")
  c.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                 help="save after every N-th step (and after the last); default %(default)s")
  c.add_argument("--no-checkpoint", action="store_true", help="no checkpoint, even for a long run")
  c.add_argument("--keep-checkpoint", action="store_true",
                 help="keep the checkpoint after the video is written (default: removed)")
  c.add_argument("--resume", metavar="DIR", default=None,
                 help="continue the run saved in DIR; other flags may be left out (they are read from "
                      "DIR) and those given must match it, except the mesh, devices and output")
  g = p.add_argument_group("multi-process (multi-host) runs on JAX's distributed runtime")
  g.add_argument("--coordinator", default=None,
                 help=f"HOST:PORT of process 0 (default ${distributed.ENV_COORDINATOR})")
  g.add_argument("--num-processes", type=int, default=None,
                 help=f"processes in the run (default ${distributed.ENV_NUM_PROCESSES})")
  g.add_argument("--process-id", type=int, default=None,
                 help=f"this process, 0..N-1; 0 writes the output (default ${distributed.ENV_PROCESS_ID})")
  g.add_argument("--coordinator-timeout", type=int, default=distributed.DEFAULT_TIMEOUT_S,
                 help="seconds to wait for the coordinator and every process (default %(default)s)")
  g.add_argument("--heartbeat-timeout", type=int, default=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 help="seconds without a heartbeat after which a process counts as lost and every "
                      "process stops, exit status 3 (default %(default)s)")
  g.add_argument("--runtime-log", metavar="FILE", default=None,
                 help="where the runtime's own log lines go in a multi-process run (default: a file "
                      "in the system temporary directory, named when something goes wrong)")
  return p


@dataclasses.dataclass(frozen=True)
class Plan:
  """The validated request (everything that can be checked without JAX or weights)."""
  prompt: str
  negative_prompt: str
  model: str
  preset: str | None
  width: int
  height: int
  frames: int
  steps: int
  guidance: tuple[float, ...]
  shift: float | None
  seed: int | None
  mesh: MeshSpec | None  # None: --mesh auto, resolved by `check_plan`
  devices: int | None
  dtype: str
  max_sequence_length: int
  out: str
  fps: float
  overwrite: bool
  nan_guard: bool = True
  loras: tuple[tuple[str, float, int], ...] = ()  # (path, scale, expert 0 or 1), in loading order
  processes: distributed.ProcessSpec | None = None  # None: a single-process run
  compile_cache: str | None = None  # the persistent compilation cache's directory; None: off
  checkpoint_dir: str | None = None  # --checkpoint-dir or --resume
  checkpoint_every: int = 1
  checkpoint_default: bool = True  # False with --no-checkpoint
  keep_checkpoint: bool = False
  resume: bool = False
  step_cache: Any = None  # a step_cache.StepCacheSpec, or None: every step runs every block
  attention_backend: str = "auto"  # "auto" | "xla" | "pallas"
  vae_parallel: bool = True  # decode split by rows over the mesh's devices
  contact_sheet: bool = False  # also write video_io.contact_sheet_path(out)

  @property
  def mesh_devices(self) -> int | None:
    """Devices of the mesh (None for --mesh auto without --devices: the visible ones)."""
    return self.mesh.devices if self.mesh is not None else self.devices

  @property
  def writes(self) -> bool:
    """This process writes the output (process 0, or the only one)."""
    return self.processes is None or self.processes.process_id == 0


def parse_size(text: str) -> tuple[int, int]:
  """"832x480" or "832*480" -> (width, height).

  Raises:
    UsageError: anything else.
  """
  match = re.fullmatch(r"\s*(\d+)\s*[x*X]\s*(\d+)\s*", text)
  if match is None:
    raise UsageError(f"--size {text!r} is malformed; write WIDTHxHEIGHT, e.g. 832x480 or 1280x720")
  return int(match.group(1)), int(match.group(2))


def parse_guidance(text: str) -> tuple[float, ...]:
  """"5.0" -> (5.0,); "4.0,3.0" -> (4.0, 3.0).

  Raises:
    UsageError: not one or two numbers.
  """
  try:
    values = tuple(float(v) for v in text.split(","))
  except ValueError:
    values = ()
  if len(values) not in (1, 2):
    raise UsageError(f"--guidance {text!r} must be one number (e.g. 5.0) or two, 'HIGH,LOW', for the "
                     "two Wan 2.2 experts (e.g. 4.0,3.0)")
  return values


def parse_lora_arg(text: str, flag: str = "--lora") -> tuple[str, float]:
  """`PATH[:SCALE]` -> (path, scale); SCALE defaults to 1 (a path holding ':' keeps it when what
  follows the last ':' is not a number).

  Raises:
    UsageError: no such file or folder, or a scale that is not finite.
  """
  path, scale = text, 1.0
  head, sep, tail = text.rpartition(":")
  if sep:
    try:
      path, scale = head, float(tail)
    except ValueError:
      pass
  if not math.isfinite(scale):
    raise UsageError(f"{flag} {text!r}: the scale {tail!r} must be a finite number (1: as trained)")
  if not os.path.exists(path):
    raise UsageError(f"{flag} {text!r}: {path!r} is not a file or folder; pass a LoRA .safetensors "
                     "file (or its folder), optionally with :SCALE")
  return path, scale


def plan_run(args: argparse.Namespace) -> Plan:
  """Checks every argument that needs neither JAX nor weights.

  Raises:
    UsageError / ValueError: each bad argument, with what to do instead.
  """
  from pipelines.pipeline.inputs import check_size, round_num_frames  # light: no model, no compute

  if args.prompt is None:
    raise UsageError("--prompt is required (what the video shows), unless --resume DIR continues a "
                     "saved run")
  if not args.prompt.strip():
    raise UsageError(f"--prompt {args.prompt!r} is empty; describe the video, e.g. --prompt "
                     "'a red fox running through snow'")
  tiny = args.model in TINY_MODELS
  if not tiny and not os.path.isdir(args.model):
    raise UsageError(f"--model {args.model!r} is not a folder; pass a diffusers-format Wan folder "
                     "(model_index.json, transformer/, ...) or 'tiny' for the embedded default "
                     "('tiny-random': random weights)")
  preset_name = args.preset or ("tiny" if tiny else None)
  if preset_name is not None and preset_name not in PRESETS:
    raise UsageError(f"unknown --preset {preset_name!r}; use one of {', '.join(PRESETS)}")
  preset = PRESETS[preset_name] if preset_name else FOLDER_DEFAULTS
  if tiny and preset_name != "tiny":
    # A real model's preset on the random tiny model is almost always a mistake: it keeps the
    # tiny weights but runs at full size (minutes per step on a CPU).
    warnings.warn(f"--preset {preset_name} sets the size/steps of a real Wan checkpoint but --model is "
                  "the embedded tiny model; pass --model FOLDER for a real video",
                  stacklevel=2)
  width, height = parse_size(args.size) if args.size else (preset.width, preset.height)
  check_size(height, width)
  frames = args.frames if args.frames is not None else preset.frames
  if frames < 1:
    raise UsageError(f"--frames {frames} must be >= 1 (Wan: 4k+1, e.g. 81)")
  frames = round_num_frames(frames)  # warns when it changes the count
  steps = args.steps if args.steps is not None else preset.steps
  if steps < 1:
    raise UsageError(f"--steps {steps} must be >= 1")
  guidance = parse_guidance(args.guidance) if args.guidance is not None else preset.guidance
  if not all(math.isfinite(g) for g in guidance):
    raise UsageError(f"--guidance {args.guidance!r} must be finite (Wan: 5.0; <= 1 turns CFG off)")
  shift = args.shift if args.shift is not None else (preset.shift if preset_name else None)
  if shift is not None and not (math.isfinite(shift) and shift > 0):
    raise UsageError(f"--shift {shift} must be a finite number > 0 (Wan: 3.0 at 480p, 5.0 at 720p, 12.0 "
                     "for Wan 2.2)")
  if args.seed is not None and args.seed < -1:
    raise UsageError(f"--seed {args.seed} must be >= 0, or -1 for a random seed")
  text_tokens = args.max_sequence_length
  if text_tokens is None:
    text_tokens = default_text_length(args.model)
  elif text_tokens < 1:
    raise UsageError(f"--max-sequence-length {text_tokens} must be >= 1 (Wan: 512)")
  try:
    video_io.check_fps(args.fps)
  except video_io.OutputError as e:
    raise UsageError(f"--fps: {e}") from e
  from pipelines.wan.step_cache import parse_step_cache  # light: no compute
  try:
    step_cache = parse_step_cache(args.step_cache, model="tiny" if tiny else os.path.abspath(args.model))
  except ValueError as e:
    raise UsageError(f"--step-cache: {e}") from e
  if args.coordinator_timeout < 1:
    raise UsageError(f"--coordinator-timeout {args.coordinator_timeout} must be >= 1 (seconds)")
  if args.checkpoint_every < 1:
    raise UsageError(f"--checkpoint-every {args.checkpoint_every} must be >= 1 (steps)")
  if args.checkpoint_dir is not None and args.no_checkpoint:
    raise UsageError("--checkpoint-dir and --no-checkpoint contradict each other; drop one")
  if args.checkpoint_dir is not None:
    check_checkpoint_dir(args.checkpoint_dir)
  if args.heartbeat_timeout < 2:
    raise UsageError(f"--heartbeat-timeout {args.heartbeat_timeout} must be >= 2 (seconds)")
  mesh = None
  if args.mesh.strip().lower() == "auto" and args.shard_weights:
    raise UsageError("--mesh auto picks whether to shard the weights itself; drop --shard-weights (or give "
                     "an explicit mesh, e.g. --mesh U=2,R=2 --shard-weights)")
  if args.mesh.strip().lower() != "auto":
    try:
      mesh = MeshSpec.parse(args.mesh, shard_weights=args.shard_weights)
    except ValueError as e:
      raise UsageError(f"--mesh: {e}") from e
    if args.shard_weights and mesh.devices == 1:
      raise UsageError(f"--shard-weights splits the weights over the mesh's devices, but --mesh {mesh} has "
                       "one; pass a mesh of several devices (e.g. --mesh U=2,R=2) or drop --shard-weights")
    if mesh.cfg > 1 and not guidance[0] > 1:
      raise UsageError(f"--mesh {mesh} splits classifier-free guidance, but --guidance {guidance[0]:g} turns it "
                       f"off; use --mesh {dataclasses.replace(mesh, cfg=1, shard_weights=False)} or a "
                       "guidance > 1")
  if args.devices is not None:
    if args.devices < 1:
      raise UsageError(f"--devices {args.devices} must be >= 1")
    if mesh is not None and args.devices != mesh.devices:
      raise UsageError(f"--devices {args.devices} does not match --mesh {mesh} ({mesh.devices} devices); pass "
                       f"--devices {mesh.devices} or a mesh of {args.devices} devices")
  try:
    processes = distributed.process_spec(args.coordinator, args.num_processes, args.process_id,
                                         timeout_s=args.coordinator_timeout,
                                         heartbeat_timeout_s=args.heartbeat_timeout)
  except ValueError as e:
    raise UsageError(str(e)) from e
  if processes is not None and mesh is not None and mesh.devices % processes.num_processes:
    raise UsageError(f"--mesh {mesh} ({mesh.devices} devices) must split evenly over --num-processes "
                     f"{processes.num_processes}; e.g. U=<devices per process>,R={processes.num_processes}")
  loras = tuple((*parse_lora_arg(text, flag), expert)
                for flag, texts, expert in (("--lora", args.lora, 0), ("--lora-2", args.lora_2, 1))
                for text in texts)
  if processes is None or processes.process_id == 0:  # only process 0 writes
    video_io.check_output(args.out, overwrite=args.overwrite)
    sheet = video_io.contact_sheet_path(args.out) if args.contact_sheet else None
    if sheet is not None and os.path.lexists(sheet) and not args.overwrite:
      raise video_io.OutputError(f"{sheet!r} exists; pass --overwrite to replace it, or choose another --out")
    if video_io.output_kind(args.out) == "gif":
      video_io.gif_delay_cs(args.fps)  # its warning said now (main prints it), not after the run
  return Plan(prompt=args.prompt, negative_prompt=args.negative_prompt, model=args.model,
              preset=preset_name, width=width, height=height, frames=frames, steps=steps,
              guidance=guidance, shift=shift, seed=None if args.seed == -1 else args.seed,
              mesh=mesh, devices=args.devices, dtype=args.dtype or ("float32" if tiny else "bfloat16"),
              max_sequence_length=text_tokens, out=args.out, fps=args.fps,
              overwrite=args.overwrite, nan_guard=args.nan_guard, loras=loras, processes=processes,
              compile_cache=compile_cache.resolve_dir(args.compile_cache, args.no_compile_cache),
              checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
              checkpoint_default=not args.no_checkpoint, keep_checkpoint=args.keep_checkpoint,
              resume=args.resume is not None, step_cache=step_cache,
              attention_backend=args.attention_backend, vae_parallel=args.vae_parallel,
              contact_sheet=args.contact_sheet)


RUN_RECORD = "generate.json"  # in a checkpoint folder: the request, for --resume
# Flags that decide the video: with --resume each is read from the record, and one given must match.
_RECORDED = ("prompt", "negative_prompt", "model", "preset", "size", "frames", "steps", "guidance", "shift",
             "seed", "dtype", "max_sequence_length", "lora", "lora_2", "step_cache")
# Flags read from the record when not given, free to differ (where and how the video is written).
_RECORDED_FREE = ("out", "fps")


def check_checkpoint_dir(directory: str) -> None:
  """A folder the checkpoint can go to: an existing folder, or a new one whose parent is a
  writable folder.

  Raises:
    UsageError: a file of that name, or a parent that is missing, not a folder or not writable.
  """
  if os.path.exists(directory):
    if not os.path.isdir(directory):
      raise UsageError(f"--checkpoint-dir {directory!r} is a file; give a folder (new or existing)")
    if not os.access(directory, os.W_OK | os.X_OK):
      raise UsageError(f"--checkpoint-dir {directory!r} is not writable")
    return
  parent = os.path.dirname(os.path.abspath(directory))
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
    raise UsageError(f"--checkpoint-dir {directory!r}: its parent {parent!r} is not a writable folder")


def given_flags(argv: list[str]) -> set[str]:
  """The destinations of the flags present in `argv` (not their defaults)."""
  parser = build_parser()
  for action in parser._actions:
    action.default = argparse.SUPPRESS
  return set(vars(parser.parse_args(argv)))


def _normalized(name: str, value: Any) -> Any:
  """A flag's value in the record's form (so "832*480" equals "832x480", "5" equals 5.0)."""
  if value is None:
    return None
  if name == "size":
    return "x".join(map(str, parse_size(value))) if isinstance(value, str) else value
  if name == "guidance":
    return list(parse_guidance(value)) if isinstance(value, str) else list(value)
  if name == "model":
    return value if value in TINY_MODELS else os.path.abspath(value)
  if name in ("shift", "fps"):
    return float(value)
  if name == "step_cache":
    from pipelines.wan.step_cache import parse_step_cache
    return parse_step_cache(value, model="tiny").describe() if isinstance(value, str) else value
  if name in ("lora", "lora_2"):
    return [f"{os.path.abspath(path)}:{scale!r}" for path, scale in
            (parse_lora_arg(text, "--" + name.replace("_", "-")) for text in value)]
  return value


def apply_resume(args: argparse.Namespace, given: set[str]) -> None:
  """`--resume DIR`: fills the flags not given from DIR's record; checks the given ones against it.

  Raises:
    UsageError: DIR holds no run record, or a given flag differs from it (naming each).
  """
  if args.resume is None:
    return
  from pipelines.pipeline import resume as resume_state

  path = os.path.join(args.resume, RUN_RECORD)
  if not os.path.isfile(path) or not os.path.isfile(resume_state.state_path(args.resume)):
    raise UsageError(f"--resume {args.resume!r} is not a saved run: it needs {RUN_RECORD} and "
                     f"{resume_state.STATE_FILE} (written by generate --checkpoint-dir, or for a long run "
                     "beside the output as OUT.resume)")
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    raise UsageError(f"--resume: {path} is unreadable ({e})") from e
  if "checkpoint_dir" in given and os.path.abspath(args.checkpoint_dir) != os.path.abspath(args.resume):
    raise UsageError("--resume DIR continues the checkpoint in DIR; drop --checkpoint-dir (or give the same folder)")
  if args.no_checkpoint:
    raise UsageError("--resume continues a checkpointed run; drop --no-checkpoint")
  differences = []
  for name in _RECORDED:
    if name in given and _normalized(name, getattr(args, name)) != record.get(name):
      differences.append(f"--{name.replace('_', '-')}: saved {record.get(name)!r}, given "
                         f"{_normalized(name, getattr(args, name))!r}")
  if differences:
    raise UsageError(f"--resume {args.resume}: these flags differ from the saved run (leave them out to "
                     "use the saved values): " + "; ".join(differences))
  for name in _RECORDED + _RECORDED_FREE:
    if name not in given and name in record:
      value = record[name]
      if name == "guidance" and value is not None:
        value = ",".join(repr(float(g)) for g in value)
      setattr(args, name, value)
  args.checkpoint_dir = args.resume


def _write_run_record(plan: Plan, seed: int) -> None:
  """The request, as `apply_resume` reads it, in the checkpoint folder (process 0; atomic)."""
  record = {"prompt": plan.prompt, "negative_prompt": plan.negative_prompt,
            "model": _normalized("model", plan.model), "preset": plan.preset,
            "size": f"{plan.width}x{plan.height}", "frames": plan.frames, "steps": plan.steps,
            "guidance": list(plan.guidance), "shift": plan.shift, "seed": seed, "dtype": plan.dtype,
            "max_sequence_length": plan.max_sequence_length, "out": os.path.abspath(plan.out),
            "fps": plan.fps}
  for name, expert in (("lora", 0), ("lora_2", 1)):
    record[name] = [f"{os.path.abspath(path)}:{scale!r}" for path, scale, e in plan.loras if e == expert]
  record["step_cache"] = None if plan.step_cache is None else plan.step_cache.describe()
  os.makedirs(plan.checkpoint_dir, exist_ok=True)
  video_io.write_json(record, os.path.join(plan.checkpoint_dir, RUN_RECORD), overwrite=True)


def _request_cpu_devices(plan: Plan) -> int | None:
  """Asks XLA for the mesh's (or --devices) CPU devices, split over the processes of a multi-process
  run (`attention.mesh.request_cpu_devices`); returns the count asked for in this process, None if
  not needed.

  Only takes effect if the JAX backend has not started yet (hence before any compute); a count the
  user already put in XLA_FLAGS is respected.
  """
  processes = plan.processes.num_processes if plan.processes is not None else 1
  wanted = (plan.mesh_devices or 1) // processes
  flags = os.environ.get("XLA_FLAGS", "")
  match = re.search(rf"--{_DEVICE_FLAG}=(\d+)", flags)
  if match is not None:
    if plan.devices is not None and int(match.group(1)) * processes != plan.devices:
      raise UsageError(f"XLA_FLAGS already sets --{_DEVICE_FLAG}={match.group(1)} but --devices "
                       f"{plan.devices} was given; drop one of them")
    return None
  return request_cpu_devices(wanted)


def _check_devices(plan: Plan, requested: int | None, heads: int) -> str:
  """Checks the mesh against the visible devices and the model; returns a note for the summary.

  Raises:
    UsageError: --devices on an accelerator backend, a device count JAX did not honour, a mesh
      larger than the devices, heads not divisible by U.
  """
  import jax

  backend, count = jax.default_backend(), jax.device_count()
  if plan.devices is not None:
    if backend != "cpu":
      raise UsageError(f"--devices simulates CPU devices, but JAX runs on {backend} with {count} devices; "
                       "drop --devices (or set JAX_PLATFORMS=cpu to simulate on the CPU)")
    if count != plan.devices:
      raise UsageError(f"--devices {plan.devices} asked for {plan.devices} CPU devices but JAX sees {count} "
                       "(its backend started before generate could set XLA_FLAGS); run generate in a "
                       f"fresh process or set XLA_FLAGS=--{_DEVICE_FLAG}={plan.devices}")
  try:
    plan.mesh.check(num_heads=heads, device_count=count, cfg_active=plan.guidance[0] > 1)
    distributed.check_mesh_spans_processes(plan.mesh.devices)
  except ValueError as e:
    raise UsageError(str(e)) from e
  used = plan.mesh.devices
  local = jax.local_device_count()
  if backend == "cpu" and requested is not None and local == requested:
    note = f"simulating {local} CPU devices for the mesh (--{_DEVICE_FLAG}={local})"
  else:
    note = f"{local} {backend} device(s)"
  if jax.process_count() > 1:
    note += (f" in each of {jax.process_count()} processes ({count} in all; this is process "
             f"{jax.process_index()})")
  if used < count:
    note += f"; the mesh uses the first {used}"
  return note


def _model_config(plan: Plan) -> tuple[Any, int]:
  """(transformer config, number of experts) from the JSON files; a folder's weight files are
  checked too (safetensors present, headers intact), reading no tensor data."""
  from pipelines.wan.folder import PipelineIndex
  from pipelines.wan.tiny import TINY_TRANSFORMER

  if plan.model == "tiny-random":
    return TINY_TRANSFORMER, 1
  if plan.model == "tiny":
    from pipelines.wan.tiny import TINY_DEFAULT_FOLDER
    return PipelineIndex.read(TINY_DEFAULT_FOLDER).transformer, 1
  index = PipelineIndex.read(plan.model)
  index.check_weights()
  return index.transformer, 2 if index.boundary_ratio is not None else 1


def _versions() -> dict[str, str]:
  from importlib import metadata
  out = {"python": platform.python_version()}
  for name in ("wan-usp-jax", "jax", "jaxlib", "flax", "numpy", "imageio-ffmpeg", "transformers"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = "not installed"
  return out


def _fmt(seconds: float) -> str:
  return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


@dataclasses.dataclass(frozen=True)
class Checked:
  """A plan that passed the checks needing JAX (devices, model config)."""
  plan: Plan
  device_note: str
  transformer: Any = None  # its WanTransformerConfig
  mesh_auto: bool = False  # the mesh is the planner's pick (--mesh auto)


def check_plan(plan: Plan) -> Checked:
  """The checks that need JAX's device list or the model's JSON files (still no weights, no compute).

  A multi-process run joins JAX's distributed runtime here, after the model checks and before
  JAX's backend starts.

  Raises:
    UsageError: see `_check_devices`, and two guidance scales (or --lora-2) for a one-expert model.
    weights.CheckpointError: a folder that is not a Wan pipeline, or a bad weight file.
    ValueError: a LoRA that does not fit the transformer (`pipelines.wan.lora.parse_lora`).
    distributed.DistributedError: the coordinator was not reached in time.
  """
  requested = _request_cpu_devices(plan)
  transformer, experts = _model_config(plan)
  if plan.processes is not None:
    if plan.mesh is not None:  # the heads first: no need to wait for the other processes to learn that
      try:
        plan.mesh.check(num_heads=transformer.num_attention_heads, device_count=plan.mesh.devices)
      except ValueError as e:
        raise UsageError(str(e)) from e
    print(f"generate: process {plan.processes.process_id} of {plan.processes.num_processes}: joining "
          f"{plan.processes.coordinator} (waiting up to {plan.processes.timeout_s} s)", file=sys.stderr)
    distributed.initialize(plan.processes)
  if plan.processes is not None:  # the same command on every process (only the id differs)
    try:
      distributed.check_same_settings({k: v for k, v in dataclasses.asdict(plan).items()
                                       if k not in ("processes", "compile_cache")})  # (per-host paths)
    except ValueError as e:
      raise UsageError(str(e)) from e
  mesh_auto = plan.mesh is None
  if mesh_auto:
    plan = dataclasses.replace(plan, mesh=_auto_mesh(plan, transformer, experts))
  device_note = _check_devices(plan, requested, transformer.num_attention_heads)
  if len(plan.guidance) == 2 and experts == 1:
    raise UsageError(f"two guidance scales {plan.guidance} need a two-expert Wan 2.2 model but "
                     f"{plan.model!r} has one transformer; pass one --guidance value or another --preset")
  from pipelines.wan import lora

  for path, _, expert in plan.loras:
    if expert >= experts:
      raise UsageError(f"--lora-2 {path!r} needs a two-expert Wan 2.2 model but {plan.model!r} has one "
                       "transformer; use --lora")
    lora.parse_lora(*lora.read_lora(path)[:2], transformer, where=path)  # keys and shapes, no compute
  return Checked(_plan_checkpoint(plan, transformer), device_note, transformer, mesh_auto)


def _auto_mesh(plan: Plan, transformer: Any, experts: int) -> MeshSpec:
  """--mesh auto: the planner's pick (`pipelines.parallel.planner`) for the visible devices, printed.

  The chip is read from JAX's device kind (TPU v5e / v6e, NVIDIA H100 / H200); on other devices
  (the CPU) the memory is not modelled and the pick is by the modelled step time alone.

  Raises:
    UsageError: no mesh of the visible devices fits the model.
  """
  import jax

  from pipelines.parallel import planner
  from pipelines.wan.transformer_config import param_counts

  kind = jax.devices()[0].device_kind.lower()
  chip = next((planner.CHIPS[name] for name, words in (("v6e", ("v6",)), ("v5e", ("v5 lite", "v5e")),
                                                       ("h200", ("h200",)), ("h100", ("h100",)))
               if any(w in kind for w in words)), None)
  modelled = chip or planner.Chip(kind or "device", float("inf"), 1e12, 1e10, "not modelled")
  found = planner.candidates(transformer, param_counts=param_counts(transformer), devices=jax.device_count(),
                             frames=plan.frames, height=plan.height, width=plan.width,
                             text_tokens=plan.max_sequence_length, cfg=plan.guidance[0] > 1, dtype=plan.dtype,
                             experts=experts, chip=modelled)
  best = planner.recommend(found)
  if best is None:
    raise UsageError(f"--mesh auto: no mesh of the {jax.device_count()} visible {kind} devices fits this model "
                     "and video (python -m end_to_end.plan shows the candidates); use more devices or a "
                     "smaller --size / --frames")
  if plan.writes:
    print(f"generate: --mesh auto: {best.mesh}{' with --shard-weights' if best.mesh.shard_weights else ''} "
          f"for {jax.device_count()} {kind} device(s) (planner: modelled {best.step_s_model:.3g} s/step"
          + (f", {best.bytes_per_device / planner.GiB:.1f} GiB per device on {chip.name})" if chip else
             "; memory not modelled on this device kind)"), file=sys.stderr)
  return best.mesh


def _estimate(plan: Plan, transformer: Any) -> estimate.Estimate:
  import jax
  return estimate.estimate(
      transformer, frames=plan.frames, height=plan.height, width=plan.width,
      text_tokens=plan.max_sequence_length, steps=plan.steps, cfg=plan.guidance[0] > 1,
      dtype=plan.dtype, backend=jax.default_backend(), devices=plan.mesh.devices)


def default_checkpoint_dir(out: str) -> str:
  """Where a long run keeps its denoising checkpoint: OUT.resume beside the output."""
  return os.path.normpath(out) + ".resume"


def _plan_checkpoint(plan: Plan, transformer: Any) -> Plan:
  """Decides the checkpoint folder (given, or by default for a long run) and refuses one that
  already holds a saved run unless resuming it.

  Raises:
    UsageError: the folder holds a saved run and this is not --resume.
  """
  from pipelines.pipeline import resume as resume_state

  directory = plan.checkpoint_dir
  if directory is None and plan.checkpoint_default and _estimate(plan, transformer).seconds >= estimate.LONG_S:
    directory = default_checkpoint_dir(plan.out)
  if directory is not None and not plan.resume and os.path.exists(resume_state.state_path(directory)):
    raise UsageError(f"{directory} holds a saved denoising run; continue it with --resume {directory}, "
                     "or remove that folder to start over")
  return dataclasses.replace(plan, checkpoint_dir=directory)


def _announce(plan: Plan, checked: Checked, seed: int | None) -> None:
  """Before compute (process 0 only): the drawn seed, and the estimate of a long run."""
  if not plan.writes:
    return
  if plan.seed is None:
    print(f"generate: random seed {seed} (pass --seed {seed} to make this video again)", file=sys.stderr)
  line = estimate.long_run_line(_estimate(plan, checked.transformer))
  if line is not None:
    print(f"generate: {line}", file=sys.stderr)
  if plan.checkpoint_dir is not None:
    every = "every step" if plan.checkpoint_every == 1 else f"every {plan.checkpoint_every} steps"
    print(f"generate: {'continuing the run saved in' if plan.resume else 'saving the denoising state to'} "
          f"{plan.checkpoint_dir} ({every}; an interrupted run continues with --resume "
          f"{plan.checkpoint_dir})", file=sys.stderr)


def _step_cache_note(record: dict[str, Any] | None) -> str:
  """"; step cache SPEC skipped N/S steps" for the summary line, or "" when caching was off."""
  if not record:
    return ""
  return (f"; step cache {record['spec']} skipped {len(record['skipped_steps'])}/{len(record['metrics'])} "
          "steps")


def run(checked: Checked, warnings_seen: list[str] | None = None) -> dict[str, Any]:
  """Loads the model, generates, writes the video and its sidecar; returns the sidecar dict.

  `warnings_seen` (filled while running, see `main`) goes into the sidecar as "warnings".
  """
  supervisor.write_status(out=checked.plan.out)  # named in a lost-peer message
  cache = compile_cache.enable(checked.plan.compile_cache)  # before the first compile
  try:
    return _run(checked, cache, warnings_seen if warnings_seen is not None else [])
  finally:
    cache.close()


def _run(checked: Checked, cache: compile_cache.CacheUse, warnings_seen: list[str]) -> dict[str, Any]:
  import jax
  import numpy as np

  from pipelines.pipeline import WanPipeline

  plan = checked.plan
  seed = plan.seed
  if seed is None:  # --seed -1 or none: drawn here, so that it is printed before any compute
    seed = int(np.random.SeedSequence().entropy % 2 ** 31)
    if jax.process_count() > 1:  # one random seed for all: process 0's
      from jax.experimental import multihost_utils
      seed = int(multihost_utils.broadcast_one_to_all(np.int32(seed)))
  _announce(plan, checked, seed)
  if plan.checkpoint_dir is not None:
    supervisor.write_status(checkpoint_dir=plan.checkpoint_dir)
    if plan.writes and not plan.resume:
      _write_run_record(plan, seed)
  mesh = None
  if plan.mesh.devices > 1:
    mesh = plan.mesh.build(jax.devices())
  start = time.perf_counter()
  pipe = (WanPipeline.tiny(plan.dtype, random=plan.model == "tiny-random") if plan.model in TINY_MODELS
          # weights straight onto the mesh:
          else WanPipeline.from_pretrained(plan.model, dtype=plan.dtype, mesh=mesh,
                                           shard_weights=plan.mesh.shard_weights and mesh is not None))
  for path, scale, expert in plan.loras:
    pipe.load_lora_weights(path, scale=scale, load_into_transformer_2=expert == 1)
  load_s = time.perf_counter() - start
  mesh_text = str(plan.mesh) + (", weights sharded" if plan.mesh.shard_weights else "")
  print(f"generate: model {pipe.name} ({plan.dtype}), mesh {mesh_text}: {checked.device_note}",
        file=sys.stderr)

  result = pipe.run(plan.prompt, plan.negative_prompt, height=plan.height, width=plan.width,
                    num_frames=plan.frames, num_inference_steps=plan.steps,
                    guidance_scale=plan.guidance[0],
                    guidance_scale_2=plan.guidance[1] if len(plan.guidance) == 2 else None,
                    flow_shift=plan.shift, seed=seed, max_sequence_length=plan.max_sequence_length,
                    mesh=mesh, progress=plan.writes, nan_guard=plan.nan_guard, decode=plan.writes,
                    checkpoint_dir=plan.checkpoint_dir, checkpoint_every=plan.checkpoint_every,
                    resume=plan.resume, keep_checkpoint=True,  # removed below, once the video is written
                    step_cache=plan.step_cache, shard_weights=plan.mesh.shard_weights,
                    attention_backend=plan.attention_backend, vae_parallel=plan.vae_parallel)
  if not plan.writes:
    print(f"generate: process {jax.process_index()} done; process 0 writes {plan.out}", file=sys.stderr)
    return {}
  start = time.perf_counter()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", video_io.FrameRateWarning)  # printed by plan_run, before compute
    out = video_io.write_video(result.frames[0], plan.out, fps=plan.fps, overwrite=plan.overwrite)
  sheet = None
  if plan.contact_sheet:
    sheet = video_io.write_contact_sheet([result.frames[0]], video_io.contact_sheet_path(out),
                                         overwrite=plan.overwrite)
  timings = {"load": load_s, **result.timings, "write": time.perf_counter() - start}
  # "total" here is the whole command (load + pipeline + write), as the summary line prints it;
  # the pipeline's own total (text encode to decode) stays as "pipeline".
  timings["pipeline"] = timings.pop("total")
  timings["total"] = timings["load"] + timings["pipeline"] + timings["write"]
  frames, height, width = result.frames.shape[1:4]
  sidecar = {
      "output": os.path.abspath(out), "prompt": plan.prompt, "negative_prompt": plan.negative_prompt,
      "seed": result.settings["seed"], "seed_drawn": plan.seed is None, "model": pipe.name,
      "preset": plan.preset,
      "mesh": {**plan.mesh.describe(), "auto": checked.mesh_auto, "devices": checked.device_note,
               "processes": jax.process_count()},
      "video": {"frames": int(frames), "height": int(height), "width": int(width), "fps": plan.fps},
      "contact_sheet": None if sheet is None else os.path.abspath(sheet),
      "settings": result.settings, "lora": pipe.lora_info(), "timings_s": timings,
      "compile_cache": cache.report(),
      "checkpoint": None if plan.checkpoint_dir is None else {
          "dir": os.path.abspath(plan.checkpoint_dir), "every": plan.checkpoint_every,
          "resumed_from_step": result.settings.get("resumed_from_step"), "kept": plan.keep_checkpoint},
      "warnings": list(warnings_seen), "versions": _versions(),
      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  described = video_io.write_json(sidecar, video_io.sidecar_path(plan.out), overwrite=plan.overwrite)
  if plan.checkpoint_dir is not None and not plan.keep_checkpoint:
    _remove_checkpoint(plan.checkpoint_dir)
  print(f"generate: wrote {out} and {described} ({frames} frames {width}x{height} @ {plan.fps:g} fps, "
        f"seed {result.settings['seed']}, mesh {mesh_text}) | load {_fmt(load_s)}, text encode "
        f"{_fmt(timings['text_encode'])}, compile {_fmt(timings['compile'])}, denoise "
        f"{_fmt(timings['denoise_per_step'])}/step x {result.settings.get('steps_run', plan.steps)}, "
        f"decode {_fmt(timings['decode'])}, "
        f"total {_fmt(timings['total'])} (decode includes the VAE's first compile); {cache.summary()}"
        f"{_step_cache_note(result.settings.get('step_cache'))}")
  if sheet is not None:
    print(f"generate: wrote the contact sheet {sheet}")
  return sidecar


def _remove_checkpoint(directory: str) -> None:
  """The saved run in `directory` (state and record), and the folder if that empties it."""
  from pipelines.pipeline import resume as resume_state

  record = os.path.join(directory, RUN_RECORD)
  if os.path.exists(record):
    os.remove(record)
  resume_state.remove(directory)


def _tidy_checkpoint(plan: Plan | None) -> None:
  """A run stopped before its first checkpoint: its folder holds only the run record; removed, so
  no folder that cannot be resumed is left behind (process 0 only)."""
  from pipelines.pipeline import resume as resume_state

  if (plan is None or plan.checkpoint_dir is None or plan.resume or not plan.writes
      or os.path.exists(resume_state.state_path(plan.checkpoint_dir))):
    return
  _remove_checkpoint(plan.checkpoint_dir)


def _resume_hint(plan: Plan | None) -> str:
  """"; the denoising state is saved: continue with ..." when a checkpoint is on disk."""
  from pipelines.pipeline import resume as resume_state

  if plan is None or plan.checkpoint_dir is None or not os.path.exists(resume_state.state_path(plan.checkpoint_dir)):
    return ""
  return f"; the denoising state is saved: continue with generate --resume {plan.checkpoint_dir}"


def main(argv: list[str] | None = None) -> int:
  """Console entry point; returns the exit status (module docstring: 0, 1, 2 or 130).

  Python warnings print as `generate: warning: ...` lines (no file paths) and go into the sidecar.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  supervised = _supervise(args, argv)
  if supervised is not None:
    return supervised
  with warnings_as_lines("generate") as seen:
    return _main(args, seen, given_flags(argv))


def _supervise(args: argparse.Namespace, argv: list[str]) -> int | None:
  """A multi-process run (and not already the supervised child): runs this command as a child
  under `pipelines.parallel.supervisor` and returns its exit status; None otherwise (run here)."""
  if os.environ.get(supervisor.ENV_SUPERVISED):
    return None
  try:
    spec = distributed.process_spec(args.coordinator, args.num_processes, args.process_id,
                                    timeout_s=max(args.coordinator_timeout, 1),
                                    heartbeat_timeout_s=max(args.heartbeat_timeout, 2))
  except ValueError:
    return None  # reported by the checks, here
  if spec is None:
    return None
  return supervisor.run_supervised(argv, process_id=spec.process_id, num_processes=spec.num_processes,
                                   heartbeat_timeout_s=spec.heartbeat_timeout_s, log_path=args.runtime_log)


def _main(args: argparse.Namespace, warnings_seen: list[str], given: set[str]) -> int:
  leave_at_once = False  # an interrupted multi-process run skips the shutdown barrier (its peers may be gone)
  try:
    try:
      apply_resume(args, given)
      checked = check_plan(plan_run(args))
    except ValueError as e:  # UsageError, OutputError, CheckpointError, the pipeline's checks
      print(f"generate: error: {e}", file=sys.stderr)
      return 2
    except distributed.DistributedError as e:
      print(f"generate: error: {e}", file=sys.stderr)
      return 1
    from pipelines.pipeline import NonFiniteLatentsError  # JAX has started by now

    from pipelines.pipeline.resume import ResumeError

    hint = lambda: _resume_hint(checked.plan)  # noqa: E731 (read when the error happens)
    try:
      run(checked, warnings_seen)
    except ResumeError as e:  # a checkpoint of another run, unreadable, or in the way: no resume hint
      print(f"generate: error: {e}", file=sys.stderr)
      return 2
    except (video_io.OutputError, weights.CheckpointError) as e:
      # loading; or the output appeared meanwhile
      print(f"generate: error: {e}{hint()}", file=sys.stderr)
      return 2
    except (NonFiniteLatentsError, video_io.EncodeError) as e:
      print(f"generate: error: {e}{hint()}", file=sys.stderr)
      return 1
    except Exception as e:
      if checked.plan.processes is None or type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
        raise
      # A collective failed (gloo: "Connection reset by peer" when a peer dies). Give the
      # coordination service time to name the lost process (it stops this one; the supervisor
      # reports it), else report the failure as is.
      supervisor.wait_for_runtime_verdict(checked.plan.processes.heartbeat_timeout_s)
      print(f"generate: error: a collective operation across processes failed: {e}{hint()}", file=sys.stderr)
      return 1
    except KeyboardInterrupt:
      # Outputs are written to a temporary name and renamed into place; an interrupt before the
      # rename removes the temporary file, so nothing is left under --out.
      _tidy_checkpoint(checked.plan)
      print(f"generate: interrupted; nothing written to {args.out}{hint()}", file=sys.stderr)
      leave_at_once = checked.plan.processes is not None
      return 130
    return 0
  finally:
    if not leave_at_once:
      distributed.shutdown()


def cli() -> None:
  """Console-script entry (`generate`, `python -m pipelines.cli.generate`): `main`, then exit.

  SIGTERM is handled as Ctrl-C. After Ctrl-C the process leaves through `os._exit(130)` once its
  streams are flushed: XLA's
  worker threads may still be running, and interpreter teardown under them crashed with SIGSEGV
  in 2 of 10 interrupts during compile. An interrupt before `main` catches it (while modules
  import) also exits 130 with one line instead of a traceback.
  """
  def terminate(signum, frame):  # SIGTERM stops a run as Ctrl-C does (checkpoint kept, exit 130)
    raise KeyboardInterrupt

  signal.signal(signal.SIGTERM, terminate)
  try:
    code = main()
  except KeyboardInterrupt:
    print("generate: interrupted; nothing written", file=sys.stderr)
    code = 130
  if code == 130:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
  sys.exit(code)


if __name__ == "__main__":
  cli()
