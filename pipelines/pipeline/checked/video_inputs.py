"""The video of a video-to-video call (`video`, `strength`; diffusers' `WanVideoToVideoPipeline`),
checked into `VideoInputs` (a `GenerationRequest` field), and what the run makes of them: the frames
at the video's size in [-1, 1] (diffusers' `VideoProcessor.preprocess_video`) and the step the
denoising starts from. A video-to-video call may give its start as `latents` instead of a video
(diffusers' meaning: the already noised start): then no frames, and `strength` still says the step
the denoising starts from (diffusers' `get_timesteps` runs whether or not latents are given; only
`prepare_latents`' encode and noising is skipped).

Frames are HWC with 3 channels, each in one of `image_inputs.IMAGE_FORMS` (a list of PIL images as
diffusers takes, or numpy uint8 [F, H, W, 3], or float [F, H, W, 3] in [0, 1]). The VAE encodes a
first frame and then groups of `temporal_factor` (4) frames, so only 4k + 1 frames are used:
diffusers' VAE drops the rest silently; here they are dropped with a warning.

Source: diffusers `pipelines/wan/pipeline_wan_video2video.py` (`get_timesteps`, `prepare_latents`).
"""

from __future__ import annotations

import dataclasses
import reprlib
import warnings
from typing import Any

import numpy as np

from pipelines.pipeline.checked.image_inputs import digest, image_array, to_video_frame
from pipelines.pipeline.checked.inputs import is_real, not_a


@dataclasses.dataclass(frozen=True)
class VideoInputs:
  """The checked video of a video-to-video request.

  Attributes:
    frames: numpy [F, H0, W0, 3], F = 4k + 1: uint8 as given (PIL images become uint8 RGB), or
      float32 in [0, 1]; None when the call's `latents` are the start (already noised, not
      encoded: diffusers' `WanVideoToVideoPipeline(latents=...)`).
    strength: in (0, 1]: the share of the schedule that runs; the encoded video is noised to the
      first running step's sigma (1: the whole schedule, from sigma_max ~ 1, nearly pure noise).
  """
  frames: np.ndarray | None
  strength: float

  def start(self, steps: int) -> int:
    """The first of `steps` schedule steps that runs (diffusers' `get_timesteps`: the last
    int(steps * strength) steps run)."""
    return steps - min(int(steps * self.strength), steps)

  def digests(self) -> dict[str, Any]:
    """What the sidecar and a resumed run record: the frames' SHA-256 and the strength."""
    return {"video_sha256": digest(self.frames), "strength": self.strength}

  def pixels(self, height: int, width: int) -> np.ndarray:
    """float32 [1, 3, F, height, width] in [-1, 1]: each frame resized as diffusers' video processor
    does (`image_inputs.to_video_frame`)."""
    return np.stack([to_video_frame(frame, height, width) for frame in self.frames], axis=1)[None]


def check_video_inputs(video: Any, strength: Any, *, num_frames: Any, steps: int, temporal_factor: int,
                       video_model: bool, from_latents: bool = False) -> VideoInputs | None:
  """`video` and `strength` checked against the call.

  Args:
    num_frames: the call's frame count (None: the video's).
    steps: the schedule's steps (at least one must run at this strength).
    temporal_factor: frames per latent frame after the first (4).
    video_model: the model can start from a video (a text-to-video Wan: not image-to-video, not TI2V).
    from_latents: a video-to-video call whose `latents` are its start: without a video, the
      result has no frames and `strength` still sets the first step (else None: text-to-video).

  Raises:
    ValueError: naming the argument and the fix: a video (or a video-to-video start) for another
      kind of model, frames not in one of the image forms or of different sizes, fewer than 1
      frame, num_frames that differs from the video's, strength not a number in (0, 1], or one
      that runs no step.
  """
  if not is_real(strength) or not 0 < strength <= 1:  # a number out of range is not named by its type
    raise ValueError(f"strength={strength!r} must be a number in (0, 1]{not_a(strength, is_real(strength))}")
  if video is None and not from_latents:
    return None
  if not video_model:
    given, fix = ("video", "leave video out") if video is not None else ("video-to-video latents", "use WanPipeline")
    raise ValueError(f"{given} given, but this model cannot start from a video (video-to-video runs on a "
                     f"text-to-video Wan folder: WanVideoToVideoPipeline); {fix}")
  if video is None:
    return _runs_a_step(VideoInputs(frames=None, strength=float(strength)), steps)
  frames = video_frames("video", video)
  used = (len(frames) - 1) // temporal_factor * temporal_factor + 1
  if used != len(frames):
    warnings.warn(f"video has {len(frames)} frames; the VAE encodes 4k + 1 of them, so the last "
                  f"{len(frames) - used} are not used (as diffusers' VAE drops them)", stacklevel=3)
    frames = frames[:used]
  if num_frames is not None and num_frames != used:
    raise ValueError(f"num_frames={num_frames!r} differs from the video's {used} frames; leave num_frames "
                     "out (a video-to-video call takes its length from the video)")
  return _runs_a_step(VideoInputs(frames=frames, strength=float(strength)), steps)


def video_length(video: Any, temporal_factor: int) -> int | None:
  """The frames a call on `video` makes when num_frames is left out: the count of its first 4k + 1
  frames, those the VAE encodes (1 for an empty video, which the checks refuse); None when `video`
  has no length (the checks name it)."""
  try:
    count = len(video)
  except TypeError:
    return None
  return max(count - 1, 0) // temporal_factor * temporal_factor + 1


def _runs_a_step(inputs: VideoInputs, steps: int) -> VideoInputs:
  """`inputs` if its strength runs at least one of `steps` steps.

  Raises:
    ValueError: naming strength, the steps and the fix."""
  if inputs.start(steps) >= steps:
    raise ValueError(f"strength={inputs.strength!r} with num_inference_steps={steps} runs no step (int(steps x "
                     f"strength) = 0); raise strength to >= {1 / steps:.3g} or the steps")
  return inputs


def video_frames(name: str, video: Any) -> np.ndarray:
  """The frames of argument `name` as one numpy array [F, H, W, 3] (uint8 or float32 in [0, 1]).

  Raises:
    ValueError: naming `name`: not a list of frames or an array [F, H, W, 3], no frames, a frame in
      none of the image forms, or frames of different sizes or kinds.
  """
  if isinstance(video, np.ndarray) and video.ndim == 4:
    items = list(video)
  elif isinstance(video, (list, tuple)):
    items = list(video)
  else:
    raise ValueError(f"{name}={reprlib.repr(video)} must be a list of frames (PIL images or [H, W, 3] arrays) or "
                     f"an array [F, H, W, 3]{not_a(video)}")
  if not items:
    raise ValueError(f"{name} has no frames; give at least one")
  frames = [image_array(f"{name}[{i}]", frame) for i, frame in enumerate(items)]
  shapes = {f.shape for f in frames}
  kinds = {f.dtype for f in frames}
  if len(shapes) > 1 or len(kinds) > 1:
    raise ValueError(f"{name} frames must share one size and kind, got sizes {sorted(shapes)} and kinds "
                     f"{sorted(str(k) for k in kinds)}")
  return np.stack(frames)
