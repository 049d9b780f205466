"""The command line of `generate`: its flags (`build_parser`, in argument groups), the parsers of
flag values (`parse_size`, `parse_guidance`, `parse_numbers`; `parse_lora_arg` and `UsageError` are
both commands', `pipelines.commands.flags`), and the request's messages in the flags' words
(`flag_error`, `in_flags`). Imports no JAX; the values themselves are checked by
`pipelines.pipeline.checked.request.GenerationRequest` (run_plan.py).
"""

from __future__ import annotations

import argparse
import re

from pipelines.cli.streaming import add_stream_flags
from pipelines.commands.flags import UsageError, add_decode_effort_flag
from pipelines.commands.help import HelpFormatter
from pipelines.commands.model_files import add_single_file_flags
from pipelines.commands.presets import FOLDER_DEFAULTS, PRESETS, TINY_DEFAULTS
from pipelines.commands import compile_cache
from pipelines.parallel import distributed, estimate
from pipelines.storage import video_io


# The --help groups whose flags decide the video: `--resume` reads each of their flags from the run
# record, and one given must match it (`records.apply_resume`).
RECORDED_GROUPS = ("prompt and media", "model", "a model as single files (instead of --model)", "sampling",
                   "conditioning", "long video")
# `GenerationRequest.build` arguments that one flag gives together, by the flag's dest; every other
# request flag's dest is the argument's name.
SHARED_FLAGS = {"height": "size", "width": "size", "guidance_scale_2": "guidance_scale"}


def flag_of(parser: argparse.ArgumentParser, name: str) -> str | None:
  """The flag that gives the dest or request argument `name` ("num_inference_steps" -> "--steps",
  "height" -> "--size"), read from `parser`; None when no flag does."""
  dest = SHARED_FLAGS.get(name, name)
  return next((a.option_strings[0] for a in parser._actions if a.dest == dest and a.option_strings), None)


def flag_error(error: ValueError) -> UsageError:
  """A request's (or the mesh rules') ValueError as a UsageError prefixed with the flag it is about:
  "num_inference_steps=0 must be ..." -> "--steps: num_inference_steps=0 must be ..."; a mesh rule
  ("mesh ...", "the model has 8 heads ...") -> "--mesh: ..."; any other message unchanged."""
  text = str(error)
  name = re.match(r"(\w+)=", text)
  flag = None if name is None else flag_of(build_parser(), name.group(1))
  if flag is not None:
    return UsageError(f"{flag}: {text}")
  if text.startswith(("mesh ", "the model")):
    return UsageError(f"--mesh: {text}")
  return UsageError(text)


# An argument named in a message: `name=value` (a value up to a space, comma, semicolon or closing
# parenthesis; a quoted one whole), or a bare name with an underscore (`context_frames`).
_ARGUMENT = re.compile(r"\b([a-z]\w*)=('[^']*'|[^\s,;)]+)|\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b(?![/=])")


def in_flags(text: str) -> str:
  """`text` with each argument it names written as the flag that gives it: "context_frames=17" ->
  "--context-frames 17", "context_fuse='flat'" -> "--context-fuse flat", "overwrite=True" ->
  "--overwrite", a bare "max_sequence_length" -> "--max-sequence-length". A name no flag gives
  alone ("height": --size), a bare word without an underscore and an on/off value the flag does not
  set are left as written. The pipeline and storage speak of Python arguments; the command prints
  their warnings and output errors in its own words with this."""
  actions = {a.dest: a for a in build_parser()._actions if a.option_strings}

  def flag(match: re.Match) -> str:
    name, value, bare = match.groups()
    action = actions.get(name or bare)
    if action is None or bare:
      return match.group(0) if action is None else action.option_strings[0]
    if action.nargs != 0:
      return f"{action.option_strings[0]} {value.strip(chr(39))}"
    if isinstance(action, argparse.BooleanOptionalAction) and value in ("True", "False"):
      return action.option_strings[value == "False"]
    return action.option_strings[0] if value == str(action.const) else match.group(0)
  return _ARGUMENT.sub(flag, text)


