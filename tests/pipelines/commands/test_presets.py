"""Tests for pipelines/commands/presets.py: the published sampling defaults `generate` starts from (Wan
2.1 / 2.2 and the distilled few-step preset), with flags that override a preset's values."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.cli import generate, run_plan
from pipelines.commands import presets
from tests.pipelines.cli.test_run_plan import _checked


def test_presets_are_the_published_defaults(tmp_path):
  p = presets.PRESETS
  assert (p["wan2.1-t2v-1.3b"].width, p["wan2.1-t2v-1.3b"].height, p["wan2.1-t2v-1.3b"].frames) == (832, 480, 81)
  assert (p["wan2.1-t2v-1.3b"].steps, p["wan2.1-t2v-1.3b"].shift, p["wan2.1-t2v-1.3b"].guidance) == (50, 3.0, (5.0,))
  assert (p["wan2.1-t2v-14b"].width, p["wan2.1-t2v-14b"].height, p["wan2.1-t2v-14b"].shift) == (1280, 720, 5.0)
  a14b = p["wan2.2-t2v-a14b"]
  assert (a14b.width, a14b.height, a14b.frames, a14b.steps, a14b.shift, a14b.guidance) == (
      1280, 720, 81, 40, 12.0, (4.0, 3.0))
  for name, size in (("wan2.1-vace-1.3b", (832, 480)), ("wan2.1-vace-14b", (1280, 720))):  # generate.py: vace = flf2v's shift
    vace = p[name]
    assert (vace.width, vace.height, vace.frames, vace.steps, vace.shift, vace.guidance) == (*size, 81, 50, 16.0, (5.0,))
  fun = p["wan2.2-vace-fun-a14b"]  # lightx2v configs/wan22_vace/.../wan22_moe_vace.json
  assert (fun.width, fun.height, fun.frames, fun.steps, fun.shift, fun.guidance) == (832, 480, 81, 40, 8.0, (3.5, 3.5))
  args = generate.build_parser().parse_args(["--prompt", "x", "--preset", "wan2.1-t2v-14b",
                                             "--size", "480x272", "--steps", "3",
                                             "--out", str(tmp_path / "a.mp4")])
  plan = run_plan.plan_run(args)  # flags override the preset, the rest comes from it
  asked = [plan.request[name] for name in ("width", "height", "num_inference_steps", "num_frames", "flow_shift")]
  assert asked == [480, 272, 3, 81, 5.0]


def test_distilled_preset_is_lightx2v_4_step(tmp_path):
  from pipelines.wan import schedulers
  with pytest.warns(UserWarning, match="real Wan checkpoint"):
    request = _checked(tmp_path, "--preset", "wan2.1-t2v-14b-distill").request
  assert (request.width, request.height, request.num_frames, request.steps) == (832, 480, 81, 4)
  assert request.guidance == (1.0, 1.0) and not request.cfg and request.negative_prompts is None
  assert request.scheduler == schedulers.FlowEulerConfig(shift=5.0)
  assert request.timesteps == (1000.0, 750.0, 500.0, 250.0)
  np.testing.assert_allclose(request.schedule().timesteps, [1000, 937.5, 833.3333, 625], rtol=1e-6)
  # --steps replaces the preset's step list with the scheduler's own schedule of that many steps.
  with pytest.warns(UserWarning):
    assert _checked(tmp_path, "--preset", "wan2.1-t2v-14b-distill", "--steps", "8").request.timesteps is None
