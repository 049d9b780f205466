"""Tests for pipelines/pipeline/video_pipeline.py: `WanVideoToVideoPipeline` against diffusers'
`WanVideoToVideoPipeline` live, fp32, on the embedded tiny folder (a diffusers `WanPipeline` folder,
as diffusers' video-to-video loads it): the same video, prompts and starting noise (diffusers'
`randn_tensor` patched to return the array `seed` gives ours), two strengths, one device and
U=2,R=2, non-square, 9 frames (and 10, of which the VAE uses 9); and `latents=` without a video
(diffusers' meaning: the already noised start, run from strength's step as diffusers' `get_timesteps`
does whether or not latents are given), one device and U=2,R=2.

Bar: FP32_VIDEO_PSNR_DB's analysis covers these runs (the encode adds one VAE pass, within the
same 1e-4 of range); measured in tests/numerics.py's terms. The start from latents has no encode:
bar 90 dB (measured ~129 dB; 15 dB while every step ran whatever the strength). Controls: another
video changes diffusers' output by far more (< 60 dB), and so does the whole schedule from the same
latents, so no case passes vacuously.
"""

from __future__ import annotations

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
import torch  # noqa: E402

from pipelines.pipeline.checked.request import GenerationRequest  # noqa: E402
from pipelines.pipeline.video_pipeline import WanVideoToVideoPipeline  # noqa: E402
from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER  # noqa: E402
from tests.numerics import FP32_VIDEO_PSNR_DB, assert_psnr_at_least  # noqa: E402

PROMPT, NEGATIVE = "a red square moving right", "blurry"
CALL = dict(height=32, width=48, num_inference_steps=4, guidance_scale=5.0, max_sequence_length=16)


def psnr(a, b) -> float:
  rms = float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))
  return float("inf") if rms == 0 else -20 * np.log10(rms)


def _video(frames: int = 9, flip: bool = False) -> np.ndarray:
  """uint8 [frames, 32, 48, 3]: a bright square sliding over a gradient."""
  y, x = np.mgrid[0:32, 0:48]
  video = []
  for f in range(frames):
    frame = np.stack([x * 5, y * 7, np.full_like(x, 60)], axis=-1).astype(np.float64)
    left = 4 + 3 * f
    frame[8:20, left:left + 12] = (250, 240, 30)
    video.append(frame[:, ::-1] if flip else frame)
  return np.clip(np.asarray(video), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def reference():
  pipe = diffusers.WanVideoToVideoPipeline.from_pretrained(TINY_DEFAULT_FOLDER)
  pipe.set_progress_bar_config(disable=True)
  return pipe


@pytest.fixture(scope="module")
def ours():
  pipe = WanVideoToVideoPipeline.from_pretrained(TINY_DEFAULT_FOLDER)
  pipe.set_progress_bar_config(disable=True)
  return pipe


def _diffusers(reference, ours, video: np.ndarray, strength: float, monkeypatch) -> np.ndarray:
  """diffusers' video for `video` with the noise of our seed 0."""
  import PIL.Image

  from diffusers.pipelines.wan import pipeline_wan_video2video as module

  used = (len(video) - 1) // 4 * 4 + 1
  noise = GenerationRequest.build(ours.facts, PROMPT, NEGATIVE, num_frames=used, seed=0, **CALL).noise()
  monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: torch.from_numpy(noise.copy()))
  with torch.no_grad():
    frames = reference(video=[PIL.Image.fromarray(f) for f in video], prompt=PROMPT, negative_prompt=NEGATIVE,
                       strength=strength, output_type="np", **CALL).frames
  return np.asarray(frames)


@pytest.mark.parametrize("strength", [0.5, 0.75])
@pytest.mark.parametrize("mesh", [None, "U=2,R=2"])
def test_matches_diffusers(reference, ours, monkeypatch, strength, mesh):
  video = _video()
  want = _diffusers(reference, ours, video, strength, monkeypatch)
  got = ours(video, PROMPT, NEGATIVE, strength=strength, seed=0, mesh=mesh, **CALL)
  assert got.shape == want.shape == (1, 9, 32, 48, 3)
  assert_psnr_at_least(got, want, FP32_VIDEO_PSNR_DB, name=f"video-to-video {strength=} {mesh=}")
  if mesh is None and strength == 0.5:  # controls: another video, or text-to-video, is far from it
    flipped = _diffusers(reference, ours, _video(flip=True), strength, monkeypatch)
    assert psnr(flipped, want) < 60
    text_only = ours.__class__.__mro__[1].__call__(ours, PROMPT, NEGATIVE, num_frames=9, seed=0, **CALL)
    assert psnr(text_only, want) < 60


