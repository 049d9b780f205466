"""What a video is conditioned on besides the text: the image-to-video condition (Wan 2.1 I2V /
FLF2V, Wan 2.2 I2V A14B), TI2V-5B's first frame with per-token timesteps, VACE's context (video,
mask, reference images), and video-to-video's start (the input video encoded and noised). Each
conditioning gives the step its `StepInputs` the same way (`transformer_inputs`).

The names below are imported on first use (`lazy_facade`), so that importing the package
imports none of its modules, and a JAX-free module among them loads without JAX.
"""

from lazy_facade import lazy_facade

_HOMES = (
    ("pipelines.wan.conditioning.image", ("ImageConditioning", "encode_condition")),
    ("pipelines.wan.conditioning.inputs", ("StepInputs",)),
    ("pipelines.wan.conditioning.ti2v", ("TI2VConditioning", "encode_image")),
    ("pipelines.wan.conditioning.vace", ("VACEConditioning", "mask_channels", "vace_context")),
    ("pipelines.wan.conditioning.video", ("encode_video", "noised")),
    ("pipelines.wan.conditioning.windows", ("BLENDS", "FUSES", "ContextWindows", "blend", "real_rows", "tile_text",
                                         "window_inputs")),
)

__all__, __getattr__ = lazy_facade(__name__, _HOMES)
