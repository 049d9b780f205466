"""Context windows that continue (`context_fuse="continue"`): a long video as its windows run one
after another, each a whole denoising of one window's frames that is given the frames it shares
with the windows before it (`wan.conditioning.ContextWindows.continued`).

Window k is an ordinary run of one clip (a `Runner` of a window-sized request): its noise is the
video's initial noise at its frames (so a seed names the whole video), and for k > 0 its first
`given` latent frames are the video's latents there so far, given as a Wan 2.2 TI2V model's first
frame is (the transformer's input replaced there at every step, per-token timestep 0 on their
tokens: `wan.conditioning.ti2v`; any Wan transformer takes per-token timesteps). The first window
is the video's start: a TI2V request's image conditions it alone. The windows' latents make the
video's, decoded once. The parallel blend (`wan.conditioning.windows.blend`) reconciles windows
only through their overlaps' averaged predictions; a model trained to continue (docs/measurements/training.md,
"Training the tiny models further") carries a motion across every boundary this way.

Glossary (DESIGN.md section 1): B' videos, C latent channels, F / Hl / Wl latent frames / height /
width, Lw a window's latent frames.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from pipelines.parallel import distributed
from pipelines.pipeline.run import resume as resume_state
from pipelines.pipeline.run.call_options import CallOptions
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run.resume import ResumeConfig
from pipelines.pipeline.run.runner import GenerationResult, Runner


def window_request(request: GenerationRequest, latents: np.ndarray, start: int, given: int) -> GenerationRequest:
  """The request of one window that continues: its frames of `latents` (float32 [B', C, F, Hl, Wl],
  the video's: the initial noise where not yet denoised) as its initial latents, the first `given`
  of them given (`first_frame_latents`), no decode; the video's image (TI2V) on the first window only.

  Raises:
    ValueError: a window outside the video's latent frames.
  """
  windows = request.windows
  if not (0 <= start and start + windows.length <= latents.shape[2] and 0 <= given < windows.length):
    raise ValueError(f"window at latent frame {start} (given {given}) does not fit {latents.shape[2]} latent frames "
                     f"in windows of {windows.length}")
  frames = latents[:, :, start:start + windows.length]
  first = request.first_frame_latents if start == 0 else (np.ascontiguousarray(frames[:, :, :given]) if given
                                                          else None)
  return dataclasses.replace(
      request, num_frames=windows.video_frames(request.model.temporal_factor)[0], windows=None, decode=False,
      latent_shape=(*request.latent_shape[:2], windows.length, *request.latent_shape[3:]),
      latents=np.ascontiguousarray(frames), seed=None, image=request.image if start == 0 else None,
      first_frame_latents=first)


def window_resume(config: ResumeConfig | None, window: int) -> ResumeConfig | None:
  """Window `window`'s resumable denoising: its checkpoint in `resume.window_dir` of the run's
  folder, resumed when the run resumes and the window has one (a window not reached yet starts; one
  finished and removed runs again, to the same latents: its noise and given frames are the same)."""
  if config is None:
    return None
  folder = resume_state.window_dir(config.checkpoint_dir, window)
  return dataclasses.replace(config, checkpoint_dir=folder,
                             resume=config.resume and os.path.isfile(resume_state.state_path(folder)))


def run_continued(pipe: Any, request: GenerationRequest, options: CallOptions) -> GenerationResult:
  """Runs a request whose windows continue (`request.windows.fuse == "continue"`): each window a
  `Runner` run (`window_request`) with the call's options (progress, hooks and callbacks run per
  window; resumable denoising per window, `window_resume`), the video's latents assembled, then one
  decode.

  Returns:
    A `GenerationResult`: frames float32 [B', frames, H, W, 3] (None without decode), the video's
    latents float32 [B', C, F, Hl, Wl], timings summed over the windows, settings the request's with
    the windows' runs ("windows_run", "steps_run" over all, each window's step-cache summary).
    An interrupt (diffusers' `interrupt`) stops after the running window: the frames no window
    reached are their noise.

  Raises:
    resume.ResumeError: resume without any window's checkpoint in the folder; a window's checkpoint
      of another run or in the way of a new run (`Runner`), before that window denoises.
  """
  config = options.resume
  if config is not None and config.resume and not resume_state.holds_checkpoint(config.checkpoint_dir):
    raise resume_state.ResumeError(f"resume=True but {config.checkpoint_dir!r} holds no denoising checkpoint of "
                                   "windows that continue (window-K folders); run without resume to start over")
  start_time = time.perf_counter()
  latents = np.array(request.noise(), np.float32)
  timings: dict[str, float] = {}
  runs = []
  for k, (start, given) in enumerate(request.windows.continued()):
    window = dataclasses.replace(options, resume=window_resume(config, k))
    result = Runner(pipe, window_request(request, latents, start, given), window).run()
    latents[:, :, start:start + request.windows.length] = np.asarray(result.latents)
    runs.append(result.settings)
    for name, seconds in result.timings.items():
      timings[name] = timings.get(name, 0.0) + seconds
    if pipe.interrupt:
      break
  if config is not None and not config.keep and not pipe.interrupt and distributed.is_main_process():
    resume_state.remove(config.checkpoint_dir)  # the windows removed theirs: the folder, if left empty
  return _result(pipe, request, options, latents, timings, runs, time.perf_counter() - start_time)


def _result(pipe: Any, request: GenerationRequest, options: CallOptions, latents: np.ndarray,
            timings: dict[str, float], runs: list[dict[str, Any]], seconds: float) -> GenerationResult:
  """The video's latents decoded once (with `request.decode`), the windows' timings and settings."""
  timings["denoise_per_step"] = timings.get("denoise", 0.0) / max(sum(s["steps_run"] for s in runs), 1)
  start = time.perf_counter()
  frames = None
  if request.decode:
    frames = pipe.decode(latents, mesh=request.plan.decode_mesh, compile_effort=options.decode_compile_effort)
  timings["decode"] = time.perf_counter() - start
  timings["total"] = seconds + timings["decode"]
  resumed = [s["resumed_from_step"] for s in runs]
  settings = {**request.settings(), "experts_per_step": runs[0]["experts_per_step"],
              "resumed_from_step": None if all(r is None for r in resumed) else resumed,
              "steps_run": sum(s["steps_run"] for s in runs), "windows_run": len(runs),
              "step_cache": None if request.step_cache is None else [s["step_cache"] for s in runs],
              "decode_compile_effort": runs[0]["decode_compile_effort"], "vae_dtype": runs[0]["vae_dtype"]}
  return GenerationResult(frames=frames, latents=latents, timings=timings, settings=settings)
