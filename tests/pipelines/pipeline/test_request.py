"""Tests for pipelines/pipeline/request.py: what `GenerationRequest.build` decides from the model's
facts (`ModelFacts`) before any compute: the trained tiny default's one video size."""

from __future__ import annotations

import warnings

import pytest

from pipelines.cli import generate, run_plan
from tests.pipelines.cli.test_generate import PROMPT


def test_the_trained_default_warns_outside_its_one_video_size(tmp_path):
  """The trained tiny default knows 64x64 x 17 frames only: another size warns before any compute
  (the Python call and the command build the same request); its own size, and the random tiny
  model at any size, do not (the control)."""
  from pipelines.pipeline.model_facts import ModelFacts
  from pipelines.pipeline.request import GenerationRequest

  trained = ModelFacts.tiny_default("float32")
  call = {"num_inference_steps": 1, "seed": 0}
  with pytest.warns(UserWarning, match=r"trained at 64x64 x 17 frames only; 128x128 x 9 frames"):
    GenerationRequest.build(trained, PROMPT, height=128, width=128, num_frames=9, **call)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    GenerationRequest.build(trained, PROMPT, height=64, width=64, num_frames=17, **call)
    GenerationRequest.build(ModelFacts.tiny_random("float32"), PROMPT, height=128, width=128, num_frames=9, **call)
  argv = ["--prompt", PROMPT, "--size", "128x128", "--frames", "9", "--steps", "1", "--out", str(tmp_path / "a.mp4")]
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    run_plan.check_plan(run_plan.plan_run(generate.build_parser().parse_args(argv)))
  assert any("trained at 64x64 x 17 frames only" in str(w.message) for w in seen)
