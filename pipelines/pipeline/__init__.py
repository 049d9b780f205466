"""One generation, in three rooms under the four pipeline classes (`WanPipeline` in wan_pipeline.py,
`WanImageToVideoPipeline`, `WanVideoToVideoPipeline`, `WanVACEPipeline`):

  run/      one run of a checked request: runner, text, conditioning, memory plan, step, loop, hooks,
            resume state, decode, the call's options          (imports checked/ and load/)
  checked/  the checked request: `GenerationRequest`, the model's facts, each kind of input, the seed
  load/     components from folders, single files and the Hub; weight placement; LoRA adapters

Imports `pipelines.wan` and the layers below it (tests/test_architecture.py ranks the rooms). The
names below are imported on first use (`lazy_facade`), so that the JAX-free modules load without JAX's
model code.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.pipeline.checked.request", ("GenerationRequest",)),
    ("pipelines.pipeline.run.call_options", ("CallOptions",)),
    ("pipelines.pipeline.run.hooks", ("NonFiniteLatentsError",)),
    ("pipelines.pipeline.image_pipeline", ("WanImageToVideoPipeline",)),
    ("pipelines.pipeline.load.loading", ("DTYPES",)),
    ("pipelines.pipeline.run.runner", ("GenerationResult",)),
    ("pipelines.pipeline.wan_pipeline", ("WanPipeline",)),
    ("pipelines.wan.pretrained", ("TINY_DEFAULT_FOLDER", "TINY_SCHEDULER", "TINY_SEED", "TINY_TRANSFORMER")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
