"""Tests for pipelines/cli/flags.py: the values of `generate`'s flags as parsed (--size, and
--no-vae-parallel against its default)."""

from __future__ import annotations

import pytest

from pipelines.cli import flags, generate, run_plan
from tests.pipelines.cli.test_generate import BASE


def test_vae_parallel_flag(tmp_path):
  """The decode is split over the mesh by default; --no-vae-parallel keeps it on one device."""
  parse = generate.build_parser().parse_args
  out = ["--out", str(tmp_path / "a.mp4")]
  assert run_plan.plan_run(parse(BASE[:-4] + out)).vae_parallel is True
  assert run_plan.plan_run(parse(BASE[:-4] + ["--no-vae-parallel"] + out)).vae_parallel is False


@pytest.mark.parametrize("text,expected", [("832x480", (832, 480)), ("1280*720", (1280, 720))])
def test_parse_size(text, expected):
  assert flags.parse_size(text) == expected
