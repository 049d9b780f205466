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


def test_python_generate_and_serve_make_the_same_video_without_guidance(tmp_path):
  """Nothing but a prompt and a seed: the Python call, `generate` and `serve` take the tiny model's
  own defaults (its folder's generation_defaults.json: 64 x 64 x 17, 8 steps, guidance 2, where the
  Python call used diffusers' 5 before) and ask for the same video; `generate`'s frames equal the
  Python call's. Positive control: a guidance given to one route changes its request."""
  import numpy as np

  from pipelines.cli import run_plan
  from pipelines.pipeline import WanPipeline
  from pipelines.serve import api
  from pipelines.serve.worker import batch_request

  prompt, seed = "a green circle moving down", 3
  pipe = WanPipeline.tiny()
  python = pipe.check_inputs(prompt, seed=seed)
  assert (python.height, python.width, python.num_frames, python.steps, python.guidance) == (64, 64, 17, 8, (2.0, 2.0))
  out = tmp_path / "clip.npy"
  argv = ["--prompt", prompt, "--seed", str(seed), "--out", str(out)]
  command = run_plan.check_plan(run_plan.plan_run(generate.build_parser().parse_args(argv))).request
  params = api.job_params(api.VideoCreate(prompt=prompt, seed=seed), model="tiny", loras=(), max_prompt_chars=10000)
  served = batch_request(pipe.facts, [params], None)
  assert command.settings() == python.settings()
  assert served.settings() | {"seed": seed} == python.settings()  # the server seeds each video: [3]
  np.testing.assert_array_equal(served.noise(), python.noise())
  guided = api.job_params(api.VideoCreate(prompt=prompt, seed=seed, guidance_scale=5.0), model="tiny", loras=(),
                          max_prompt_chars=10000)
  assert batch_request(pipe.facts, [guided], None).settings()["guidance_scale"] != python.settings()["guidance_scale"]
  assert generate.main(argv) == 0
  np.testing.assert_array_equal(np.load(out), pipe(prompt, seed=seed)[0])


def test_a_folder_s_defaults_reach_the_command_once_it_is_read(tmp_path, monkeypatch):
  """A folder whose defaults are known only once it is read (a Hub id before its download: the
  flags see diffusers' defaults) still runs at its generation_defaults.json for every value no flag
  gave, as the Python call would; a value given by a flag (--guidance 4, --steps 0) stays as given
  (the positive control), a bad one refused as before."""
  import shutil

  from pipelines.cli import run_plan
  from pipelines.commands import presets
  from pipelines.commands.flags import UsageError
  from pipelines.wan.pretrained import TINY_FOLDERS
  from pipelines.wan.pretrained.generation_defaults import FILE

  folder = tmp_path / "mine"
  shutil.copytree(TINY_FOLDERS["tiny"], folder)
  mine = json.loads((folder / FILE).read_text()) | {"guidance_scale": 3.5, "num_inference_steps": 3, "height": 32}
  (folder / FILE).write_text(json.dumps(mine))
  monkeypatch.setattr(run_plan, "model_preset", lambda model: presets.FOLDER_DEFAULTS)  # not read before JAX
  argv = ["--model", str(folder), "--prompt", "a red square moving up", "--seed", "1", "--out", str(tmp_path / "a.mp4")]
  parse = generate.build_parser().parse_args
  request = run_plan.check_plan(run_plan.plan_run(parse(argv))).request
  assert (request.height, request.width, request.num_frames, request.steps, request.guidance) == (32, 64, 17, 3, (3.5, 3.5))
  asked = run_plan.check_plan(run_plan.plan_run(parse(argv + ["--guidance", "4", "--size", "64x64"]))).request
  assert (asked.height, asked.guidance, asked.steps) == (64, (4.0, 4.0), 3)
  with pytest.raises(UsageError, match="num_inference_steps=0"):
    run_plan.check_plan(run_plan.plan_run(parse(argv + ["--steps", "0"])))