def build_parser(description: str | None = None, epilog: str | None = None) -> argparse.ArgumentParser:
  """Every flag of `generate`, in --help groups by stage (at most 12 flags each); `description`
  heads --help, `epilog` follows the flags. A flag that gives a `GenerationRequest.build` argument
  has that argument's name as its dest (`SHARED_FLAGS`: the two that give two)."""
  p = argparse.ArgumentParser(prog="generate", description=description, epilog=epilog,
                              formatter_class=HelpFormatter)
  _add_prompt_flags(p.add_argument_group("prompt and media"))
  _add_model_flags(p.add_argument_group("model"))
  add_single_file_flags(p)
  _add_sampling_flags(p.add_argument_group("sampling"))
  _add_conditioning_flags(p.add_argument_group("conditioning"))
  _add_window_flags(p.add_argument_group("long video"))
  add_stream_flags(p.add_argument_group("streaming (a causal checkpoint, chunk by chunk)"))
  _add_device_flags(p.add_argument_group("where it runs"))
  _add_output_flags(p.add_argument_group("outputs"))
  _add_checkpoint_flags(p.add_argument_group("resumable denoising"))
  _add_process_flags(p.add_argument_group("multi-process (multi-host) runs on JAX's distributed runtime"))
  return p


def _add_prompt_flags(g: argparse._ArgumentGroup) -> None:
  """What the video shows: the prompts and the user's own media."""
  g.add_argument("--prompt", default=None, help="what the video shows (required, except with --resume)")
  g.add_argument("--negative-prompt", default=None,
                 help="what to avoid (classifier-free guidance); default: the --preset's (Wan's default "
                      "negative prompt for the wan2.* presets, as Wan's scripts), else ''")
  g.add_argument("--image", default=None, metavar="PATH",
                 help="the first frame (image-to-video models: Wan 2.1 I2V / FLF2V, Wan 2.2 I2V A14B, "
                      "Wan 2.2 TI2V-5B, --model tiny-i2v); without --size the video takes its aspect ratio within "
                      "the preset's area (default: none, text-to-video)")
  g.add_argument("--last-image", default=None, metavar="PATH",
                 help="the last frame (first-last-frame: FLF2V folders, Wan 2.2 I2V A14B; default: none)")
  g.add_argument("--video", default=None, metavar="PATH",
                 help="video-to-video (a text-to-video model): start from this video's frames (.mp4, .mov, "
                      ".mkv, .webm, .avi, .gif, .npy or a folder of frames), resized to --size; its 4k + 1 first "
                      "frames give the length; on a VACE model, the video VACE conditions on (default: none)")
  g.add_argument("--mask", default=None, metavar="PATH",
                 help="VACE models, with --video: which pixels to generate (white) and which to keep (black); an "
                      "image for every frame, or a video of --video's length and size (default: generate all)")
  g.add_argument("--reference-image", dest="reference_images", action="append", default=[], metavar="PATH",
                 help="VACE models: an image (a subject, a style) the video should show; repeat for several "
                      "(default: none)")


def _add_model_flags(g: argparse._ArgumentGroup) -> None:
  """Which model, its published defaults, its weights' dtype and quantization, its LoRAs."""
  g.add_argument("--model", default=None,
                 help="a diffusers-format (or official) Wan folder, a Hugging Face Hub id org/name[@revision] "
                      "(downloaded once into the Hub cache), 'tiny' (embedded trained shapes-world model), "
                      "'tiny-i2v' (the same, continuing an --image first frame) or 'tiny-random' (embedded random "
                      "weights); --transformer, --vae and --text-encoder give the model as single files instead "
                      "(default: tiny)")
  g.add_argument("--preset", default=None,
                 help=f"published defaults: {', '.join(PRESETS)} (default: 'tiny' for the tiny model, "
                      "diffusers' defaults for a folder)")
  g.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="transformer/text-encoder dtype (default: float32 for tiny, bfloat16 for a folder)")
  g.add_argument("--vae-dtype", default="float32", choices=("float32", "bfloat16"),
                 help="the VAE's dtype: float32 (default, as diffusers and Wan's own code) or bfloat16 (half "
                      "the decode's memory; on a TPU one pass per product instead of fp32's several)")
  g.add_argument("--quantize", default=None, choices=("int8", "fp8", "int8-w8a8"),
                 help="the transformer's block Linear weights stored as int8 or fp8 (e4m3) with a scale per "
                      "output channel, dequantized in the matmul; int8-w8a8 also quantizes each matmul's "
                      "input per token (int8 x int8, int32 sums). Applied after the LoRAs are fused (default: "
                      "none, weights in --dtype)")
  g.add_argument("--attention-exchange", default="bf16", choices=("bf16", "fp8"),
                 help="fp8: Q, V and the attention output cross the Ulysses all-to-alls in e4m3 with per-head "
                      "scales, K in bf16 (5/8 of the bytes in, 1/2 out; a small change to the video)")
  g.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE]",
                 help="a Wan LoRA (.safetensors file, or a folder holding one; diffusers/peft, original "
                      "Wan/ComfyUI/lightx2v or kohya/musubi keys) fused into the transformer with weight "
                      "SCALE (default 1); repeatable: all are active at once, W = base + sum of "
                      "SCALE_i x delta_i (default: none)")
  g.add_argument("--lora-2", action="append", default=[], metavar="PATH[:SCALE]",
                 help="as --lora, into transformer_2, the low-noise expert of a two-expert Wan 2.2 model "
                      "(diffusers' load_into_transformer_2=True); repeatable (default: none)")


