"""One generation: the checked request, the compiled step, the denoising loop, resume state and
`WanPipeline`. Imports `pipelines.wan` and the layers below it.

`WanPipeline` and friends are imported on first use, so that `inputs`, `resume` and
`compile_cache` load without importing JAX's model code.
"""

from pipelines.wan import lazy_attributes

_HOMES = (
    ("pipelines.pipeline.hooks", ("NonFiniteLatentsError",)),
    ("pipelines.pipeline.image_pipeline", ("WanImageToVideoPipeline",)),
    ("pipelines.pipeline.loading", ("DTYPES",)),
    ("pipelines.pipeline.runner", ("GenerationResult",)),
    ("pipelines.pipeline.wan_pipeline", ("WanPipeline",)),
    ("pipelines.wan.pretrained.tiny", ("TINY_DEFAULT_FOLDER", "TINY_SCHEDULER", "TINY_SEED", "TINY_TRANSFORMER")),
)

__all__ = sorted(name for _, names in _HOMES for name in names)

__getattr__ = lazy_attributes(__name__, _HOMES)
