"""`generate --stream`: a causal checkpoint (Self-Forcing, CausVid: `--transformer FILE` over a Wan 2.1
T2V model) makes the video a chunk of latent frames at a time, each attending to a KV cache of the
frames before it; each chunk is decoded and appended to OUT.streaming.mp4 as soon as it is made (a
fragmented MP4: it plays at every point of the run), which is renamed to --out once whole.

The flags (`add_stream_flags`) and their checks (`check_stream_flags`, no JAX) sit here beside the
run (`run_stream`), which `generate.run` calls in place of the whole-video path.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

from pipelines.commands.flags import UsageError, parse_prompts_at
from pipelines.wan.causal import ChunkSchedule

# Flags of the whole-video path that a stream does not use, by dest: (flag, why).
NOT_FOR_STREAMS = {
    "negative_prompt": ("--negative-prompt", "causal checkpoints run without guidance"),
    "guidance_scale": ("--guidance", "causal checkpoints run without guidance"),
    "num_inference_steps": ("--steps", "a stream's steps are --stream-steps"),
    "scheduler": ("--scheduler", "a stream's steps are --stream-steps"),
    "timesteps": ("--timesteps", "a stream's steps are --stream-steps"),
    "sigmas": ("--sigmas", "a stream's steps are --stream-steps"),
    "image": ("--image", "a stream is text-to-video"), "last_image": ("--last-image", "a stream is text-to-video"),
    "video": ("--video", "a stream is text-to-video"), "mask": ("--mask", "a stream is text-to-video"),
    "context_frames": ("--context-frames", "a stream's length is its chunks"),
    "context_overlap": ("--context-overlap", "a stream's length is its chunks"),
    "context_fuse": ("--context-fuse", "a stream's length is its chunks"),
    "step_cache": ("--step-cache", "a stream's chunks run a few steps each"),
    "quantize": ("--quantize", "streams run the weights as loaded"),
    "checkpoint_dir": ("--checkpoint-dir", "a stream's file is its progress"),
    "resume": ("--resume", "a stream's file is its progress"),
}


# The --stream-* flags' defaults (Self-Forcing's), by dest: what `add_stream_flags` sets and what
# `check_stream_flags` compares with to find one given without --stream.
STREAM_DEFAULTS = {"stream_chunk": 3, "stream_window": None, "stream_sink": 0, "stream_steps": "1000,750,500,250",
                   "stream_prompt": [], "stream_warp": True}


def add_stream_flags(g: argparse._ArgumentGroup) -> None:
  """The streaming group of `generate --help`."""
  g.add_argument("--stream", action="store_true",
                 help="make the video chunk by chunk with a causal checkpoint, writing OUT.streaming.mp4 as each "
                      "chunk is made (playable throughout; renamed to --out at the end)")
  g.add_argument("--stream-chunk", type=int, default=STREAM_DEFAULTS["stream_chunk"], metavar="FRAMES",
                 help="latent frames per chunk (the checkpoint's num_frame_per_block; default 3)")
  g.add_argument("--stream-window", type=int, default=STREAM_DEFAULTS["stream_window"], metavar="FRAMES",
                 help="latent frames a chunk attends to, itself included (the checkpoint's local_attn_size; "
                      "default: every frame made)")
  g.add_argument("--stream-sink", type=int, default=STREAM_DEFAULTS["stream_sink"], metavar="FRAMES",
                 help="first latent frames a window always keeps (the checkpoint's sink_size; default 0)")
  g.add_argument("--stream-steps", default=STREAM_DEFAULTS["stream_steps"], metavar="T,T,...",
                 help="each chunk's denoising steps (default Self-Forcing's 1000,750,500,250)")
  g.add_argument("--stream-prompt", action="append", default=[], metavar="CHUNK:PROMPT",  # a new list per parse
                 help="from chunk CHUNK (1-based) on, this prompt (repeatable; the frames made stay in the cache; "
                      "default: --prompt throughout)")
  g.add_argument("--stream-warp", action=argparse.BooleanOptionalAction, default=STREAM_DEFAULTS["stream_warp"],
                 help="the steps index the shifted training grid (Self-Forcing; --no-stream-warp for CausVid)")


def check_stream_flags(args: argparse.Namespace) -> dict[str, Any] | None:
  """The stream's settings as plain values (None without --stream), after refusing the flags a
  stream does not use; sets --no-checkpoint (a stream's file is its progress).

  Raises:
    UsageError: a --stream-* flag without --stream, a flag streams do not use, an output that is
      not .mp4, or settings that do not make a stream (each naming the fix).
  """
  if not args.stream:
    given = [name for name, value in STREAM_DEFAULTS.items() if getattr(args, name) != value]
    if given:
      raise UsageError(f"--{given[0].replace('_', '-')} sets up a stream; add --stream")
    return None
  for dest, (flag, why) in NOT_FOR_STREAMS.items():
    if getattr(args, dest, None) not in (None, False, []):
      raise UsageError(f"{flag} does not apply to --stream ({why}); leave it out")
  if args.num_processes is not None or args.coordinator is not None:
    raise UsageError("--stream runs in one process (its mp4 grows where it runs); leave out --num-processes and "
                     "--coordinator (a mesh of this host's devices, --mesh U=..,R=.., works)")
  if not args.out.endswith(".mp4"):
    raise UsageError(f"--out {args.out}: a stream writes an .mp4 as it is made; use a .mp4 name")
  chunk, window, sink = args.stream_chunk, args.stream_window, args.stream_sink
  if chunk < 1 or sink < 0 or (window is not None and window < chunk + sink):
    raise UsageError(f"--stream-chunk {chunk} --stream-window {window} --stream-sink {sink}: a chunk needs >= 1 "
                     f"frame and a window at least the chunk plus the sink frames ({chunk + sink})")
  try:
    steps = tuple(float(t) for t in args.stream_steps.split(","))
    schedule = ChunkSchedule(steps, warp_denoising_step=args.stream_warp,
                             shift=5.0 if args.flow_shift is None else args.flow_shift)
  except ValueError as e:
    raise UsageError(f"--stream-steps {args.stream_steps}: {e}") from e
  args.no_checkpoint = True
  return {"prompts_at": parse_prompts_at(args.stream_prompt), "chunk_frames": chunk, "window_frames": window,
          "sink_frames": sink,
          "denoising_step_list": list(schedule.denoising_step_list),
          "warp_denoising_step": schedule.warp_denoising_step, "shift": schedule.shift}


def run_stream(pipe: Any, checked: Any, load_s: float, warnings_seen: list[str]) -> dict[str, Any]:
  """Streams the checked request on `pipe` into --out (module doc); returns the sidecar dict.

  Raises:
    video_io.EncodeError / OutputError: the encoder failed or the output appeared meanwhile; the
      partial file stays (playable up to its last chunk).
  """
  from pipelines.pipeline.run.streaming import StreamSettings, stream_video
  from pipelines.storage import video_io
  from pipelines.storage.stream_mp4 import StreamingMp4, count_fragments
  from pipelines.wan.causal import CacheWindow

  plan, request = checked.plan, checked.request
  values = plan.stream
  settings = StreamSettings(CacheWindow(values["chunk_frames"], values["window_frames"], values["sink_frames"]),
                            ChunkSchedule(tuple(values["denoising_step_list"]), values["warp_denoising_step"],
                                          values["shift"]))
  chunks = settings.chunks_for(request.num_frames)
  frames = settings.frames_of(chunks, values["chunk_frames"])
  seed = request.seed if isinstance(request.seed, int) else request.seed[0]
  for k in sorted(k for k in values["prompts_at"] if int(k) >= chunks):
    warnings.warn(f"--stream-prompt {int(k) + 1}:...: the stream has {chunks} chunks; that prompt is not used")
  print(f"generate: streaming {chunks} chunks of {values['chunk_frames']} latent frames ({frames} frames) "
        f"into {plan.out}", file=sys.stderr)
  writer = StreamingMp4(plan.out, fps=plan.fps, height=request.height, width=request.width, overwrite=plan.overwrite)
  times, made, start = [], 0, time.perf_counter()
  try:
    for chunk in stream_video(pipe, request.prompts[:1], num_chunks=chunks, height=request.height,
                              width=request.width, seed=seed, settings=settings,
                              plan=request.plan if request.plan.mesh is not None else None,
                              max_sequence_length=request.max_sequence_length,
                              prompts_at={int(k): [p] for k, p in values["prompts_at"].items()}):
      writer.append(chunk.frames[0])
      made += chunk.frames.shape[1]
      times.append(round(chunk.seconds, 3))
      print(f"generate: chunk {chunk.index + 1}/{chunks}: {chunk.frames.shape[1]} frames in {chunk.seconds:.2f} s; "
            f"{writer.partial} plays {made - 1} frames", file=sys.stderr)
  except BaseException:
    writer.abort()
    kept = count_fragments(writer.partial)  # one frame a fragment
    print(f"generate: the stream stopped; {writer.partial} keeps the {kept} frames written so far", file=sys.stderr)
    raise
  read = writer.close()
  record = {"prompt": request.prompts[0], "model": pipe.name, "seed": seed, "size": [request.height, request.width],
            "frames": read[0], "fps": plan.fps, "stream": values, "chunk_seconds": times,
            "seconds": {"load": round(load_s, 3), "stream": round(time.perf_counter() - start, 3)},
            "warnings": list(warnings_seen)}
  video_io.write_json(record, video_io.sidecar_path(plan.out), overwrite=plan.overwrite)
  print(f"generate: wrote {plan.out} ({read[0]} frames, {chunks} chunks, first after {times[0]:.2f} s)")
  return record