def _add_sampling_flags(g: argparse._ArgumentGroup) -> None:
  """The video's size and how it is sampled: size, frames, steps, guidance, schedule, seed, text length."""
  tiny, folder = PRESETS["tiny"], FOLDER_DEFAULTS
  g.add_argument("--size", default=None,
                 help=f"WIDTHxHEIGHT in pixels, multiples of 16, e.g. 832x480 (Wan's 832*480 also accepted; "
                      f"default: the --preset's, {tiny.width}x{tiny.height} for tiny, {folder.width}x{folder.height} "
                      "for a folder without its own generation_defaults.json; with --image, the image's aspect ratio within that area)")
  g.add_argument("--frames", dest="num_frames", type=int, default=None, metavar="FRAMES",
                 help="frames, 4k+1 (e.g. 81); other counts become frames // 4 * 4 + 1, as in diffusers "
                      f"(16 -> 17, 10 -> 9) (default: the --preset's, {tiny.frames} for tiny, {folder.frames} for a "
                      "folder without its own generation_defaults.json; with --video, its length)")
  g.add_argument("--steps", dest="num_inference_steps", type=int, default=None, metavar="STEPS",
                 help=f"denoising steps, 1 to 1000 (default: the --preset's, {tiny.steps} for tiny, {folder.steps} "
                      "for a folder without its own generation_defaults.json)")
  g.add_argument("--guidance", dest="guidance_scale", default=None, metavar="GUIDANCE",
                 help="CFG scale in [0, 100], or 'HIGH,LOW' for the two Wan 2.2 experts; <= 1 turns CFG off "
                      f"(default: the --preset's, {tiny.guidance[0]:g} for tiny, a folder's own generation_defaults.json, "
                      f"else {folder.guidance[0]:g})")
  g.add_argument("--shift", dest="flow_shift", type=float, default=None, metavar="SHIFT",
                 help="scheduler flow shift, in [0.01, 1000] (Wan: 3 at 480p, 5 at 720p; default: the --preset's, "
                      f"{tiny.shift:g} for tiny, the scheduler config's for a folder)")
  g.add_argument("--scheduler", default=None, choices=("unipc", "euler", "dpm++"),
                 help="the sampler: unipc (Wan's default), dpm++ (DPM-Solver++ multistep, Wan's "
                      "--sample_solver dpm++) or euler (flow-match Euler, as lightx2v runs distilled "
                      "models); default: the --preset's, else the model folder's")
  g.add_argument("--timesteps", default=None, metavar="T,T,...",
                 help="a custom schedule: decreasing timesteps in (0, 1000], e.g. 1000,750,500,250 "
                      "(lightx2v's denoising_step_list: sigmas t/1000, shifted by --shift); sets the steps "
                      "(default: the --preset's, else the sampler's own spacing)")
  g.add_argument("--sigmas", default=None, metavar="S,S,...",
                 help="a custom schedule as decreasing unshifted sigmas in (0, 1], e.g. 1,0.75,0.5,0.25 "
                      "(diffusers' set_timesteps(sigmas=)); sets the steps (default: none)")
  g.add_argument("--seed", type=int, default=None,
                 help="noise seed; -1 also draws one (default: random, printed and recorded in the sidecar)")
  g.add_argument("--max-sequence-length", type=int, default=None,
                 help="text tokens per prompt (default: 512 as Wan, or the shorter length the model folder's "
                      "tokenizer says it was trained with, model_max_length: 64 for tiny)")
  g.add_argument("--step-cache", default=None, metavar="SPEC",
                 help="skip transformer blocks on steps whose change is small, reusing a cached residual: "
                      "first-block:THRESH (first-block cache, e.g. first-block:0.05) or "
                      "mag:THRESH[:K][@RATIOS.json] (MagCache; ratios from `python -m "
                      "end_to_end.train.calibrate_cache`, built in for the tiny model); the skipped steps go into "
                      "the sidecar (default: off)")


