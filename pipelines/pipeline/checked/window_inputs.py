"""A long video's context windows as the call gives them (`context_frames`, `context_overlap`,
`context_fuse`, in video frames), checked into `wan.conditioning.ContextWindows` (latent frames; a
`GenerationRequest` field), and the warning for a long video asked for without them.

Source of the method: ComfyUI's `WanContextWindowsManual` (comfy/context_windows.py); the windows'
layout and blend are `wan.conditioning.windows`'.
"""

from __future__ import annotations

import warnings
from typing import Any

from pipelines.pipeline.checked.inputs import check_int, not_a
from pipelines.pipeline.checked.model_facts import ModelFacts
from pipelines.wan.conditioning import FUSES, ContextWindows


def default_overlap(context_frames: int, temporal_factor: int = 4) -> int:
  """A quarter of the window, in whole latent frames (81 -> 20, 17 -> 4)."""
  return (context_frames - 1) // 4 // temporal_factor * temporal_factor


def check_context_windows(context_frames: Any, context_overlap: Any, context_fuse: Any, *, num_frames: int,
                          model: ModelFacts, windows_degree: int, vace: bool, video: bool = False
                          ) -> ContextWindows | None:
  """The call's context windows (`context_windows`), or None, checked against the mesh and the
  call's other features; without windows, a video longer than the model's trained clip warns
  (`long_video_warning`).

  Args:
    context_frames, context_overlap, context_fuse, num_frames: as `context_windows` takes them;
      context_fuse None: the model's default (`GenerationDefaults.context_fuse`), or "pyramid" where
      that is "continue" and the call cannot continue windows (a W axis, a video, VACE, an I2V model).
    model: the model's facts: its VAE's temporal factor (4), its trained clip.
    windows_degree: the mesh's W (windows run W at once); W > 1 needs windows.
    vace: whether the call is a VACE one (its reference frames are not placed per window yet).
    video: whether the call is a video-to-video one (windows that continue do not take it yet).

  Raises:
    ValueError: each bad value, named with the fix, before anything loads or computes.
  """
  if context_fuse is None:  # the model's (`ModelFacts.defaults`), pyramid where continuing cannot run
    context_fuse = "pyramid" if context_frames is None else model.defaults.context_fuse
    if context_fuse == "continue" and (windows_degree > 1 or video or vace or model.image_to_video):
      context_fuse = "pyramid"
  windows = context_windows(context_frames, context_overlap, context_fuse, num_frames=num_frames,
                            temporal_factor=model.temporal_factor)
  if vace and windows is not None:
    raise ValueError("context windows with a VACE model are not supported yet; leave context_frames out or "
                     "use a text-, image- or video-to-video model")
  if windows is not None and windows.fuse == "continue":
    _check_continued(model, windows_degree, video)
  if windows is None and windows_degree > 1:
    why = (" is not given" if context_frames is None else
           f"={context_frames} is the whole video (one window, nothing to run in parallel)")
    raise ValueError(f"the mesh's W={windows_degree} runs context windows in parallel, but context_frames{why}: "
                     f"give shorter windows (context_frames, e.g. 81 for Wan) or drop W from the mesh")
  if context_frames is None and (note := long_video_warning(model, num_frames)) is not None:
    warnings.warn(note, stacklevel=4)
  return windows


def _check_continued(model: ModelFacts, windows_degree: int, video: bool) -> None:
  """Windows that continue run one after another, each given frames by the one before: not over a
  windows axis, not with a model that conditions through its input channels (Wan 2.1 / 2.2 I2V:
  its later windows would need the condition's channels made from the given frames), not from a
  video (video-to-video)."""
  fix = "or use context_fuse='pyramid' (windows blended at every step)"
  if windows_degree > 1:
    raise ValueError(f"context_fuse='continue' runs the windows one after another, so the mesh's W={windows_degree} "
                     f"has nothing to run in parallel: drop W from the mesh, {fix}")
  if model.image_to_video:
    raise ValueError(f"context_fuse='continue' gives a window its frames by per-token timesteps; {model.name!r} "
                     f"conditions through its input channels (image-to-video): {fix}")
  if video:
    raise ValueError(f"context_fuse='continue' does not take a video to start from (video-to-video) yet: {fix}")


