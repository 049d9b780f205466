"""Tests for pipelines/cli/run_plan.py: from `generate`'s flags to a checked request before any
compute (`plan_run`, `check_plan`): frames rounded as diffusers does with a warning line, a GIF's
frame-delay warning."""

from __future__ import annotations

import pytest

from pipelines.cli import generate
from pipelines.cli.help import warnings_as_lines
from tests.pipelines.cli.test_generate import BASE


@pytest.mark.parametrize("given,rounded", [(10, 9), (16, 17), (19, 17)])
def test_frames_round_as_diffusers_with_a_warning(tmp_path, capsys, given, rounded):
  """num_frames // 4 * 4 + 1 as diffusers: not always down (16 -> 17); the command's warning line."""
  args = generate.build_parser().parse_args(BASE[:-4] + ["--frames", str(given), "--out", str(tmp_path / "a.mp4")])
  with warnings_as_lines("generate"):  # the request rounds (after JAX starts, before any weights)
    request = generate.check_plan(generate.plan_run(args)).request
  assert request.num_frames == rounded
  assert (f"generate: warning: num_frames={given}: num_frames - 1 must be divisible by 4; rounding to "
          f"{rounded} as diffusers does") in capsys.readouterr().err


def test_gif_fps_warning_before_compute(tmp_path, capsys):
  args = generate.build_parser().parse_args(BASE + ["--fps", "60", "--out", str(tmp_path / "a.gif")])
  with warnings_as_lines("generate"):  # as main shows warnings
    generate.plan_run(args)
  assert ("generate: warning: GIF frame delays are whole centiseconds: 60 fps (a 16.67 ms delay) is stored "
          "as 2 cs = 50 fps" in capsys.readouterr().err)
