"""Tests for pipelines/cli/run_plan.py: from `generate`'s flags to a checked request before any
compute (`plan_run`, `check_plan`): frames rounded as diffusers does with a warning line, a GIF's
frame-delay warning, and the schedule flags (--scheduler, --timesteps, --sigmas) reaching the
request and its run record."""

from __future__ import annotations

import pytest

from pipelines.cli import generate, run_plan
from pipelines.cli.flags import in_flags
from pipelines.commands.help import warnings_as_lines
from tests.pipelines.cli.test_generate import BASE


@pytest.mark.parametrize("given,rounded", [(10, 9), (16, 17), (19, 17)])
def test_frames_round_as_diffusers_with_a_warning(tmp_path, capsys, given, rounded):
  """num_frames // 4 * 4 + 1 as diffusers: not always down (16 -> 17); the command's warning line."""
  args = generate.build_parser().parse_args(BASE[:-4] + ["--frames", str(given), "--out", str(tmp_path / "a.mp4")])
  with warnings_as_lines("generate", words=in_flags):  # as main shows them; the request rounds (after JAX
    request = run_plan.check_plan(run_plan.plan_run(args)).request  # starts, before any weights)
  assert request.num_frames == rounded
  assert (f"generate: warning: --frames {given} is not 4k + 1 (the VAE's frame groups); rounding to "
          f"{rounded} as diffusers does (pass --frames {rounded} to silence this)") in capsys.readouterr().err


def test_gif_fps_warning_before_compute(tmp_path, capsys):
  args = generate.build_parser().parse_args(BASE + ["--fps", "60", "--out", str(tmp_path / "a.gif")])
  with warnings_as_lines("generate"):  # as main shows warnings
    run_plan.plan_run(args)
  assert ("generate: warning: GIF frame delays are whole centiseconds: 60 fps (a 16.67 ms delay) is stored "
          "as 2 cs = 50 fps" in capsys.readouterr().err)


def _checked(tmp_path, *flags):
  from pipelines.cli import generate
  argv = ["--prompt", "a red square", "--model", "tiny-random", "--seed", "0", "--out", str(tmp_path / "a.mp4")]
  return run_plan.check_plan(run_plan.plan_run(generate.build_parser().parse_args(argv + list(flags))))


def test_schedule_flags_reach_the_request_and_its_records(tmp_path):
  from pipelines.cli import generate, records
  from pipelines.commands.flags import UsageError
  from pipelines.wan import schedulers
  checked = _checked(tmp_path, "--scheduler", "dpm++", "--timesteps", "1000,750,500,250")
  request = checked.request
  assert request.scheduler == schedulers.DPMSolverConfig(flow_shift=3.0) and request.steps == 4
  record = records.request_record(checked.plan, request)
  assert record["scheduler"] == "dpm++" and record["timesteps"] == "1000.0,750.0,500.0,250.0"
  respelled = generate.build_parser().parse_args(["--timesteps", "1e3,750.0,500,250"])
  assert records.recorded_flags(respelled)["timesteps"] == record["timesteps"]  # --resume compares so
  assert request.settings()["timesteps"] == [1000.0, 750.0, 500.0, 250.0] and request.settings()["sigmas"] is None
  identity = request.identity("f" * 64, request.noise())
  assert identity["timesteps"] == [1000.0, 750.0, 500.0, 250.0] and identity["scheduler"]["class"] == "DPMSolverConfig"
  assert "timesteps" not in _checked(tmp_path).request.identity("f" * 64, request.noise())  # old checkpoints resume
  assert _checked(tmp_path, "--sigmas", "1,0.5").request.sigmas == (1.0, 0.5)
  with pytest.raises(UsageError, match="--steps: num_inference_steps=8 but timesteps=.* holds 4"):
    _checked(tmp_path, "--steps", "8", "--timesteps", "1000,750,500,250")
  with pytest.raises(UsageError, match="--timesteps: timesteps=.*strictly decreasing"):
    _checked(tmp_path, "--timesteps", "250,500")
  with pytest.raises(UsageError, match="--timesteps '1000,x' must be comma-separated numbers"):
    _checked(tmp_path, "--timesteps", "1000,x")


def test_context_window_flags_reach_the_request_and_its_records(tmp_path):
  """--context-frames / --context-overlap / --context-fuse become the request's windows (latent
  frames), the run record keeps them in the flags' form (--resume compares so); bad values name the
  flag before anything loads."""
  from pipelines.cli import records
  from pipelines.commands.flags import UsageError
  from pipelines.wan.conditioning import ContextWindows
  checked = _checked(tmp_path, "--frames", "65", "--size", "32x32", "--context-frames", "17", "--context-overlap", "8",
                     "--context-fuse", "flat")
  assert checked.request.windows == ContextWindows(frames=17, length=5, overlap=2, fuse="flat")
  record = records.request_record(checked.plan, checked.request)
  assert (record["context_frames"], record["context_overlap"], record["context_fuse"]) == (17, 8, "flat")
  assert _checked(tmp_path).request.windows is None
  continued = _checked(tmp_path, "--frames", "65", "--size", "32x32", "--context-frames", "17", "--context-overlap",
                       "8", "--context-fuse", "continue").request.windows
  assert continued.fuse == "continue" and continued.continued()[1] == (3, 2)
  with pytest.raises(UsageError, match=r"--context-overlap: context_overlap=6 must be a multiple of 4"):
    _checked(tmp_path, "--frames", "65", "--context-frames", "17", "--context-overlap", "6")
  with pytest.raises(UsageError, match=r"--context-frames: context_frames=81 is longer than the video"):
    _checked(tmp_path, "--frames", "65", "--context-frames", "81")