def context_windows(context_frames: Any, context_overlap: Any, context_fuse: Any, *, num_frames: int,
                    temporal_factor: int = 4) -> ContextWindows | None:
  """The windows the values give, in latent frames, or None (no windows; a window as long as the
  video is none).

  Args:
    context_frames: None, or a window's video frames, k x temporal_factor + 1 and <= num_frames.
    context_overlap: None (`default_overlap`), or the video frames neighbouring windows share at least: a
      multiple of temporal_factor, below context_frames.
    context_fuse: "pyramid" (default) or "flat" (windows blended at every step), or "continue"
      (windows one after another, each continuing the one before: `ContextWindows.continued`).
    num_frames: the video's frames (4k + 1).

  Raises:
    ValueError: each bad value, named with the fix.
  """
  if context_frames is None:
    for name, value, default in (("context_overlap", context_overlap, None), ("context_fuse", context_fuse, "pyramid")):
      if value != default:
        raise ValueError(f"{name}={value!r} without context_frames: give context_frames (a window's frames, "
                         f"e.g. 81 for Wan) too, or leave {name} out")
    return None
  frames = check_int("context_frames", context_frames, minimum=1, hint=" (a window's frames, e.g. 81)")
  if (frames - 1) % temporal_factor:
    low = (frames - 1) // temporal_factor * temporal_factor + 1
    raise ValueError(f"context_frames={frames} must be {temporal_factor}k + 1 (the VAE's frame groups); "
                     f"use {low} or {low + temporal_factor}")
  if frames > num_frames:
    raise ValueError(f"context_frames={frames} is longer than the video (num_frames={num_frames}); use at "
                     f"most {num_frames}, or leave context_frames out for one clip")
  overlap = default_overlap(frames, temporal_factor) if context_overlap is None else check_int(
      "context_overlap", context_overlap, minimum=0, hint=" (frames shared by neighbouring windows)")
  if overlap % temporal_factor or overlap >= frames:
    raise ValueError(f"context_overlap={overlap} must be a multiple of {temporal_factor} below context_frames="
                     f"{frames} (e.g. {default_overlap(frames, temporal_factor)})")
  if not isinstance(context_fuse, str) or context_fuse not in FUSES:
    raise ValueError(f"context_fuse={context_fuse!r}{not_a(context_fuse) if not isinstance(context_fuse, str) else ''}"
                     f" must be one of {FUSES}")
  if frames == num_frames:
    return None
  return ContextWindows(frames=(num_frames - 1) // temporal_factor + 1, length=(frames - 1) // temporal_factor + 1,
                        overlap=overlap // temporal_factor, fuse=context_fuse)


def long_video_warning(model: ModelFacts, num_frames: int) -> str | None:
  """`long_video_note` for this model: none for a one-size model (`ModelFacts.trained_video`), whose
  own warning (`ModelFacts.outside_training`) names windows already."""
  trained = None if model.trained_video else model.trained_frames
  return long_video_note(num_frames, trained, temporal_factor=model.temporal_factor)


def long_video_note(num_frames: int, trained_frames: int | None, *, temporal_factor: int = 4) -> str | None:
  """The warning for a video longer than the model's trained clip without context windows, naming
  the arguments that keep its length (`generate` prints them as its flags), or None."""
  if trained_frames is None or num_frames <= trained_frames:
    return None
  overlap = default_overlap(trained_frames, temporal_factor)
  return (f"{num_frames} frames is longer than the model's trained {trained_frames}-frame clips: the video "
          f"degrades (and attention memory grows with the square of the frames); keep the length with context "
          f"windows: context_frames={trained_frames}, context_overlap={overlap} (and W=2 in the mesh to run the "
          "windows in parallel)")
