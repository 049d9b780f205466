"""From flags to a checked request: `plan_run` (the checks that must come before JAX starts: the
output, the checkpoint folder, the process spec, the mesh flags) and `check_plan` (JAX up, the model's
JSON files read, no weights: the devices, --mesh auto, and the `GenerationRequest` that checks every
value of the video, built by the one constructor the Python call uses).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import warnings
from typing import Any

from attention.mesh_spec import DEVICE_FLAG as _DEVICE_FLAG, MeshSpec, request_cpu_devices
from pipelines.cli import records
from pipelines.cli.flags import flag_error, in_flags, parse_guidance, parse_numbers, parse_size
from pipelines.cli.plan import Plan
from pipelines.cli.streaming import check_stream_flags
from pipelines.commands.flags import UsageError, parse_lora_arg
from pipelines.commands.model_files import describe, single_files
from pipelines.commands.presets import PRESETS, TINY_MODELS, Preset, model_fps as model_fps_of, model_preset
from pipelines.parallel import distributed
from pipelines.parallel.mesh_rules import check_spec
from pipelines.commands import compile_cache
from pipelines.storage import video_io
from pipelines.storage import video_reading
from pipelines.storage import contact_sheet
from pipelines.wan.pretrained import hub_id


def plan_run(args: argparse.Namespace) -> Plan:
  """Checks every argument that must be checked before JAX starts (the prompt, the model folder, the
  mesh flags, the process spec, the checkpoint folder, the output, the media files); the video's
  values are checked by `check_plan`.

  Raises:
    UsageError / video_io.OutputError: each bad argument, with what to do instead.
  """
  _check_prompt(args)
  stream = check_stream_flags(args)
  files = single_files(args)
  model = args.model if args.model is not None or files is not None else "tiny"
  preset_name, preset = _preset(args, model)
  guidance = parse_guidance(args.guidance_scale) if args.guidance_scale is not None else preset.guidance
  mesh = _mesh_flags(args, cfg_active=max(guidance) > 1)  # any expert guiding
  _check_run_flags(args)
  processes = _process_spec(args, mesh)
  loras = tuple((*parse_lora_arg(text, flag), expert)
                for flag, texts, expert in (("--lora", args.lora, 0), ("--lora-2", args.lora_2, 1))
                for text in texts)
  if processes is None or processes.process_id == 0:  # only process 0 writes
    _check_outputs(args)
  video_frames = _check_media(args)
  return Plan(request=_asked_request(args, preset_name, preset, guidance, video_frames),
              recorded=records.recorded_flags(args), model=model, files=files, preset=preset_name, mesh=mesh,
              devices=args.devices, dtype=args.dtype or ("float32" if model in TINY_MODELS else "bfloat16"),
              out=args.out, fps=_fps(args, preset), overwrite=args.overwrite, nan_guard=args.nan_guard,
              decode_compile_effort=args.decode_compile_effort, loras=loras, processes=processes,
              compile_cache=compile_cache.resolve_dir(args.compile_cache, args.no_compile_cache),
              checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
              checkpoint_default=not args.no_checkpoint, keep_checkpoint=args.keep_checkpoint,
              resume=args.resume is not None, contact_sheet=args.contact_sheet, quantize=args.quantize,
              placement=args.placement, size_given=bool(args.size), vae_dtype=args.vae_dtype,
              defaulted=() if preset_name is not None else _defaulted(args, video_frames),
              fps_given=args.fps is not None or preset_name is not None, stream=stream)


def _defaulted(args: argparse.Namespace, video_frames: int | None) -> tuple[str, ...]:
  """The request names that no flag gives (without --preset: the model's own defaults fill them)."""
  first = lambda *values: next((v for v in values if v is not None), None)  # noqa: E731 (a 0 given is given)
  given = {"height": args.size, "width": args.size, "num_frames": first(args.num_frames, video_frames),
           "num_inference_steps": first(args.num_inference_steps, args.timesteps, args.sigmas),
           "guidance_scale": args.guidance_scale}
  return tuple(name for name, flag in given.items() if flag is None)


def _asked_request(args: argparse.Namespace, preset_name: str | None, preset: Preset, guidance: tuple[float, ...],
                   video_frames: int | None) -> dict[str, Any]:
  """`GenerationRequest.build`'s arguments as the flags ask them: each flag whose dest is an
  argument's name as given, and the flags that need parsing or fall back to the preset below.
  The mesh is the command's (`Plan.mesh`), resolved by `check_plan`."""
  width, height = parse_size(args.size) if args.size else (preset.width, preset.height)
  steps, timesteps, sigmas = _schedule_flags(args, preset)  # (flag errors before JAX's modules import)
  conditioning_scale = _conditioning_scale(args)
  from pipelines.pipeline.run.call_options import build_defaults

  names = set(build_defaults()) - {"mesh", "shard_weights"}
  return {name: value for name, value in vars(args).items() if name in names} | {
      "negative_prompt": args.negative_prompt if args.negative_prompt is not None else preset.negative_prompt,
      "height": height, "width": width,
      "num_frames": args.num_frames if args.num_frames is not None else (video_frames or preset.frames),
      "num_inference_steps": steps, "timesteps": timesteps, "sigmas": sigmas,
      "guidance_scale": guidance[0], "guidance_scale_2": guidance[1] if len(guidance) == 2 else None,
      "flow_shift": args.flow_shift if args.flow_shift is not None else (preset.shift if preset_name else None),
      "seed": None if args.seed == -1 else args.seed, "scheduler": args.scheduler or preset.scheduler,
      "reference_images": tuple(args.reference_images), "conditioning_scale": conditioning_scale}


def _check_media(args: argparse.Namespace) -> int | None:
  """The image, video and mask files readable before anything loads, and given together as they
  work; returns the frames a --video gives (None without one).

  Raises:
    UsageError: a file that is not an image / video this reads, or media that do not go together.
  """
  for flag, path in (("--image", args.image), ("--last-image", args.last_image),
                     *(("--reference-image", r) for r in args.reference_images)):
    if path is not None:
      _check_image_file(flag, path)
  if args.last_image is not None and args.image is None:
    raise UsageError("--last-image needs --image too (the first frame)")
  if args.video is not None and args.image is not None:
    raise UsageError(f"--video {args.video} and --image {args.image}: give one (video-to-video starts from a video, "
                     "image-to-video from an image)")
  if args.mask is not None and args.video is None:
    raise UsageError(f"--mask {args.mask} needs --video (the mask marks which of the video's pixels to generate)")
  if args.mask is not None:
    read_mask(args.mask)  # readable before anything loads
  return None if args.video is None else _video_length(args.video)


def _video_length(path: str) -> int:
  """The frames a --video gives (its 4k + 1 first ones), read before any weight loads.

  Raises:
    UsageError: a file that is not a video this reads (`video_reading.read_video`).
  """

  try:
    count = len(video_reading.read_video(path))
  except ValueError as e:
    raise UsageError(f"--video: {e}") from e
  return (count - 1) // 4 * 4 + 1


def _conditioning_scale(args: argparse.Namespace) -> Any:
  """--conditioning-scale as one float or a tuple of floats (1.0 when not given)."""
  if args.conditioning_scale is None:
    return 1.0
  values = parse_numbers(args.conditioning_scale, "--conditioning-scale")
  return values[0] if len(values) == 1 else tuple(values)


def read_mask(path: str | None) -> Any:
  """The --mask file: one image (numpy uint8 [H, W, 3], for every frame) or a video's frames.

  Raises:
    UsageError: a file that is neither an image pillow reads nor a video this reads.
  """
  if path is None:
    return None
  if os.path.isfile(path) and os.path.splitext(path)[1].lower() not in video_reading.VIDEO_SUFFIXES:
    _check_image_file("--mask", path)
    return read_image(path)
  try:
    return video_reading.read_video(path)
  except ValueError as e:
    raise UsageError(f"--mask: {e}") from e


def read_video(path: str | None) -> Any:
  """The --video file's frames (`video_reading.read_video`), or None."""

  return None if path is None else video_reading.read_video(path)


def read_images(paths: Any) -> Any:
  """The --reference-image files' pixels (`read_image` each), or None for none."""
  return [read_image(path) for path in paths] or None


def _check_image_file(flag: str, path: str) -> None:
  """Raises UsageError unless `path` is an image file pillow reads (its header only)."""
  import PIL.Image

  if not os.path.isfile(path):
    raise UsageError(f"{flag} {path!r} is not a file; give an image file (PNG, JPEG, ...)")
  try:
    with PIL.Image.open(path) as image:
      image.verify()
  except Exception as e:  # noqa: BLE001 (pillow raises many kinds)
    raise UsageError(f"{flag} {path!r} is not an image pillow can read ({e})") from e


def read_image(path: str | None) -> Any:
  """The image file as displayed, numpy uint8 [H, W, 3] (RGB; `storage.images`), or None."""
  from pipelines.storage import images

  return None if path is None else images.read_image(path).pixels


# The request arguments a command gives as file paths, and how each is read.
MEDIA_READERS = {"image": read_image, "last_image": read_image, "video": read_video, "mask": read_mask,
                 "reference_images": read_images}


def model_defaults(plan: Plan, facts: Any) -> Plan:
  """Without --preset, what no flag gave from the model's own defaults (`ModelFacts.fill`, as the
  Python call takes them: its folder's generation_defaults.json, read here once a Hub model is
  downloaded; for a local folder the same values `presets.model_preset` gave before)."""
  if not plan.defaulted:
    return plan
  names = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale", "guidance_scale_2")
  unset = set(plan.defaulted) | ({"guidance_scale_2"} if "guidance_scale" in plan.defaulted else set())
  filled = facts.fill(*(None if n in unset else plan.asked(n) for n in names),
                      custom_schedule=plan.asked("timesteps") is not None or plan.asked("sigmas") is not None)
  return dataclasses.replace(plan, request=plan.request | dict(zip(names, filled)))


def image_sized(plan: Plan, facts: Any) -> Plan:
  """Without --size, an --image's aspect ratio within the preset's area (`presets.size_for_image`,
  rounded to the model's multiple)."""
  if plan.asked("image") is None or plan.size_given:
    return plan
  from pipelines.commands.presets import size_for_image
  from pipelines.storage import images

  w, h = images.displayed_size(plan.asked("image"))  # a phone's portrait JPEG stores its landscape pixels
  width, height = size_for_image(h, w, plan.asked("width") * plan.asked("height"),
                                 facts.spatial_factor * facts.transformer.patch_size[1])
  return dataclasses.replace(plan, request=plan.request | {"width": width, "height": height})


def model_fps(plan: Plan, facts: Any) -> Plan:
  """Without --fps or --preset, the model's own frame rate (its folder's generation_defaults.json,
  else `presets.model_fps`: TI2V-5B 24)."""
  if plan.fps_given:
    return plan
  fps = facts.defaults.fps or model_fps_of(facts.expand_timesteps)
  return dataclasses.replace(plan, fps=video_io.gif_fps(fps) if video_io.output_kind(plan.out) == "gif" else fps)


def _fps(args: argparse.Namespace, preset: Preset) -> float:
  """--fps, else the preset's; for a GIF without --fps the nearest rate a GIF stores exactly."""
  if args.fps is not None:
    return float(args.fps)
  return video_io.gif_fps(preset.fps) if video_io.output_kind(args.out) == "gif" else preset.fps


def _schedule_flags(args: argparse.Namespace, preset: Preset) -> tuple[Any, Any, Any]:
  """(steps, timesteps, sigmas): --steps / --timesteps / --sigmas as given (a custom schedule sets
  the step count: steps None unless --steps is given too), else the preset's (its custom schedule
  only when --steps is not given)."""
  timesteps = parse_numbers(args.timesteps, "--timesteps") if args.timesteps is not None else None
  sigmas = parse_numbers(args.sigmas, "--sigmas") if args.sigmas is not None else None
  if timesteps is not None or sigmas is not None:
    return args.num_inference_steps, timesteps, sigmas
  if args.num_inference_steps is not None:
    return args.num_inference_steps, None, None
  return (None, preset.timesteps, None) if preset.timesteps is not None else (preset.steps, None, None)


def _check_prompt(args: argparse.Namespace) -> None:
  """Raises UsageError for a missing or blank --prompt."""
  if args.prompt is None:
    raise UsageError("--prompt is required (what the video shows), unless --resume DIR continues a "
                     "saved run")
  if not args.prompt.strip():
    raise UsageError(f"--prompt {args.prompt!r} is empty; describe the video, e.g. --prompt "
                     "'a red fox running through snow'")


def _preset(args: argparse.Namespace, model: str | None) -> tuple[str | None, Preset]:
  """(--preset name or None, its values): 'tiny' for the tiny models; for a folder its own defaults
  (`presets.model_preset`: its generation_defaults.json, else diffusers'); diffusers' for single
  files (model None).

  Raises:
    UsageError: --model neither a tiny model nor a folder, or an unknown --preset.
  """
  tiny = model in TINY_MODELS
  if model is not None and not tiny and not os.path.isdir(model) and hub_id(model) is None:
    raise UsageError(f"--model {model!r} is not a folder; pass a diffusers-format Wan folder "
                     "(model_index.json, transformer/, ...), a Hugging Face Hub id (org/name[@revision]) "
                     "or 'tiny' for the embedded default ('tiny-random': random weights)")
  preset_name = args.preset or ("tiny" if tiny else None)
  if preset_name is not None and preset_name not in PRESETS:
    raise UsageError(f"unknown --preset {preset_name!r}; use one of {', '.join(PRESETS)}")
  if tiny and preset_name != "tiny":
    # A real model's preset on the random tiny model is almost always a mistake: it keeps the
    # tiny weights but runs at full size (minutes per step on a CPU).
    warnings.warn(f"--preset {preset_name} sets the size/steps of a real Wan checkpoint but --model is "
                  "the embedded tiny model; pass --model FOLDER for a real video",
                  stacklevel=3)
  return preset_name, PRESETS[preset_name] if preset_name else model_preset(model)


def _mesh_flags(args: argparse.Namespace, *, cfg_active: bool) -> MeshSpec | None:
  """--mesh (None: auto), checked by `pipelines.parallel.plan.check_spec` (the rules that need no
  devices), and --devices against it.

  Raises:
    UsageError: a malformed mesh, --shard-weights with auto or one device, CFG=2 without guidance,
      a --devices that is not the mesh's.
  """

  mesh = None
  if args.mesh.strip().lower() == "auto" and args.shard_weights:
    raise UsageError("--mesh auto picks whether to shard the weights itself; drop --shard-weights (or give "
                     "an explicit mesh, e.g. --mesh U=2,R=2 --shard-weights)")
  if args.mesh.strip().lower() != "auto":
    try:
      mesh = MeshSpec.parse(args.mesh, shard_weights=args.shard_weights)
    except ValueError as e:
      raise UsageError(f"--mesh: {e}") from e
    try:
      check_spec(mesh, cfg_active=cfg_active)
    except ValueError as e:
      raise flag_error(e) from e
  if args.devices is not None:
    if args.devices < 1:
      raise UsageError(f"--devices {args.devices} must be >= 1")
    if mesh is not None and args.devices != mesh.devices:
      raise UsageError(f"--devices {args.devices} does not match --mesh {mesh} ({mesh.devices} devices); pass "
                       f"--devices {mesh.devices} or a mesh of {args.devices} devices")
  return mesh


def _check_run_flags(args: argparse.Namespace) -> None:
  """The timeouts and the checkpoint flags (`records.check_checkpoint_dir`).

  Raises:
    UsageError: a timeout or --checkpoint-every out of range, contradicting checkpoint flags, a
      checkpoint folder that cannot be written.
  """
  if args.coordinator_timeout < 1:
    raise UsageError(f"--coordinator-timeout {args.coordinator_timeout} must be >= 1 (seconds)")
  if args.checkpoint_every < 1:
    raise UsageError(f"--checkpoint-every {args.checkpoint_every} must be >= 1 (steps)")
  if args.checkpoint_dir is not None and args.no_checkpoint:
    raise UsageError("--checkpoint-dir and --no-checkpoint contradict each other; drop one")
  if args.checkpoint_dir is not None:
    records.check_checkpoint_dir(args.checkpoint_dir)
  if args.heartbeat_timeout < 2:
    raise UsageError(f"--heartbeat-timeout {args.heartbeat_timeout} must be >= 2 (seconds)")


def _process_spec(args: argparse.Namespace, mesh: MeshSpec | None) -> distributed.ProcessSpec | None:
  """This process's place in a multi-process run (None: a single-process run).

  Raises:
    UsageError: inconsistent process flags, or a mesh that does not split over the processes.
  """
  try:
    processes = distributed.process_spec(args.coordinator, args.num_processes, args.process_id,
                                         timeout_s=args.coordinator_timeout,
                                         heartbeat_timeout_s=args.heartbeat_timeout)
  except ValueError as e:
    raise UsageError(str(e)) from e
  if processes is not None and mesh is not None and mesh.devices % processes.num_processes:
    raise UsageError(f"--mesh {mesh} ({mesh.devices} devices) must split evenly over --num-processes "
                     f"{processes.num_processes}; e.g. U=<devices per process>,R={processes.num_processes}")
  return processes


def _check_outputs(args: argparse.Namespace) -> None:
  """--fps, --out and the contact sheet (process 0); a GIF's rounded frame delay warns now.

  Raises:
    UsageError: an --fps that cannot be stored.
    video_io.OutputError: an output that cannot be written, or exists without --overwrite.
  """
  try:
    if args.fps is not None:
      video_io.check_fps(args.fps)
  except video_io.OutputError as e:
    raise UsageError(f"--fps: {e}") from e
  try:
    video_io.check_output(args.out, overwrite=args.overwrite)
  except video_io.OutputError as e:
    raise video_io.OutputError(f"--out: {in_flags(str(e))}") from e
  sheet = contact_sheet.contact_sheet_path(args.out) if args.contact_sheet else None
  if sheet is not None and os.path.lexists(sheet) and not args.overwrite:
    raise video_io.OutputError(f"{sheet!r} exists; pass --overwrite to replace it, or choose another --out")
  if video_io.output_kind(args.out) == "gif" and args.fps is not None:
    video_io.gif_delay_cs(args.fps)  # its warning said now (main prints it), not after the run


def request_cpu_devices_for(plan: Plan) -> int | None:
  """Asks XLA for the mesh's (or --devices) CPU devices, split over the processes of a multi-process
  run (`attention.mesh.request_cpu_devices`); returns the count asked for in this process, None if
  not needed.

  Only takes effect if the JAX backend has not started yet (hence before any compute); a count the
  user already put in XLA_FLAGS is respected.

  Raises:
    UsageError: XLA_FLAGS sets a device count and --devices another.
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


# --- JAX up, no weights -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Checked:
  """A plan that passed the checks needing JAX (devices, model config), and its request."""
  plan: Plan
  device_note: str
  transformer: Any = None  # its WanTransformerConfig
  mesh_auto: bool = False  # the mesh is the planner's pick (--mesh auto)
  request: Any = None  # the `GenerationRequest` (pipelines.pipeline.checked.request)
  model_files: dict[str, Any] | None = None  # single files: `model_files.describe` (process 0), else None


def check_plan(plan: Plan) -> Checked:
  """The checks that need JAX's device list or the model's JSON files (still no weights, no compute);
  the video's values are checked by building the `GenerationRequest` (`build_request`).

  A multi-process run joins JAX's distributed runtime here, after the model checks and before
  JAX's backend starts. Single files are hashed for the records last, once every check has passed
  (`model_files.describe`; process 0 only).

  Raises:
    UsageError: see `_check_device_flag`, `build_request`, and --lora-2 for a one-expert model.
    weights.CheckpointError: a folder that is not a Wan pipeline, or a bad weight file.
    ValueError: a LoRA that does not fit the transformer (`pipelines.wan.lora.parse_lora`).
    distributed.DistributedError: the coordinator was not reached in time.
  """
  from pipelines.cli import devices

  requested = request_cpu_devices_for(plan)
  plan = devices.fetch_model(plan)
  facts, found = devices.model_facts(plan)
  if plan.processes is not None:
    devices.join(plan, facts)
  devices.check_device_flag(plan)
  plan = model_fps(image_sized(model_defaults(plan, facts), facts), facts)
  request = build_request(plan, facts, devices.draw_seed(plan))
  mesh_auto = plan.mesh is None
  if mesh_auto:
    plan, request = devices.auto_mesh(plan, request)
  _check_loras(plan, facts)
  plan = records.plan_checkpoint(plan, request)
  described = None if found is None or not plan.writes else describe(plan.files, found, records.saved_files(plan))
  return Checked(plan, devices.device_note(plan, requested), facts.transformer, mesh_auto, request, described)


def build_request(plan: Plan, facts: Any, seed: int) -> Any:
  """The `GenerationRequest` of the plan against the model's facts (`ModelFacts`): the one constructor
  the Python call uses checks every value, given by name from `plan.request` (media files read into
  arrays, `MEDIA_READERS`). A one-device mesh runs without one (mesh=None), as the pipeline's default.

  Raises:
    UsageError: each value the request refuses, naming its flag (`flags.flag_error`).
  """
  import jax

  from pipelines.pipeline.checked.request import GenerationRequest

  # --mesh auto: until the planner picks (`devices.auto_mesh`), a ring over every visible device,
  # which fits any model and spans every process.
  mesh = plan.mesh if plan.mesh is not None else MeshSpec(ring=jax.device_count())
  several = mesh.devices > 1
  arguments = plan.request | {name: read(plan.request[name]) for name, read in MEDIA_READERS.items()} | {
      "seed": seed, "mesh": mesh if several else None, "shard_weights": several and mesh.shard_weights,
      "decode": plan.writes}
  try:
    return GenerationRequest.build(facts, **arguments)
  except ValueError as e:
    raise flag_error(e) from e


def _check_loras(plan: Plan, facts: Any) -> None:
  """Each LoRA's keys and shapes against the transformer (no compute), --lora-2 against the experts.

  Raises:
    UsageError: --lora-2 for a one-expert model.
    ValueError: a LoRA that does not fit (`pipelines.wan.lora.parse_lora`).
  """
  from pipelines.wan import lora

  for path, _, expert in plan.loras:
    if expert >= facts.experts:
      raise UsageError(f"--lora-2 {path!r} needs a two-expert Wan 2.2 model but {facts.name!r} has one "
                       "transformer; use --lora")
    lora.parse_lora(*lora.read_lora(path)[:2], facts.transformer, where=path)

