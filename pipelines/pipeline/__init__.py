"""One generation: the checked request, the compiled step, the denoising loop, resume state and
`WanPipeline`. Imports `pipelines.wan` and the layers below it.

`WanPipeline` and friends are imported on first use, so that `inputs`, `resume` and
`compile_cache` load without importing JAX's model code.
"""

_EXPORTS = ("WanPipeline", "GenerationResult", "NonFiniteLatentsError", "TINY_TRANSFORMER",
            "TINY_DEFAULT_FOLDER", "TINY_SEED", "TINY_SCHEDULER", "DTYPES")

__all__ = [*_EXPORTS, "WanImageToVideoPipeline"]


def __getattr__(name: str):
  if name == "WanImageToVideoPipeline":
    from pipelines.pipeline import image_pipeline
    return image_pipeline.WanImageToVideoPipeline
  if name in _EXPORTS:
    from pipelines.pipeline import wan_pipeline
    return getattr(wan_pipeline, name)
  raise AttributeError(f"module 'pipelines.pipeline' has no attribute {name!r}")
