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
imported on first use, so that the JAX-free modules
(`pipelines.commands`, `storage`, `parallel.distributed`) load without starting to import JAX.
"""

__all__ = ["GenerationResult", "WanImageToVideoPipeline", "WanPipeline", "WanVACEPipeline", "WanVideoToVideoPipeline"]


def __getattr__(name: str):
  if name == "WanImageToVideoPipeline":
    from pipelines.pipeline import image_pipeline
    return image_pipeline.WanImageToVideoPipeline
  if name == "WanVideoToVideoPipeline":
    from pipelines.pipeline import video_pipeline
    return video_pipeline.WanVideoToVideoPipeline
  if name == "WanVACEPipeline":
    from pipelines.pipeline import vace_pipeline
    return vace_pipeline.WanVACEPipeline
  if name in __all__:
    from pipelines.pipeline import wan_pipeline
    return getattr(wan_pipeline, name)
  raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
