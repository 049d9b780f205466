"""Wan VACE (diffusers' `WanVACEPipeline`): one model for reference-to-video, video-to-video with a
mask (inpainting, outpainting), control videos (pose, depth, ...) and first/last frames.

Everything but the VACE context is `WanPipeline`'s (the request, the runner, the compiled step, the
loop, decoding, both experts of a Wan 2.2 VACE-Fun folder): the request carries the video, mask,
reference images and per-layer scales (`vace_inputs.VACEInputs`); once before the loop they are
encoded into the VACE context (`vace_inputs.conditioning`), which every step's transformer reads
beside the latents (`wan.conditioning.VACEConditioning`); the reference images' latent frames sit
in front of the video's and are dropped before decoding. A `WanPipeline` of the same folder runs
the same way (the model decides, not the class); this class gives diffusers' argument order.

Source: diffusers `pipelines/wan/pipeline_wan_vace.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelines.pipeline.checked.video_inputs import video_length
from pipelines.pipeline.wan_pipeline import WanPipeline


class WanVACEPipeline(WanPipeline):
  """VACE Wan; build with `from_pretrained(folder)` of a diffusers `WanVACEPipeline` folder (Wan 2.1
  VACE 1.3B / 14B; Wan 2.2 VACE-Fun A14B with transformer_2 and boundary_ratio), call with prompts
  and any of video, mask, reference images (`__call__`)."""

  def __init__(self, **parts: Any):
    super().__init__(**parts)
    if not self.transformer_config.has_vace:
      raise ValueError("this transformer has no VACE blocks (its config.json has no vace_layers): load the folder "
                       "with WanPipeline, or give a Wan VACE folder")

  def __call__(self, prompt: Any = None, negative_prompt: Any = None, video: Any = None, mask: Any = None,
               reference_images: Any = None, conditioning_scale: float | Sequence[float] = 1.0, height: int | None = None,
               width: int | None = None, num_frames: int | None = None, num_inference_steps: int | None = None,
               guidance_scale: float | None = None, seed: int | Sequence[int] | None = None, latents: Any = None,
               max_sequence_length: int | None = None, mesh: Any = None, **kwargs: Any) -> Any:
    """Generates videos; diffusers `WanVACEPipeline.__call__(...).frames`.

    Args:
      video: the frames to condition on (a list of PIL images or an array [F, H, W, 3], uint8 or float
        in [0, 1]), resized to height x width; its first 4k + 1 frames are used (the VAE's groups of
        4; the rest are dropped with a warning); None: none (zeros, every pixel generated).
      mask: which pixels to generate (white, 1) and which to keep from the video (black, 0): one image
        for every frame or one per frame, in the video's size; None: generate everything. Needs video.
      reference_images: an image or a list of images (subjects, styles) the video should show; each
        adds one latent frame in front of the video's, dropped before decoding.
      conditioning_scale: the VACE hints' weight, one number or one per VACE layer.
      num_frames: the video's length (None: the video's first 4k + 1 frames, or the model's default,
        81 for a folder without `generation_defaults.json`, without a video).
      the rest: as `WanPipeline.__call__` (`call_options.CALL_DOCS`).

    Returns and Raises:
      as `WanPipeline.__call__`; also ValueError for bad VACE inputs (before any compute).
    """
    return super().__call__(prompt, negative_prompt, height, width, num_frames, num_inference_steps,
                            guidance_scale, seed, latents, max_sequence_length, mesh, video=video, mask=mask,
                            reference_images=reference_images, conditioning_scale=conditioning_scale, **kwargs)

  def run(self, prompt: Any = None, negative_prompt: Any = None, height: int | None = None, width: int | None = None,
          num_frames: int | None = None, *args: Any, **kwargs: Any) -> Any:
    """`WanPipeline.run` (`__call__` returning a `GenerationResult`); num_frames None: the video's
    length, its first 4k + 1 frames (the model's default without a video)."""
    return super().run(prompt, negative_prompt, height, width, self._frames(num_frames, kwargs.get("video")),
                       *args, **kwargs)

  def check_inputs(self, prompt: Any = None, negative_prompt: Any = None, **kwargs: Any) -> Any:
    """`WanPipeline.check_inputs`; num_frames left out or None: the video's length, as `run`."""
    kwargs["num_frames"] = self._frames(kwargs.get("num_frames"), kwargs.get("video"))
    return super().check_inputs(prompt, negative_prompt, **kwargs)

  def _frames(self, num_frames: Any, video: Any) -> Any:
    """`num_frames`, or when None the video's first 4k + 1 frames (as video-to-video), or None (the
    model's default; a video of no length is then named by the request's checks)."""
    if num_frames is not None:
      return num_frames
    return None if video is None else video_length(video, self.facts.temporal_factor)