def test_ten_frames_use_nine_and_latents_keep_diffusers_meaning(reference, ours, monkeypatch):
  """A 10-frame video: the VAE's 4k + 1 = 9 frames are used (warned), as diffusers' VAE drops the
  10th; `latents=` are the noised start itself (the video is not encoded), as in diffusers."""
  video = _video(10)
  want = _diffusers(reference, ours, video, 0.75, monkeypatch)
  with pytest.warns(UserWarning, match="the last 1 are not used"):
    got = ours(video, PROMPT, NEGATIVE, strength=0.75, seed=0, **CALL)
  assert_psnr_at_least(got, want, FP32_VIDEO_PSNR_DB, name="10 frames")
  start = ours(video[:9], PROMPT, NEGATIVE, strength=0.75, seed=0, output_type="latent",
               **{**CALL, "num_inference_steps": 4})  # the denoised latents: a valid start too
  again = ours(None, PROMPT, NEGATIVE, strength=0.75, latents=start, **CALL)
  direct = ours(video[:9], PROMPT, NEGATIVE, strength=0.75, seed=0, **CALL)
  assert again.shape == direct.shape and psnr(again, direct) < 60  # started from `start`, not from the video


@pytest.mark.parametrize("mesh", [None, "U=2,R=2"])
def test_latents_start_at_the_strengths_step_as_in_diffusers(reference, ours, mesh):
  """`latents=` and no video: the start as given (not encoded, not noised again), the last
  int(4 x 0.8) = 3 steps run, as diffusers runs them; a text-to-video request's latents still run
  every step (the pipeline's kind decides what latents are)."""
  latents = np.random.default_rng(5).standard_normal((1, 16, 3, 4, 6)).astype(np.float32)
  call = dict(CALL, num_frames=9)
  assert ours.check_inputs(PROMPT, NEGATIVE, strength=0.8, latents=latents, **call).steps_run == 3
  assert GenerationRequest.build(ours.facts, PROMPT, NEGATIVE, strength=0.8, latents=latents, **call).steps_run == 4
  with torch.no_grad():
    want = np.asarray(reference(video=None, latents=torch.from_numpy(latents.copy()), prompt=PROMPT,
                                negative_prompt=NEGATIVE, strength=0.8, output_type="np", **CALL).frames)
  got = ours(None, PROMPT, NEGATIVE, strength=0.8, latents=latents, mesh=mesh, **CALL)
  assert_psnr_at_least(got, want, 90.0, name=f"video-to-video from latents, {mesh=}")
  if mesh is None:  # control: the whole schedule from the same latents is another video
    assert psnr(ours(None, PROMPT, NEGATIVE, strength=1.0, latents=latents, **CALL), want) < 60


def test_a_strength_that_runs_no_step_is_refused_from_latents_too(ours):
  latents = np.zeros((1, 16, 3, 4, 6), np.float32)
  with pytest.raises(ValueError, match=r"strength=0.1 with num_inference_steps=4 runs no step"):
    ours.check_inputs(PROMPT, NEGATIVE, num_frames=9, latents=latents, **{**CALL, "strength": 0.1})


@pytest.mark.parametrize("kwargs,match", [
    (dict(strength=0.0), r"strength=0.0 must be a number in \(0, 1\]$"),  # a float, out of range: no type named
    (dict(strength=1.5), r"strength=1.5 must be a number in \(0, 1\]$"),
    (dict(strength=np.float32("nan")), r"strength=np.float32\(nan\) must be a number in \(0, 1\]$"),
    (dict(strength="high"), r"strength='high' must be a number in \(0, 1\], not a str$"),  # the control
    (dict(strength=0.1, num_inference_steps=4), r"runs no step .* raise strength to >= 0.25"),
    (dict(num_frames=17), r"num_frames=17 differs from the video's 9 frames"),
    (dict(step_cache="mag"), r"step_cache='mag' with a video"),
])
def test_bad_arguments_are_refused_before_any_compute(ours, kwargs, match):
  args = {**CALL, **kwargs}
  with pytest.raises(ValueError, match=match):
    GenerationRequest.build(ours.facts, PROMPT, NEGATIVE, num_frames=args.pop("num_frames", 9),
                            video=_video(), **args)


def test_run_and_check_inputs_take_the_videos_length_as_call_does(ours):
  """run(video=...) and check_inputs(video=...) without num_frames: the video's first 4k + 1 frames (not
  81, then refused), the video `__call__` makes (the control: __call__ took the video's length before too);
  from latents alone, their frames."""
  call = dict(CALL, num_inference_steps=2, strength=0.5)
  with pytest.warns(UserWarning, match="the last 3 are not used"):
    assert ours.check_inputs(PROMPT, video=_video(12), **call).num_frames == 9
  latents = np.zeros((1, 16, 4, 4, 6), np.float32)
  assert ours.check_inputs(PROMPT, latents=latents, **call).num_frames == 13
  with pytest.warns(UserWarning, match="the last 3 are not used"):
    result = ours.run(PROMPT, video=_video(12), seed=0, **call)
  assert result.frames.shape == (1, 9, 32, 48, 3)
  np.testing.assert_array_equal(result.frames, ours(_video(9), PROMPT, seed=0, **call))
