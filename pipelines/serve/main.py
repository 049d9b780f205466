"""`serve`: the console script. Checks the flags and the model's configs (no weights), asks for the
mesh's CPU devices before JAX starts (as `generate` does), then listens at once while the model loads
and compiles the --warmup shapes on a thread (/health: 503 until ready). Jobs queued meanwhile wait.

  serve --model tiny --mesh U=2,R=2 --port 8000 --data-dir ./wan-serve --warmup 64x64x17x8

Multi-host: start the same command on every process with --coordinator HOST:PORT --num-processes N
--process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); process 0 serves
HTTP and the others run its batches with it (`multihost`); --data-dir must be shared storage.

Exit status: 0 after Ctrl-C / SIGTERM (the running batch stops at its next step and resumes at the
next start); 1 the coordinator not reached; 2 a usage error (nothing started).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from typing import Any

import numpy as np

from pipelines.commands.flags import UsageError
from pipelines.commands.model_files import read_facts
from pipelines.commands.presets import TINY_MODELS
from pipelines.commands.startup import import_flax_without_ipython
from pipelines.serve import events
from pipelines.serve.options import ServeConfig, parse
from pipelines.storage.weights import CheckpointError


def fetch_model(config: ServeConfig) -> ServeConfig:
  """A Hugging Face Hub --model (org/name[@revision]) downloaded into the Hub cache where missing
  (`pretrained.download_snapshot`; processes of one host download once) and pinned to the commit it
  resolved to ("org/name@commit"), so that the checks and every load read those files without
  asking the Hub again; any other --model as it is.

  Raises:
    UsageError: no such repo or revision, not a Wan pipeline, not cached while offline.
  """
  from pipelines.wan.pretrained import download_snapshot, hub_id

  parsed = hub_id(config.model)
  if parsed is None:
    return config
  try:
    snapshot = download_snapshot(*parsed)
  except ValueError as e:
    raise UsageError(f"--model {config.model}: {e}") from e
  return dataclasses.replace(config, model=snapshot.pinned)


def model_facts(config: ServeConfig) -> Any:
  """The `ModelFacts` of --model ("tiny", "tiny-i2v", "tiny-random", a folder or a pinned Hub id) from its
  JSON files, or of the single files from their headers (`model_files.read_facts`)."""
  from pipelines.pipeline.load.loading import locate
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.wan.pretrained import Sources, folder_layout

  if config.files is not None:
    return read_facts(config.files, config.dtype)[0]
  if config.model in TINY_MODELS:
    return ModelFacts.of_model(config.model, config.dtype)  # the trained ones with their one size
  folder, name, _ = locate(config.model)  # a Hub model: in the cache already (`fetch_model`)
  if folder_layout(folder) == "official":  # Wan's own layout: its files' headers
    return read_facts(Sources.official(folder), config.dtype)[0]
  return ModelFacts.from_folder(folder, config.dtype, name=name)


def loader(config: ServeConfig) -> Any:
  """A function that loads the pipeline of --model or of the single files (placed for --mesh)."""
  import_flax_without_ipython()  # ~1.3 s where IPython is installed (commands.startup)
  from pipelines.pipeline.wan_pipeline import WanPipeline

  def load() -> Any:
    pipe = _load()
    pipe.set_memory_placement(config.placement)
    return pipe

  def _load() -> Any:
    if config.files is not None:
      files = config.files
      return WanPipeline.from_single_file(files.transformer, files.vae, files.text_encoder, files.tokenizer,
                                          dtype=config.dtype, vae_dtype=config.vae_dtype, config=files.config,
                                          mesh=config.mesh)
    if config.model in TINY_MODELS:
      return WanPipeline.tiny(config.dtype, random=config.model == "tiny-random", image=config.model == "tiny-i2v",
                              vae_dtype=config.vae_dtype)
    if model_facts(config).image_to_video:  # its jobs bring their first frame (input_reference)
      from pipelines.pipeline.image_pipeline import WanImageToVideoPipeline
      return WanImageToVideoPipeline.from_pretrained(config.model, dtype=config.dtype, vae_dtype=config.vae_dtype,
                                                     mesh=config.mesh)
    return WanPipeline.from_pretrained(config.model, dtype=config.dtype, vae_dtype=config.vae_dtype, mesh=config.mesh)

  return load


def check(config: ServeConfig, facts: Any) -> None:
  """The model's kind, the mesh, the warm-up shapes and the LoRAs against the model, before anything
  is loaded.

  Raises:
    UsageError: naming the flag and the problem (an image-to-video model: serve takes no image).
  """
  from pipelines.pipeline.checked.request import GenerationRequest
  from pipelines.wan import lora

  from pipelines.serve.api import defaults

  preset = defaults(config.model)

  def image(width: int, height: int) -> Any:  # an image-to-video model's requests bring their first frame
    return np.zeros((height, width, 3), np.uint8) if facts.image_to_video else None

  try:  # the mesh against the devices and heads, at the model's default size
    GenerationRequest.build(facts, "check", height=preset.height, width=preset.width, num_frames=preset.frames,
                            seed=0, num_inference_steps=1, mesh=config.mesh, image=image(preset.width, preset.height))
  except ValueError as e:
    raise UsageError(f"--mesh {config.mesh}: {e}") from e
  for width, height, frames, steps in config.warmup:
    try:
      GenerationRequest.build(facts, "warm-up", height=height, width=width, num_frames=frames, seed=0,
                              num_inference_steps=1 if steps is None else steps, mesh=config.mesh,
                              image=image(width, height))
    except ValueError as e:
      raise UsageError(f"--warmup {width}x{height}x{frames}{'' if steps is None else f'x{steps}'} / --mesh "
                       f"{config.mesh}: {e}") from e
  for name, path, _ in config.loras:
    try:
      lora.parse_lora(*lora.read_lora(path)[:2], facts.transformer, where=path)
    except ValueError as e:
      raise UsageError(f"--lora {name}={path}: {e}") from e


def prepare(config: ServeConfig) -> Any:
  """Devices asked for, the multi-process runtime joined, the compile cache on, the config checked;
  returns the model's `ModelFacts` (JAX started, no weights loaded).

  Raises:
    UsageError: a flag that does not fit the model or the devices.
    distributed.DistributedError: the coordinator was not reached in time.
  """
  from attention.mesh import MeshSpec, request_cpu_devices
  from pipelines.parallel import distributed
  from pipelines.commands import compile_cache

  processes = config.processes.num_processes if config.processes is not None else 1
  if config.mesh is not None:
    try:
      request_cpu_devices(MeshSpec.parse(config.mesh).devices // processes)
    except ValueError as e:
      raise UsageError(f"--mesh {config.mesh}: {e}") from e
  if config.processes is not None:
    distributed.initialize(config.processes)
  compile_cache.enable(config.compile_cache)
  facts = model_facts(config)
  check(config, facts)
  return facts


def build_service(config: ServeConfig) -> Any:
  """The `Service` of a checked config (JAX started, model not yet loaded)."""
  from pipelines.serve.service import Service

  facts = prepare(config)
  channel = None
  if config.processes is not None:
    from pipelines.serve.multihost import Channel
    channel = Channel()
  return Service(config, facts, loader(config), channel=channel)


def follow(config: ServeConfig) -> int:
  """A process other than 0 of a multi-process server: loads and warms up as process 0 does, then
  runs what it broadcasts until it stops."""
  from pipelines.parallel import distributed
  from pipelines.serve.multihost import Channel
  from pipelines.serve.worker import Worker, warm

  prepare(config)
  pipe = loader(config)()
  pipe.set_progress_bar_config(disable=True)
  warm(pipe, config)
  print(f"serve: process {config.processes.process_id} of {config.processes.num_processes} follows process 0",
        file=sys.stderr, flush=True)
  Worker(pipe, config, store=None, metrics=None, channel=Channel()).follow()
  distributed.shutdown()  # with process 0, once it said stop
  return 0


def main(argv: list[str] | None = None) -> int:
  import uvicorn

  from pipelines.serve.app import create_app

  from pipelines.parallel.distributed import DistributedError

  try:
    config = fetch_model(parse(argv))
    if config.processes is not None and config.processes.process_id != 0:
      return follow(config)
    service = build_service(config)
  except (UsageError, CheckpointError, OSError, DistributedError) as e:  # (a bad model file: before loading)
    print(f"serve: error: {e}", file=sys.stderr)
    return 1 if isinstance(e, DistributedError) else 2
  events.configure(config.log_level)
  if config.public() and config.api_key is None:
    events.log().warning(f"warning: listening on {config.host} without --api-key: anyone who reaches this port "
                         "can queue videos")
  service.start()
  # uvicorn stops gracefully on SIGINT / SIGTERM, then raises the signal again once it has restored
  # these handlers: leaving through `finally` stops the worker (the running batch left to resume).
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, _exit_cleanly)
  events.log().info(f"listening at {service.url} (model {service.facts.name}, mesh {config.mesh or 'one device'}, "
                       f"data {config.data_dir}); /health says when the model is ready")
  try:
    uvicorn.run(create_app(service), host=config.host, port=config.port, log_level=config.log_level,
                access_log=config.log_level in ("debug", "info"))
  finally:
    service.stop()  # a multi-process server's worker tells the others to stop
    if config.processes is not None:
      from pipelines.parallel import distributed
      distributed.shutdown()  # the others reach it once they got the message
  return 0


def _exit_cleanly(signum: int, frame: Any) -> None:
  raise SystemExit(0)


def cli() -> None:
  sys.exit(main())


if __name__ == "__main__":
  cli()
