"""Context windows that continue (`context_fuse="continue"`, pipelines/pipeline/run/continued.py): the
windows run one after another, each given the frames it shares with the one before.

What is checked, on the random tiny model (fp32, 2 steps; 29 frames = 8 latent frames in windows of
5 overlapping by 2: starts 0 and 3, the second window given 2 latent frames):
- the first window is an ordinary clip: bit for bit the run of its own frames' noise;
- the given frames come out as the first window made them (bit for bit), and they condition the
  second window (positive control: the same window given nothing differs);
- causality: another noise at the second window's own frames leaves the first window's unchanged;
- the second window is the window-sized run given those frames (`window_request` through the
  ordinary runner), so its math is the TI2V conditioning's, checked against diffusers in
  tests/pipelines/wan/conditioning/test_ti2v.py (one given frame) and for several below;
- a TI2V model's image conditions the first window (its first latent frame is the image's);
- the step cache composes; an interrupted run resumes window by window to the same video.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pipelines import WanPipeline
from pipelines.pipeline.run.continued import window_request
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.run import resume

REQUEST = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0)
CALL = dict(**REQUEST, progress=False)
LONG = dict(num_frames=29, context_frames=17, context_overlap=8, context_fuse="continue")


@pytest.fixture(scope="module")
def pipe():
  return WanPipeline.tiny(random=True)


@pytest.fixture(scope="module")
def noise(pipe):
  return np.random.default_rng(0).standard_normal(pipe.latent_shape(1, 32, 32, 29)).astype(np.float32)


@pytest.fixture(scope="module")
def video(pipe, noise):
  return pipe.run("a red square", latents=noise, **CALL, **LONG)


def test_windows_continue_one_after_another(video):
  assert video.latents.shape == (1, 16, 8, 4, 4) and video.frames.shape == (1, 29, 32, 32, 3)
  assert video.settings["windows_run"] == 2 and video.settings["steps_run"] == 4
  assert video.settings["context_windows"] == {"latent_length": 5, "latent_overlap": 2, "fuse": "continue",
                                               "starts": [0, 3]}
  assert np.isfinite(video.frames).all()


def test_first_window_is_the_clip_of_its_own_noise(pipe, noise, video):
  clip = pipe.run("a red square", latents=noise[:, :, :5], num_frames=17, decode=False, **CALL)
  np.testing.assert_array_equal(video.latents[:, :, :5], clip.latents)


def test_second_window_is_given_the_first_windows_frames(pipe, noise, video):
  """Frames 3-4 are the first window's, kept exactly; frames 5-7 are the window-sized run (the
  ordinary runner) given them, bit for bit, and differ from the same window given nothing."""
  first = pipe.run("a red square", latents=noise[:, :, :5], num_frames=17, decode=False, **CALL).latents
  np.testing.assert_array_equal(video.latents[:, :, 3:5], first[:, :, 3:])
  so_far = noise.copy()
  so_far[:, :, :5] = first
  request = GenerationRequest.build(pipe.facts, "a red square", latents=noise, **REQUEST, **LONG)
  window = window_request(request, so_far, 3, 2)
  assert window.num_frames == 17 and window.latent_shape == (1, 16, 5, 4, 4) and window.windows is None
  np.testing.assert_array_equal(window.first_frame_latents, first[:, :, 3:])
  second = pipe.generate(window).latents
  np.testing.assert_array_equal(video.latents[:, :, 3:], second)
  alone = pipe.run("a red square", latents=noise[:, :, 3:], num_frames=17, decode=False, **CALL).latents
  assert np.abs(alone[:, :, 2:] - video.latents[:, :, 5:]).max() > 1e-2


def test_later_noise_leaves_earlier_windows_alone(pipe, noise, video):
  other = noise.copy()
  other[:, :, 5:] = np.random.default_rng(1).standard_normal(other[:, :, 5:].shape)
  changed = pipe.run("a red square", latents=other, decode=False, **CALL, **LONG).latents
  np.testing.assert_array_equal(changed[:, :, :5], video.latents[:, :, :5])
  assert np.abs(changed[:, :, 5:] - video.latents[:, :, 5:]).max() > 1e-2


def test_ti2v_image_conditions_the_first_window():
  """tiny-i2v (a TI2V folder) given an image: the video's first latent frame is the image's latents
  (the first window's given frame) and the windows after it continue."""
  from pipelines.wan.conditioning import encode_image
  pipe = WanPipeline.tiny(image=True)
  image = np.zeros((64, 64, 3), np.uint8)
  image[20:40, 10:30] = (220, 30, 30)
  out = pipe.run("a red square moving slowly right", image=image, height=64, width=64, num_frames=29,
                 context_frames=17, context_overlap=8, context_fuse="continue", num_inference_steps=2,
                 seed=0, progress=False, decode=False)
  first = encode_image(pipe.vae, image.transpose(2, 0, 1)[None].astype(np.float32) / 127.5 - 1)
  np.testing.assert_allclose(out.latents[:, :, :1], first, atol=1e-5)
  assert out.settings["windows_run"] == 2


def test_step_cache_runs_per_window(pipe, noise):
  out = pipe.run("a red square", latents=noise, step_cache="first-block:0.05", decode=False, **CALL, **LONG)
  assert len(out.settings["step_cache"]) == 2


class Stop(Exception):
  """Stands for an interruption (Ctrl-C, a lost process) after a step."""


def test_interrupted_windows_resume_to_the_same_video(pipe, noise, video, tmp_path):
  """Each window checkpoints in DIR/window-K: a run stopped after the second window's first step
  resumes there (the first window, finished and removed, runs again to the same latents), bit for
  bit the uninterrupted video; the folder is removed once the video is made. Resume without any
  window's checkpoint, or a new run with one in the way, is refused before denoising."""
  folder = str(tmp_path / "ckpt")
  calls = []

  def stop_in_second_window(step, seconds):
    calls.append(step)
    if len(calls) == 3:
      raise Stop

  with pytest.raises(Stop):
    pipe.run("a red square", latents=noise, checkpoint_dir=folder, on_step=stop_in_second_window, **CALL, **LONG)
  assert resume.holds_checkpoint(folder) and not os.path.exists(resume.window_dir(folder, 0))
  assert resume.read(resume.window_dir(folder, 1)).step == 1
  with pytest.raises(resume.ResumeError, match="already holds a denoising checkpoint"):
    pipe.run("a red square", latents=noise, checkpoint_dir=folder, **CALL, **LONG)
  resumed = pipe.run("a red square", latents=noise, checkpoint_dir=folder, resume=True, **CALL, **LONG)
  assert resumed.settings["resumed_from_step"] == [None, 1]
  np.testing.assert_array_equal(resumed.latents, video.latents)
  assert not os.path.exists(folder)
  with pytest.raises(resume.ResumeError, match="holds no denoising checkpoint of windows that continue"):
    pipe.run("a red square", latents=noise, checkpoint_dir=folder, resume=True, **CALL, **LONG)
