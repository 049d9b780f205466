"""What `generate` takes from a model folder when no --preset says otherwise: a TI2V-5B folder's
frame rate (24 fps, as it was trained; `presets.model_fps`) and its size grid (VAE factor 16 x patch
2 = 32 px), named right when a size is off it."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import generate
from pipelines.commands.presets import model_fps
from tests.pipelines.wan.conditioning.test_ti2v import PROMPT, _save_folder

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def ti2v_folder(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("ti2v") / "wan22_ti2v")
  _save_folder(folder)
  return folder


def _argv(folder: str, out, *extra: str) -> list[str]:
  return ["--model", folder, "--prompt", PROMPT, "--size", "96x64", "--frames", "9", "--steps", "2",
          "--seed", "1", "--max-sequence-length", "16", "--out", str(out), *extra]


def test_ti2v_folder_writes_its_trained_frame_rate(ti2v_folder, tmp_path):
  """No --fps, no --preset: 24 fps (a 16 fps default played TI2V's motion 1.5x slow); --fps wins;
  positive control: the rule gives 16 for a Wan 2.1 / A14B folder."""
  assert (model_fps(True), model_fps(False)) == (24.0, 16.0)
  out = tmp_path / "ti2v.mp4"
  assert generate.main(_argv(ti2v_folder, out)) == 0
  assert json.loads((tmp_path / "ti2v.mp4.json").read_text())["video"]["fps"] == 24.0
  asked = tmp_path / "asked.mp4"
  assert generate.main(_argv(ti2v_folder, asked, "--fps", "12")) == 0
  assert json.loads((tmp_path / "asked.mp4.json").read_text())["video"]["fps"] == 12.0


def test_ti2v_size_off_the_grid_names_its_factor(ti2v_folder, tmp_path, capsys):
  """80 is on Wan 2.1's 16 px grid but not TI2V's 32: refused, naming VAE factor 16 x patch 2."""
  argv = _argv(ti2v_folder, tmp_path / "x.mp4")
  argv[argv.index("96x64")] = "80x64"
  assert generate.main(argv) == 2
  err = capsys.readouterr().err
  assert "width=80 must be a positive multiple of 32 (VAE factor 16 x patch 2); use 64 or 96" in err, err
