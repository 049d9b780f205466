"""Tests for pipelines/cli/presets.py: the published sampling defaults `generate` starts from (Wan
2.1 / 2.2), with flags that override a preset's values."""

from __future__ import annotations

from pipelines.cli import generate


def test_presets_are_the_published_defaults(tmp_path):
  p = generate.PRESETS
  assert (p["wan2.1-t2v-1.3b"].width, p["wan2.1-t2v-1.3b"].height, p["wan2.1-t2v-1.3b"].frames) == (832, 480, 81)
  assert (p["wan2.1-t2v-1.3b"].steps, p["wan2.1-t2v-1.3b"].shift, p["wan2.1-t2v-1.3b"].guidance) == (50, 3.0, (5.0,))
  assert (p["wan2.1-t2v-14b"].width, p["wan2.1-t2v-14b"].height, p["wan2.1-t2v-14b"].shift) == (1280, 720, 5.0)
  a14b = p["wan2.2-t2v-a14b"]
  assert (a14b.width, a14b.height, a14b.frames, a14b.steps, a14b.shift, a14b.guidance) == (
      1280, 720, 81, 40, 12.0, (4.0, 3.0))
  args = generate.build_parser().parse_args(["--prompt", "x", "--preset", "wan2.1-t2v-14b",
                                             "--size", "480x272", "--steps", "3",
                                             "--out", str(tmp_path / "a.mp4")])
  plan = generate.plan_run(args)  # flags override the preset, the rest comes from it
  assert (plan.width, plan.height, plan.steps, plan.frames, plan.shift) == (480, 272, 3, 81, 5.0)
