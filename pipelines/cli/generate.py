"""Generate a video with a Wan model, on one device or sharded over a mesh.

  generate --prompt "a red square moving right" --mesh U=2,R=2 --out square.mp4
  generate --model ./Wan2.1-T2V-1.3B-Diffusers --preset wan2.1-t2v-1.3b --mesh U=2,R=4 --prompt "..."
  generate --model ./Wan2.1-I2V-14B-480P-Diffusers --preset wan2.1-i2v-14b-480p --image cat.png --prompt "..."
  generate --transformer wan2.1_t2v_1.3B_fp16.safetensors --vae wan_2.1_vae.safetensors \
      --text-encoder umt5_xxl_fp16.safetensors --tokenizer ./umt5-xxl --preset wan2.1-t2v-1.3b --prompt "..."

`--model tiny` (the default) is the embedded trained tiny model: it needs no download and draws the
shapes world it was trained on (end_to_end/train/synthetic_world.py: "a red square moving right", "a
yellow triangle standing still", ...; 64x64 x 17 frames by default); `--model tiny-random` is the
random-weight tiny model (noise-like videos); a diffusers-format folder, an official Wan folder or
ComfyUI's single files (--transformer, --vae, --text-encoder; the sidecar records each file's SHA-256)
give real videos. On the
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
output's name + .json: fox.mp4.json; frames.frames.json for a PNG folder frames/) are written to a temporary name and renamed into place; an
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
import os
import signal
import sys
import time
from typing import Any

from pipelines.cli.flags import build_parser as _build_parser, in_flags
from pipelines.cli.output import announce, mesh_text, sidecar, summary_line, timings, write_outputs
from pipelines.cli.records import (apply_resume, given_flags, remove_checkpoint, resume_hint, tidy_checkpoint,
                                   write_run_record)
from pipelines.cli.plan import Plan
from pipelines.cli.run_plan import Checked, check_plan, plan_run
from pipelines.cli.streaming import run_stream
from pipelines.commands.help import warnings_as_lines
from pipelines.commands.presets import TINY_MODELS
from pipelines.commands.startup import import_flax_without_ipython
from pipelines.parallel import distributed
from pipelines.parallel import supervisor
from pipelines.commands import compile_cache
from pipelines.storage import video_io
from pipelines.storage import weights
from pipelines.wan.pretrained import hub_id

__all__ = ["main", "cli", "run", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
  """The command line of `generate` (`flags.build_parser`): --help opens with this module's
  docstring's first line and examples, and its other paragraphs follow the flags."""
  paragraphs = __doc__.split("\n\n")
  return _build_parser("\n\n".join(paragraphs[:2]), "\n\n".join(paragraphs[2:]))


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

  plan, request = checked.plan, checked.request
  announce(checked)
  if plan.checkpoint_dir is not None:
    supervisor.write_status(checkpoint_dir=plan.checkpoint_dir)
    if plan.writes and not plan.resume:
      write_run_record(plan, request, checked.model_files, plan.checkpoint_dir)
  start = time.perf_counter()
  pipe = _load(plan, request)
  load_s = time.perf_counter() - start
  weights = plan.dtype + (f", {plan.quantize} weights" if plan.quantize else "")
  print(f"generate: model {pipe.name} ({weights}), mesh {mesh_text(request)}: {checked.device_note}",
        file=sys.stderr)
  if plan.stream is not None:
    return run_stream(pipe, checked, load_s, warnings_seen)
  result = _generate(pipe, request, plan, cache)
  if not plan.writes:
    print(f"generate: process {jax.process_index()} done; process 0 writes {plan.out}", file=sys.stderr)
    return {}
  start = time.perf_counter()
  out, sheet = write_outputs(plan, result.frames[0], checked)
  times = timings(load_s, result.timings, time.perf_counter() - start)
  record = sidecar(checked, result, out=out, sheet=sheet, lora=pipe.lora_info(), times=times, cache=cache,
                   warnings_seen=warnings_seen)
  described = video_io.write_json(record, video_io.sidecar_path(plan.out), overwrite=plan.overwrite)
  if plan.checkpoint_dir is not None and not plan.keep_checkpoint:
    remove_checkpoint(plan.checkpoint_dir)
  print(summary_line(checked, result, out=out, described=described, times=times, cache=cache))
  if sheet is not None:
    print(f"generate: wrote the contact sheet {sheet}")
  return record


