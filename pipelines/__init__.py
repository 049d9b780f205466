"""Wan video diffusion in JAX, in layers that import only downward (DESIGN.md, Architecture):

  serve/     the `serve` command: an HTTP video service over one loaded pipeline
  cli/       beside it, the `generate` command: flags, run records, outputs, exit codes (neither
             imports the other)
  commands/  what every command line shares: presets, flag pieces (`UsageError`), --help, versions
  pipeline/  one generation: the four pipeline classes over `checked/`, `load/` and `run/`
  wan/       the model: transformer, VAE, UMT5, tokenizer, schedulers, step-cache and LoRA math, folders
  parallel/  where things run: the parallel plan, array and weight placement, processes, planner
  storage/   safetensors reading, atomic writes, video files
  (attention/ and producers/ sit beside storage/, at the bottom.)

`WanPipeline`, `WanImageToVideoPipeline`, `WanVideoToVideoPipeline`, `WanVACEPipeline` and `GenerationResult` are
imported on first use (`lazy_facade`), so that the JAX-free modules
(`pipelines.commands`, `storage`, `parallel.distributed`) load without starting to import JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.pipeline.image_pipeline", ("WanImageToVideoPipeline",)),
    ("pipelines.pipeline.run.runner", ("GenerationResult",)),
    ("pipelines.pipeline.vace_pipeline", ("WanVACEPipeline",)),
    ("pipelines.pipeline.video_pipeline", ("WanVideoToVideoPipeline",)),
    ("pipelines.pipeline.wan_pipeline", ("WanPipeline",)),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
