"""Wan video-to-video (diffusers' `WanVideoToVideoPipeline`): a text-to-video Wan folder that starts
from a video instead of pure noise.

Everything but the start is `WanPipeline`'s (the request, the runner, the compiled step, the loop,
decoding): the request carries the video and `strength` (`video_inputs.VideoInputs`); its schedule
is the tail of the `num_inference_steps` schedule from step N - int(N x strength) on, run by a fresh
solver (`UniPCSchedule.tail`); the loop starts from the video encoded by the VAE and noised to that
step's sigma (`WanPipeline.initial_latents`). `seed` keeps its meaning: the noise mixed in is the
array that `seed` gives a text-to-video call of the same latent shape. Given `latents` (diffusers'
meaning: the already noised start), the loop starts from them as they are, at the same step.

Source: diffusers `pipelines/wan/pipeline_wan_video2video.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelines.pipeline.checked.video_inputs import video_length
from pipelines.pipeline.wan_pipeline import WanPipeline


class WanVideoToVideoPipeline(WanPipeline):
  """Video-to-video Wan; build with `from_pretrained(folder)` of a diffusers text-to-video folder
  (`WanPipeline` or `WanVideoToVideoPipeline`), call with a video and prompts (`__call__`)."""

  video_to_video = True

  def __call__(self, video: Any = None, prompt: Any = None, negative_prompt: Any = None, height: int | None = None,
               width: int | None = None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
               strength: float = 0.8, seed: int | Sequence[int] | None = None, latents: Any = None,
               max_sequence_length: int | None = None, mesh: Any = None, **kwargs: Any) -> Any:
    """Generates videos from a video; diffusers `WanVideoToVideoPipeline.__call__(...).frames`.

    Args:
      video: the frames (a list of PIL images, as diffusers takes, or numpy uint8 [F, H, W, 3] /
        float [F, H, W, 3] in [0, 1]; resized to height x width); its 4k + 1 first frames are used
        (the VAE's groups of 4) and give the video's length.
      strength: in (0, 1]: the last int(num_inference_steps x strength) steps run, from the video
        noised to the first one's sigma (1: from nearly pure noise; diffusers' default 0.8).
      latents: diffusers' meaning: the already noised starting latents, float32 [B', C, F, Hl, Wl]
        (the video is then not encoded, nor are they noised); the run still starts at strength's
        step, as diffusers' (`get_timesteps` whether or not latents are given).
      the rest: as `WanPipeline.__call__` (`call_options.CALL_DOCS`).

    Returns and Raises:
      as `WanPipeline.__call__`; also ValueError for a missing or bad video or strength (before
      any compute).
    """
    if video is None and latents is None:
      raise ValueError("video is required: give the frames to start from (a list of PIL images or an array "
                       "[F, H, W, 3])")
    return super().__call__(prompt, negative_prompt, height, width, kwargs.pop("num_frames", None),
                            num_inference_steps, guidance_scale, seed, latents, max_sequence_length, mesh,
                            video=video, strength=strength, **kwargs)

  def run(self, prompt: Any = None, negative_prompt: Any = None, height: int | None = None, width: int | None = None,
          num_frames: int | None = None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
          seed: Any = None, latents: Any = None, *args: Any, **kwargs: Any) -> Any:
    """`WanPipeline.run` (`__call__` returning a `GenerationResult`); num_frames None: the video's
    length (its first 4k + 1 frames), or the latents' without a video."""
    return super().run(prompt, negative_prompt, height, width, self._frames(num_frames, kwargs.get("video"), latents),
                       num_inference_steps, guidance_scale, seed, latents, *args, **kwargs)

  def check_inputs(self, prompt: Any = None, negative_prompt: Any = None, **kwargs: Any) -> Any:
    """`WanPipeline.check_inputs`; num_frames left out or None: the video's length, as `run`."""
    kwargs["num_frames"] = self._frames(kwargs.get("num_frames"), kwargs.get("video"), kwargs.get("latents"))
    return super().check_inputs(prompt, negative_prompt, **kwargs)

  def _frames(self, num_frames: Any, video: Any, latents: Any) -> Any:
    """`num_frames`, or when None the video's first 4k + 1 frames, else the latents' frames, else None
    (the model's default; the request's checks then name what is missing or wrong)."""
    step = self.facts.temporal_factor
    if num_frames is not None:
      return num_frames
    if video is not None:
      return video_length(video, step) or 1
    shape = getattr(latents, "shape", ())
    return (shape[2] - 1) * step + 1 if len(shape) == 5 else None