def _add_conditioning_flags(g: argparse._ArgumentGroup) -> None:
  """How strongly the user's media steer the video."""
  g.add_argument("--strength", type=float, default=0.8,
                 help="with --video: the share of the steps that run, in (0, 1] (checked without --video "
                      "too); lower keeps more of the video")
  g.add_argument("--conditioning-scale", default=None, metavar="S or S,S,...",
                 help="VACE models: the VACE hints' weight, one number or one per VACE layer (default: 1)")


def _add_window_flags(g: argparse._ArgumentGroup) -> None:
  """A video longer than the model's trained clip, in context windows."""
  g.add_argument("--context-frames", type=int, default=None, metavar="L",
                 help="a video longer than the model's trained clip in overlapping context windows of L frames "
                      "(4k+1; Wan: 81, tiny: 17), blended at every step (see --context-fuse); W=2 in --mesh runs two "
                      "at once (default: none, one clip)")
  g.add_argument("--context-overlap", type=int, default=None, metavar="O",
                 help="with --context-frames: frames neighbouring windows share at least, a multiple of 4 "
                      "below L (default: a quarter of L)")
  g.add_argument("--context-fuse", choices=("pyramid", "flat", "continue"), default=None,
                 help="with --context-frames: the overlaps' blend weights at every step (pyramid, as ComfyUI; "
                      "flat), or continue: windows one after another, each given the frames it shares with the one "
                      "before (a model trained to continue; not with W) (default: the model's, from its folder's "
                      f"generation_defaults.json: {TINY_DEFAULTS.context_fuse} for tiny, pyramid for a folder "
                      "without one, and pyramid wherever continue cannot run)")


def _add_device_flags(g: argparse._ArgumentGroup) -> None:
  """Where and how it runs (the same video every way): the mesh, devices, kernels, memory, guards."""
  g.add_argument("--mesh", default="U=1,R=1",
                 help="device mesh, e.g. U=2,R=2 (also R=2,U=2, U=4): U Ulysses degree, R ring degree; "
                      "CFG=2,U=2,R=2 runs the guidance's cond and uncond halves on separate halves of the "
                      "devices; W=2,U=2,R=1 runs --context-frames windows two at once; 'auto' takes the "
                      "planner's pick for the visible devices (end_to_end.plan)")
  g.add_argument("--devices", type=int, default=None,
                 help="simulate N CPU devices (must equal the devices of --mesh) (default: as many as the "
                      "mesh needs)")
  g.add_argument("--shard-weights", action="store_true",
                 help="shard the transformer's block weights over the mesh's devices (FSDP; for models "
                      "too big to replicate on each device)")
  g.add_argument("--vae-parallel", action=argparse.BooleanOptionalAction, default=True,
                 help="decode the latents split by rows over the mesh's devices (default); "
                      "--no-vae-parallel decodes on one device")
  g.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas"),
                 help="attention kernels: auto (Pallas kernels on TPU and GPU, XLA loops on CPU), xla, or "
                      "pallas (on CPU: interpret mode, slow; for checks); the same video either way")
  g.add_argument("--placement", default="auto",
                 choices=("auto", "resident", "encoder-offloaded", "encoder-on-host"),
                 help="where the weights live during the run (pipelines/parallel/memory.py): auto picks the "
                      "fastest that fits the device's memory and prints it; resident keeps all on the device; "
                      "encoder-offloaded puts the text encoder there only for the encode; encoder-on-host runs "
                      "it on the host CPU. The transformer leaves for the decode, and the decode runs in bands "
                      "of latent rows, where the memory needs it; the same video every way")
  add_decode_effort_flag(g)
  g.add_argument("--no-nan-guard", dest="nan_guard", action="store_false",
                 help="do not stop when the latents become NaN/inf (checked after every step)")