def _load(plan: Plan, request: Any) -> Any:
  """The pipeline of --model or of the single files (weights straight onto the request's mesh), with the
  LoRAs fused."""
  import_flax_without_ipython()  # ~1.3 s on a TPU VM (commands.startup), before flax's first import
  from pipelines.pipeline import WanImageToVideoPipeline, WanPipeline

  if plan.model in TINY_MODELS:
    pipe = WanPipeline.tiny(plan.dtype, random=plan.model == "tiny-random", image=plan.model == "tiny-i2v",
                            vae_dtype=plan.vae_dtype)
  elif plan.files is not None:
    files = plan.files
    pipe = WanPipeline.from_single_file(files.transformer, files.vae, files.text_encoder, files.tokenizer,
                                        dtype=plan.dtype, vae_dtype=plan.vae_dtype, config=files.config,
                                        mesh=request.plan.mesh,
                                        shard_weights=request.plan.shard_weights)
  else:
    cls = WanImageToVideoPipeline if request.model.image_to_video else WanPipeline
    model = plan.model if plan.model_commit is None else f"{hub_id(plan.model)[0]}@{plan.model_commit}"
    pipe = cls.from_pretrained(model, dtype=plan.dtype, vae_dtype=plan.vae_dtype, mesh=request.plan.mesh,
                               shard_weights=request.plan.shard_weights)  # a Hub model: the commit checked
  weights: dict[str, dict[str, float]] = {}  # adapter name -> {transformer: weight}
  for path, scale, expert in plan.loras:
    name = pipe.load_lora_weights(path, scale=scale, load_into_transformer_2=expert == 1)
    weights.setdefault(name, {})["transformer_2" if expert else "transformer"] = scale
  if len(plan.loras) > 1:  # every --lora / --lora-2 active at once, each with its weight
    pipe.set_adapters(list(weights), list(weights.values()))
  if plan.quantize is not None:  # after the LoRAs: they are fused into the full-precision weights
    pipe.quantize(plan.quantize)
  pipe.set_memory_placement(plan.placement)
  return pipe


# --- the one call into the pipeline ---------------------------------------------------------------

def _generate(pipe: Any, request: Any, plan: Plan, cache: compile_cache.CacheUse) -> Any:
  """Runs the checked `request` on `pipe` (the only place the command calls the pipeline); the
  checkpoint is kept (keep=True) and removed by `_run` once the video is written; `cache` counts
  each stage's compilation-cache hits.

  Returns: the pipeline's `GenerationResult` (frames None on processes that do not write).
  """
  from pipelines.pipeline.run.call_options import CallOptions
  from pipelines.pipeline.run.resume import ResumeConfig

  resume = None if plan.checkpoint_dir is None else ResumeConfig(
      plan.checkpoint_dir, every=plan.checkpoint_every, resume=plan.resume, keep=True)
  options = CallOptions(progress=plan.writes, nan_guard=plan.nan_guard, decode_compile_effort=plan.decode_compile_effort,
                        on_stage=cache.mark)
  return pipe.generate(request, options, resume=resume)


def main(argv: list[str] | None = None) -> int:
  """Console entry point; returns the exit status (module docstring: 0, 1, 2 or 130).

  Python warnings print as `generate: warning: ...` lines (no file paths) and go into the sidecar.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser().parse_args(argv)
  supervised = _supervise(args, argv)
  if supervised is not None:
    return supervised
  with warnings_as_lines("generate", words=in_flags) as seen:
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

    from pipelines.pipeline.run.resume import ResumeError

    hint = lambda: resume_hint(checked.plan)  # noqa: E731 (read when the error happens)
    try:
      run(checked, warnings_seen)
    except ResumeError as e:  # a checkpoint of another run, unreadable, or in the way: no resume hint
      print(f"generate: error: {e}", file=sys.stderr)
      return 2
    except (video_io.OutputError, weights.CheckpointError) as e:
      # loading; or the output appeared meanwhile
      text = in_flags(str(e)) if isinstance(e, video_io.OutputError) else str(e)
      print(f"generate: error: {text}{hint()}", file=sys.stderr)
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
      tidy_checkpoint(checked.plan)
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
