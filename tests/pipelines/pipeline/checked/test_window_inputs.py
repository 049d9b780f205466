"""Tests for pipelines/pipeline/checked/window_inputs.py: context windows as the call gives them, checked
before anything loads or computes, and the warning for a long video without them. The windows' math:
tests/pipelines/wan/conditioning/test_windows.py."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from pipelines.pipeline.checked.model_facts import ModelFacts
from pipelines.pipeline.checked.request import GenerationRequest
from pipelines.pipeline.checked.window_inputs import check_context_windows, long_video_note
from pipelines.wan.conditioning import ContextWindows

CALL = dict(height=32, width=32, num_frames=65, num_inference_steps=2, seed=0)


@pytest.fixture(scope="module")
def facts():
  return ModelFacts.tiny_random("float32")


def test_frames_become_latent_frames(facts):
  request = GenerationRequest.build(facts, "a red square moving right", context_frames=17, context_overlap=8, **CALL)
  assert request.windows == ContextWindows(frames=17, length=5, overlap=2, fuse="pyramid")
  assert request.settings()["context_windows"] == {"latent_length": 5, "latent_overlap": 2, "fuse": "pyramid",
                                                   "starts": [0, 3, 6, 9, 12]}
  assert "context_windows" in request.identity("f", request.noise())
  default = GenerationRequest.build(facts, "a red square moving right", context_frames=17, context_fuse="flat", **CALL).windows
  assert (default.overlap, default.fuse) == (1, "flat")  # a quarter of 17 frames: 4 frames, 1 latent frame
  assert check_context_windows(81, None, "pyramid", num_frames=241, model=facts, windows_degree=2,
                               vace=False) == ContextWindows(61, 21, 5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(context_frames=16), r"context_frames=16 must be 4k \+ 1 .* use 13 or 17"),
    (dict(context_frames=69), r"context_frames=69 is longer than the video \(num_frames=65\)"),
    (dict(context_frames=17, context_overlap=17), r"context_overlap=17 must be a multiple of 4 below context_frames=17"),
    (dict(context_frames=17, context_overlap=6), r"context_overlap=6 must be a multiple of 4"),
    (dict(context_frames=17, context_overlap=20), r"context_overlap=20 must be a multiple of 4 below"),
    (dict(context_frames=17, context_fuse="mean"), r"context_fuse='mean' must be one of \('pyramid', 'flat', 'continue'\)"),
    (dict(context_frames=17, context_fuse="continue", mesh="W=2,U=1,R=1"),
     r"context_fuse='continue' runs the windows one after another, so the mesh's W=2 has nothing"),
    (dict(context_frames=17, context_fuse="continue", video=np.full((65, 32, 32, 3), 0.5, np.float32)),
     r"context_fuse='continue' does not take a video to start from"),
    (dict(context_overlap=8), r"context_overlap=8 without context_frames"),
    (dict(mesh="W=2,U=2,R=1"), r"W=2 runs context windows in parallel, but context_frames is not given"),
    (dict(context_frames=65, mesh="W=2,U=1,R=1"), r"context_frames=65 is the whole video"),
    (dict(context_frames=17, mesh="W=16,U=1,R=1"), r"needs 16 devices"),
])
def test_bad_values_are_refused_before_anything_runs(facts, kwargs, match):
  with pytest.raises(ValueError, match=match):
    GenerationRequest.build(facts, "a red square moving right", **(CALL | kwargs))


def test_step_cache_composes_with_windows(facts):
  """A step cache with context windows is built (its residuals per window: `step_cache.cached_windows`)."""
  request = GenerationRequest.build(facts, "a red square moving right", context_frames=17, context_overlap=8, step_cache="first-block:0.1",
                                    **CALL)
  assert request.windows is not None and request.step_cache is not None


def test_continue_is_refused_with_an_image_to_video_model(facts):
  """Wan 2.1 / 2.2 I2V conditions through its input channels: windows that continue (given frames by
  per-token timesteps) are refused for it, naming the blend instead; a TI2V or text model takes them."""
  i2v = dataclasses.replace(facts, transformer=dataclasses.replace(
      facts.transformer, in_channels=2 * facts.transformer.out_channels + facts.temporal_factor), image_to_video=True)
  with pytest.raises(ValueError, match=r"conditions through its input channels .* context_fuse='pyramid'"):
    check_context_windows(17, 8, "continue", num_frames=65, model=i2v, windows_degree=1, vace=False)
  windows = check_context_windows(17, 8, "continue", num_frames=65, model=facts, windows_degree=1, vace=False)
  assert windows.continued() == ((0, 0), (3, 2), (6, 2), (9, 2), (12, 2))


def test_vace_is_refused(facts):
  with pytest.raises(ValueError, match="context windows with a VACE model are not supported"):
    check_context_windows(17, 8, "pyramid", num_frames=65, model=facts, windows_degree=1, vace=True)


def test_long_video_without_windows_warns_with_the_arguments():
  facts = ModelFacts.tiny_default("float32")
  with pytest.warns(UserWarning, match=r"a longer video in context windows of that length: context_frames=17\)"):
    GenerationRequest.build(facts, "a red square moving right", height=64, width=64, num_frames=65)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # windows of the trained length: no warning
    GenerationRequest.build(facts, "a red square moving right", height=64, width=64, num_frames=65, context_frames=17)
  note = long_video_note(241, 81)  # a Wan folder's 81-frame clips: the Python arguments, no flags
  assert "context_frames=81, context_overlap=20 (and W=2 in the mesh" in note and "--" not in note
  assert long_video_note(81, 81) is None and long_video_note(241, None) is None