def _add_output_flags(g: argparse._ArgumentGroup) -> None:
  """What is written: the output, its frame rate, the contact sheet, the compilation cache."""
  g.add_argument("--out", default="output.mp4",
                 help="*.mp4, *.gif, *.npy (float32 frames, unquantised), or a folder for PNG frames")
  g.add_argument("--fps", type=float, default=None,
                 help="frames per second of the output, %g to %g (default: the --preset's, else the model's: 24 "
                      "for Wan 2.2 TI2V-5B, 16 for the others; a GIF without --fps gets the nearest rate it stores "
                      "exactly, 16 -> 100/6 = 16.67; a given --fps that is not 100 / an integer warns)"
                      % video_io.FPS_RANGE)
  g.add_argument("--overwrite", action="store_true", help="replace an existing output and sidecar")
  g.add_argument("--contact-sheet", action="store_true",
                 help="also write a PNG grid of the video's frames next to it (--out + .contact.png: at most 9 "
                      "evenly spaced frames, small videos enlarged)")
  g.add_argument("--compile-cache", metavar="DIR", default=None,
                 help=f"JAX's persistent compilation cache (default: ${compile_cache.ENV}, else "
                      f"{compile_cache.default_dir()})")
  g.add_argument("--no-compile-cache", action="store_true", help="compile everything, keep nothing")


def _add_checkpoint_flags(c: argparse._ArgumentGroup) -> None:
  """Resumable denoising: --checkpoint-dir, --checkpoint-every, --resume, ..."""
  c.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                 help="save the denoising state to DIR as the run goes (default for runs estimated "
                      f"at {estimate.LONG_S:g} s or more: OUT.resume beside the output)")
  c.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                 help="save after every N-th step (and after the last) (default: %(default)s)")
  c.add_argument("--no-checkpoint", action="store_true", help="no checkpoint, even for a long run")
  c.add_argument("--keep-checkpoint", action="store_true",
                 help="keep the checkpoint after the video is written (default: removed)")
  c.add_argument("--resume", metavar="DIR", default=None,
                 help="continue the run saved in DIR; other flags may be left out (they are read from "
                      "DIR) and those given must match it, except where it runs and the output (default: none, "
                      "a new run)")


def _add_process_flags(g: argparse._ArgumentGroup) -> None:
  """Multi-process runs on JAX's distributed runtime: --coordinator, --num-processes, ..."""
  g.add_argument("--coordinator", default=None,
                 help=f"HOST:PORT of process 0 (default: ${distributed.ENV_COORDINATOR}, else one process)")
  g.add_argument("--num-processes", type=int, default=None,
                 help=f"processes in the run (default: ${distributed.ENV_NUM_PROCESSES})")
  g.add_argument("--process-id", type=int, default=None,
                 help=f"this process, 0..N-1; 0 writes the output (default: ${distributed.ENV_PROCESS_ID})")
  g.add_argument("--coordinator-timeout", type=int, default=distributed.DEFAULT_TIMEOUT_S,
                 help="seconds to wait for the coordinator and every process (default: %(default)s)")
  g.add_argument("--heartbeat-timeout", type=int, default=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
                 help="seconds without a heartbeat after which a process counts as lost and every "
                      "process stops, exit status 3 (default: %(default)s)")
  g.add_argument("--runtime-log", metavar="FILE", default=None,
                 help="where the runtime's own log lines go in a multi-process run (default: a file "
                      "in the system temporary directory, named when something goes wrong)")


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


def parse_numbers(text: str, flag: str) -> tuple[float, ...]:
  """"1000,750,500,250" -> (1000.0, 750.0, 500.0, 250.0) (values checked by the request).

  Raises:
    UsageError: an empty item or one that is not a number.
  """
  try:
    return tuple(float(v) for v in text.split(","))
  except ValueError:
    raise UsageError(f"{flag} {text!r} must be comma-separated numbers, e.g. {flag} "
                     + ("1000,750,500,250" if flag == "--timesteps" else "1,0.75,0.5,0.25")) from None
