"""The `serve` command's flags (`build_parser`; its --help text is `DESCRIPTION` and `EPILOG`) and the
checked server configuration (`ServeConfig`). Imports no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
from typing import Any

from pipelines.commands.flags import UsageError, add_decode_effort_flag, parse_lora_arg
from pipelines.commands.help import HelpFormatter
from pipelines.commands.model_files import add_single_file_flags, single_files
from pipelines.commands import compile_cache

API_KEY_ENV = "WAN_SERVE_API_KEY"
LORA_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# `serve --help`: one line for users and examples before the flags, what to know after them.
DESCRIPTION = """\
Serve Wan videos over HTTP: a queue of generation jobs (OpenAI's Videos API) and a web page at /.

  serve --model tiny --mesh U=2,R=2 --port 8000 --data-dir ./wan-serve --warmup 64x64x17x8
  serve --model ./Wan2.1-T2V-1.3B-Diffusers --mesh U=4,R=2 --warmup 832x480x81 --api-key "$KEY" \\
      --lora fox=./fox_lora.safetensors:0.8
"""
EPILOG = f"""\
It listens at once while the model loads and the --warmup shapes compile (GET /health: 503 until
ready; it prints each stage, then a ready line and one line per job); jobs queued meanwhile wait.
The official openai SDK works unchanged (OpenAI(base_url="http://HOST:PORT/v1").videos.create(...),
create_and_poll, list, download_content, remix, delete); the schema is at /openapi.json and /docs.
Or: POST /v1/videos {{"prompt": ..., "size": "64x64", ...}} (JSON or multipart, with an
input_reference file), GET /v1/videos/ID, GET /v1/videos/ID/content, POST /v1/videos/ID/cancel,
DELETE /v1/videos/ID, GET /metrics. Jobs, videos and checkpoints live in --data-dir: a server killed
and started again on it loses nothing. It listens on 127.0.0.1 unless --host says otherwise; --api-key (or ${API_KEY_ENV})
requires 'Authorization: Bearer KEY'.

Multi-host: start the same command on every process with --coordinator HOST:PORT --num-processes N
--process-id I; process 0 serves HTTP and the others run its batches; --data-dir must be shared
storage.

Exit status: 0 after Ctrl-C / SIGTERM (the running batch stops at its next step and resumes at the
next start); 1 the coordinator not reached; 2 a usage error (nothing started).
"""


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """What the server runs with (checked by `parse`; every field has its flag).

  Attributes:
    model: "tiny", "tiny-i2v", "tiny-random", a diffusers-format (or official) Wan folder or a Hub id
      "org/name[@revision]" (`main.fetch_model` downloads it and pins the commit: "org/name@commit");
      None with `files`.
    mesh: the mesh spec string ("U=2,R=2"), or None (one device).
    host, port: where HTTP listens (127.0.0.1 by default: reachable from this machine only).
    data_dir: the job table (`jobs.sqlite3`), videos, sidecars and denoising checkpoints.
    max_batch: jobs of one shape and setting run together as one batch of up to this many videos.
    max_queue: queued jobs at most; a request beyond gets 429 with Retry-After.
    warmup: (width, height, frames, steps or None) compiled, at every batch size up to max_batch,
      before /health reports ready (the step program depends on the shape, the batch size and the
      number of steps; None: the model's default steps).
    api_key: None (no auth) or the Bearer token every route but /health and / requires.
    loras: (name, path, scale): the LoRAs a request may name (never a client path).
    dtype: the transformer's dtype ("float32" or "bfloat16").
    checkpoint_every: denoising steps between checkpoints (a killed server resumes from the last).
    max_prompt_chars, max_body_bytes: request limits checked before anything is queued.
    max_upload_bytes: the most a multipart body (an input_reference file) may add to max_body_bytes.
    docs: publish /openapi.json and its pages (/docs, /redoc).
    log_level: serve's own lines and uvicorn's (its access log shows at "info" and "debug").
    placement: the memory plan's placement (`WanPipeline.set_memory_placement`).
    compile_cache: JAX's persistent compilation cache folder, or None (off).
    processes: a multi-process server's `distributed.ProcessSpec` (process 0 serves HTTP), or None.
    decode_compile_effort: `CallOptions.decode_compile_effort` of every job and of the warm-up.
    files: the model as single files (--transformer, --vae, --text-encoder, ...: a
      `wan.pretrained.Sources`, `commands.model_files`), or None.
  """
  model: str | None = "tiny"
  mesh: str | None = None
  host: str = "127.0.0.1"
  port: int = 8000
  data_dir: str = "wan-serve"
  max_batch: int = 4
  max_queue: int = 64
  warmup: tuple[tuple[int, int, int, int | None], ...] = ()
  api_key: str | None = None
  loras: tuple[tuple[str, str, float], ...] = ()
  dtype: str = "float32"
  vae_dtype: str = "float32"  # the VAE's (generate --help: --vae-dtype)
  checkpoint_every: int = 1
  max_prompt_chars: int = 2000
  max_body_bytes: int = 64 * 1024
  max_upload_bytes: int = 32 * 2 ** 20
  docs: bool = True
  log_level: str = "info"
  compile_cache: str | None = None
  processes: Any = None
  decode_compile_effort: float | None = None
  placement: str = "auto"
  files: Any = None

  def __post_init__(self):
    for name in ("max_batch", "max_queue", "checkpoint_every", "max_prompt_chars", "max_body_bytes",
                 "max_upload_bytes"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"--{name.replace('_', '-')} {value!r} must be an int >= 1")
    if not 0 < self.port < 65536:
      raise UsageError(f"--port {self.port} must be in 1..65535")
    from pipelines.wan.vae import check_compile_effort

    try:
      check_compile_effort(self.decode_compile_effort, "tpu")
    except ValueError as e:
      raise UsageError(f"--decode-compile-effort: {e}") from e
    if self.log_level not in ("debug", "info", "warning", "error"):
      raise UsageError(f"--log-level {self.log_level!r} must be debug, info, warning or error")
    if self.dtype not in ("float32", "bfloat16"):
      raise UsageError(f"--dtype {self.dtype!r} must be float32 or bfloat16")
    if self.api_key is not None and len(self.api_key) < 8:
      raise UsageError("--api-key must be at least 8 characters (or unset for no authentication)")
    names = [name for name, _, _ in self.loras]
    if len(set(names)) != len(names):
      raise UsageError(f"--lora names must differ; got {names}")

  @property
  def lora_names(self) -> tuple[str, ...]:
    return tuple(name for name, _, _ in self.loras)

  def public(self) -> bool:
    """Whether HTTP listens beyond this machine (any address that is not loopback)."""
    try:
      return not ipaddress.ip_address(self.host).is_loopback
    except ValueError:
      return self.host != "localhost"


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="serve", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
  p.add_argument("--model", default=None, help="tiny (the trained embedded model), tiny-i2v (the same, its "
                 "jobs may bring a first frame: input_reference), tiny-random, a diffusers-format (or official) Wan "
                 "folder, or a Hugging Face Hub id org/name[@revision]; --transformer, --vae and --text-encoder give "
                 "the model as single files instead (default: tiny)")
  add_single_file_flags(p)
  p.add_argument("--mesh", default=None, help="Ulysses x ring mesh, e.g. U=2,R=2 (default: one device)")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 exposes the server to "
                 "the network (use --api-key then)")
  p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
  p.add_argument("--data-dir", default="wan-serve", help="job table, videos, sidecars and checkpoints")
  p.add_argument("--max-batch", type=int, default=4, help="same-shape jobs run together, at most this many")
  p.add_argument("--max-queue", type=int, default=64, help="queued jobs at most (beyond: HTTP 429)")
  p.add_argument("--warmup", action="append", default=[], metavar="WxHxF[xSTEPS]",
                 help="compile this shape and step count (e.g. 64x64x17; default steps: the model's) at "
                      "every batch size before /health says ready; repeatable (default: none)")
  p.add_argument("--api-key", default=None,
                 help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else no authentication)")
  p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:SCALE]",
                 help="a LoRA requests may name as NAME; repeatable (default: none)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the transformer's dtype")
  p.add_argument("--vae-dtype", default="float32", choices=("float32", "bfloat16"),
                 help="the VAE's dtype (generate --help: --vae-dtype)")
  p.add_argument("--placement", default="auto", choices=("auto", "resident", "encoder-offloaded", "encoder-on-host"),
                 help="where the weights live between and during jobs (generate --help: --placement); each job's "
                      "plan is in the log and its sidecar")
  p.add_argument("--checkpoint-every", type=int, default=1, help="steps between denoising checkpoints")
  p.add_argument("--max-upload-mb", type=float, default=32.0, metavar="MB",
                 help="largest input_reference file a request may send, in MiB")
  p.add_argument("--no-docs", action="store_true", help="do not publish /openapi.json, /docs and /redoc")
  p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                 help="what serve prints: loading, warm-up, ready and per-job lines and uvicorn's access log at "
                      "info; warnings and errors only at warning")
  add_decode_effort_flag(p)
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help=f"JAX's persistent compilation cache, as generate's (default: ${compile_cache.ENV}, else "
                      f"{compile_cache.default_dir()})")
  p.add_argument("--no-compile-cache", action="store_true", help="compile everything, keep nothing")
  p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="multi-host: process 0's address and a free port, the same on every process; process 0 "
                      "serves HTTP, the others follow it (default: $JAX_COORDINATOR_ADDRESS, else one process)")
  p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes (default: $JAX_NUM_PROCESSES)")
  p.add_argument("--process-id", type=int, default=None, help="multi-host: this process, 0.. (default: $JAX_PROCESS_ID)")
  return p


def parse_warmup(text: str) -> tuple[int, int, int, int | None]:
  """"64x64x17" -> (64, 64, 17, None); "64x64x17x8" -> (64, 64, 17, 8) (width, height, frames, steps).

  Raises:
    UsageError: anything else.
  """
  match = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)(?:x(\d+))?\s*", text)
  if match is None:
    raise UsageError(f"--warmup {text!r} is malformed; write WIDTHxHEIGHTxFRAMES[xSTEPS], e.g. 64x64x17 or "
                     "64x64x17x8")
  width, height, frames, steps = match.groups()
  return int(width), int(height), int(frames), None if steps is None else int(steps)


def parse_lora(text: str) -> tuple[str, str, float]:
  """"NAME=PATH[:SCALE]" -> (name, path, scale).

  Raises:
    UsageError: no NAME=, a name outside [A-Za-z0-9_.-]{1,64}, or a bad path or scale.
  """
  name, sep, rest = text.partition("=")
  if not sep or not LORA_NAME.fullmatch(name):
    raise UsageError(f"--lora {text!r}: write NAME=PATH[:SCALE] with NAME of letters, digits, '_', '.', '-'")
  path, scale = parse_lora_arg(rest, flag=f"--lora {name}=")
  return name, os.path.abspath(path), scale


def parse(argv: list[str] | None = None) -> ServeConfig:
  """The checked configuration of a command line.

  Raises:
    UsageError: each bad flag, naming it and the fix.
  """
  from pipelines.parallel import distributed

  args = build_parser().parse_args(argv)
  try:
    processes = distributed.process_spec(args.coordinator, args.num_processes, args.process_id)
  except ValueError as e:
    raise UsageError(str(e)) from e
  files = single_files(args)
  return ServeConfig(
      model=args.model if args.model is not None or files is not None else "tiny", files=files, mesh=args.mesh, host=args.host, port=args.port, data_dir=os.path.abspath(args.data_dir),
      max_batch=args.max_batch, max_queue=args.max_queue, warmup=tuple(parse_warmup(w) for w in args.warmup),
      api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
      loras=tuple(parse_lora(text) for text in args.lora), dtype=args.dtype, checkpoint_every=args.checkpoint_every,
      compile_cache=compile_cache.resolve_dir(args.compile_cache, args.no_compile_cache), processes=processes,
      decode_compile_effort=args.decode_compile_effort, max_upload_bytes=_megabytes(args.max_upload_mb),
      docs=not args.no_docs, log_level=args.log_level, placement=args.placement, vae_dtype=args.vae_dtype)


def _megabytes(value: float) -> int:
  if not (value > 0 and value <= 4096):
    raise UsageError(f"--max-upload-mb {value!r} must be in (0, 4096]")
  return int(value * 2 ** 20)
