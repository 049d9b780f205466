"""Wan text-to-video in JAX: models under `pipelines.wan`, the pipeline, and the `generate` command.

`WanPipeline` and `GenerationResult` are imported on first use, so that the JAX-free modules
(`pipelines.cli`, `checkpoint`, `distributed`, `video_io`) load without starting to import JAX.
"""

__all__ = ["GenerationResult", "WanPipeline"]


def __getattr__(name: str):
  if name in __all__:
    from pipelines import pipeline
    return getattr(pipeline, name)
  raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
