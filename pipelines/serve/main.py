"""`serve`: the console script. Checks the flags and the model's configs (no weights), asks for the
mesh's CPU devices before JAX starts (as `generate` does), then listens at once while the model loads
and compiles the --warmup shapes on a thread (/health: 503 until ready). Jobs queued meanwhile wait.

  serve --model tiny --mesh U=2,R=2 --port 8000 --data-dir ./wan-serve --warmup 64x64x17x8

Exit status: 0 after Ctrl-C / SIGTERM; 2 a usage error (nothing started).
"""

from __future__ import annotations

import sys
from typing import Any

from pipelines.cli.flags import UsageError
from pipelines.serve.options import ServeConfig, parse


def model_facts(config: ServeConfig) -> Any:
  """The `ModelFacts` of --model ("tiny", "tiny-random" or a folder) from its JSON files."""
  from pipelines.pipeline.request import ModelFacts
  from pipelines.wan.tiny import TINY_DEFAULT_FOLDER

  if config.model == "tiny-random":
    return ModelFacts.tiny_random(config.dtype)
  if config.model == "tiny":
    return ModelFacts.from_folder(TINY_DEFAULT_FOLDER, config.dtype, name="tiny")
  return ModelFacts.from_folder(config.model, config.dtype)


def loader(config: ServeConfig) -> Any:
  """A function that loads the pipeline of --model (placed for --mesh)."""
  from pipelines.pipeline.wan_pipeline import WanPipeline

  def load() -> Any:
    if config.model in ("tiny", "tiny-random"):
      return WanPipeline.tiny(config.dtype, random=config.model == "tiny-random")
    return WanPipeline.from_pretrained(config.model, dtype=config.dtype, mesh=config.mesh)

  return load


def check(config: ServeConfig, facts: Any) -> None:
  """The mesh, the warm-up shapes and the LoRAs against the model, before anything is loaded.

  Raises:
    UsageError: naming the flag and the problem.
  """
  from pipelines.pipeline.request import GenerationRequest
  from pipelines.wan import lora

  from pipelines.serve.api import defaults

  preset = defaults(config.model)
  try:  # the mesh against the devices and heads, at the model's default size
    GenerationRequest.build(facts, "check", height=preset.height, width=preset.width, num_frames=preset.frames,
                            seed=0, num_inference_steps=1, mesh=config.mesh)
  except ValueError as e:
    raise UsageError(f"--mesh {config.mesh}: {e}") from e
  for width, height, frames, steps in config.warmup:
    try:
      GenerationRequest.build(facts, "warm-up", height=height, width=width, num_frames=frames, seed=0,
                              num_inference_steps=1 if steps is None else steps, mesh=config.mesh)
    except ValueError as e:
      raise UsageError(f"--warmup {width}x{height}x{frames}{'' if steps is None else f'x{steps}'} / --mesh "
                       f"{config.mesh}: {e}") from e
  for name, path, _ in config.loras:
    try:
      lora.parse_lora(*lora.read_lora(path)[:2], facts.transformer, where=path)
    except ValueError as e:
      raise UsageError(f"--lora {name}={path}: {e}") from e


def build_service(config: ServeConfig) -> Any:
  """The `Service` of a checked config (JAX started, model not yet loaded)."""
  from attention.mesh import MeshSpec, request_cpu_devices
  from pipelines.pipeline import compile_cache
  from pipelines.serve.service import Service

  if config.mesh is not None:
    try:
      request_cpu_devices(MeshSpec.parse(config.mesh).devices)
    except ValueError as e:
      raise UsageError(f"--mesh {config.mesh}: {e}") from e
  compile_cache.enable(config.compile_cache)
  facts = model_facts(config)
  check(config, facts)
  return Service(config, facts, loader(config))


def main(argv: list[str] | None = None) -> int:
  import uvicorn

  from pipelines.serve.app import create_app

  try:
    config = parse(argv)
    service = build_service(config)
  except (UsageError, OSError) as e:
    print(f"serve: error: {e}", file=sys.stderr)
    return 2
  if config.public() and config.api_key is None:
    print(f"serve: warning: listening on {config.host} without --api-key: anyone who reaches this port can "
          "queue videos", file=sys.stderr)
  service.start()
  print(f"serve: http://{config.host}:{config.port}/ (model {service.facts.name}, mesh {config.mesh or 'one device'}, "
        f"data {config.data_dir}); /health says when the model is ready", file=sys.stderr, flush=True)
  try:
    uvicorn.run(create_app(service), host=config.host, port=config.port, log_level="warning")
  finally:
    service.stop()
  return 0


def cli() -> None:
  sys.exit(main())


if __name__ == "__main__":
  cli()
