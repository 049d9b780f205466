"""Tests for pipelines/pipeline/checked/request.py: what `GenerationRequest.build` decides from the model's
facts (`ModelFacts`) before any compute: the trained tiny default's one video size; a flow shift
without a usable schedule and every other number out of its range (refused at build, for generate,
the Python call and serve alike)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pipelines.cli import generate, run_plan
from pipelines.pipeline.checked.request import GenerationRequest
from tests.pipelines.cli.test_generate import PROMPT


def test_the_trained_default_warns_outside_its_one_video_size(tmp_path):
  """The trained tiny default knows 64x64 x 17 frames only: another size warns before any compute
  (the Python call and the command build the same request); its own size, and the random tiny
  model at any size, do not (the control)."""
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.pipeline.checked.request import GenerationRequest

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


@pytest.mark.parametrize("shift,words", [(1e7, "must be in [0.01, 1000]"), (1e30, "must be in [0.01, 1000]"),
                                         (1e-30, "must be in [0.01, 1000]"), (-1, "must be a finite number > 0"),
                                         (float("nan"), "must be a finite number > 0"),
                                         (float("inf"), "must be a finite number > 0")])
@pytest.mark.parametrize("scheduler", ["unipc", "euler", "dpm++"])
def test_a_flow_shift_without_a_usable_schedule_is_refused_at_build(shift, words, scheduler):
  """Every solver: refused by `build` (so generate, the Python call and serve refuse it before any
  weight loads), naming flow_shift; it used to pass and fail in the worker ("Singular matrix")."""
  import re

  from pipelines.pipeline.checked.model_facts import ModelFacts

  facts = ModelFacts.tiny_random("float32")
  with pytest.raises(ValueError, match=rf"^flow_shift={re.escape(repr(shift))} {re.escape(words)}"):
    GenerationRequest.build(facts, "x", height=32, width=32, num_frames=5, seed=0, flow_shift=shift,
                            scheduler=scheduler)


@pytest.mark.parametrize("shift", [0.01, 1.0, 12.0, 1000.0])
def test_flow_shifts_in_range_give_finite_tables(shift):
  """Positive control: the range's ends and Wan's values build, and their tables are finite."""
  from pipelines.pipeline.checked.model_facts import ModelFacts

  facts = ModelFacts.tiny_random("float32")
  for scheduler in ("unipc", "euler", "dpm++"):
    request = GenerationRequest.build(facts, "x", height=32, width=32, num_frames=5, seed=0, flow_shift=shift,
                                      num_inference_steps=50, scheduler=scheduler)
    schedule = request.schedule()
    assert np.isfinite(schedule.sigmas).all() and (np.diff(schedule.sigmas) <= 0).all()
    assert all(np.isfinite(t).all() for t in getattr(schedule, "coefficients", {}).values())


def test_a_schedule_that_turns_singular_is_refused_naming_flow_shift(monkeypatch):
  """The tables are computed at build: a solver failing on them is a ValueError naming flow_shift
  and the steps (forced: the coefficient table raising as a singular solve would)."""
  from pipelines.pipeline.checked.model_facts import ModelFacts
  from pipelines.wan.schedulers import unipc

  def singular(*args, **kwargs):
    raise np.linalg.LinAlgError("Singular matrix")

  monkeypatch.setattr(unipc, "_unipc_coefficients", singular)
  with pytest.raises(ValueError, match=r"flow_shift=7 with num_inference_steps=9 gives no usable schedule "
                                       r"\(Singular matrix\)"):
    GenerationRequest.build(ModelFacts.tiny_random("float32"), "x", height=32, width=32, num_frames=5, seed=0,
                            flow_shift=7.0, num_inference_steps=9, scheduler="unipc")


def test_generate_refuses_a_huge_shift_before_loading(tmp_path, capsys, monkeypatch):
  """`generate --shift 1e7`: exit 2 naming --shift, before any weight loads (it ended in a
  traceback after the model loaded)."""
  from pipelines.pipeline import wan_pipeline

  monkeypatch.setattr(wan_pipeline.WanPipeline, "tiny", lambda *a, **k: pytest.fail("loaded weights"))
  argv = ["--prompt", PROMPT, "--shift", "1e7", "--steps", "2", "--out", str(tmp_path / "a.mp4")]
  assert generate.main(argv) == 2
  assert "--shift: flow_shift=10000000.0 must be in [0.01, 1000]" in capsys.readouterr().err


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("name,value,words", [
    ("guidance_scale", NAN, "must be a finite number in [0, 100]"),
    ("guidance_scale", INF, "must be a finite number in [0, 100]"),
    ("guidance_scale", -1.0, "must be a finite number in [0, 100] (Wan: 5.0; <= 1 turns CFG off)"),
    ("guidance_scale", 1e30, "must be a finite number in [0, 100]"),
    ("guidance_scale_2", 101.0, "must be a finite number in [0, 100]"),
    ("num_inference_steps", 0, "must be a positive int"),
    ("num_inference_steps", -3, "must be a positive int"),
    ("num_inference_steps", 100_000, "must be at most 1000, the scheduler's num_train_timesteps"),
    ("seed", -1, "must be a non-negative int"),
    ("strength", NAN, "must be a number in (0, 1]"),
    ("strength", 2.0, "must be a number in (0, 1]"),
])
def test_every_number_out_of_range_is_refused_at_build_naming_it(name, value, words):
  """Each number is refused by `build` with a message that starts with its name and value (serve
  maps that name to the API field) and says the range, before any compute; 100000 steps used to
  spend seconds building tables, 1e30 guidance to reach the worker; strength is checked unused too."""
  import re

  from pipelines.pipeline.checked.model_facts import ModelFacts

  call = {"height": 32, "width": 32, "num_frames": 5, "seed": 0, "num_inference_steps": 4, name: value}
  with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))} {re.escape(words)}"):
    GenerationRequest.build(ModelFacts.tiny_random("float32"), "x", **call)


@pytest.mark.parametrize("scale", [NAN, 1e30, -101.0])
def test_a_lora_scale_out_of_range_is_refused_at_build(scale):
  """The call's LoRA scale (`attention_kwargs["scale"]`) is finite and within [-100, 100]."""
  from pipelines.pipeline.checked.model_facts import ModelFacts

  with pytest.raises(ValueError, match=r"^attention_kwargs=.*'scale' must be a finite number in \[-100, 100\]"):
    GenerationRequest.build(ModelFacts.tiny_random("float32"), "x", height=32, width=32, num_frames=5, seed=0,
                            num_inference_steps=4, attention_kwargs={"scale": scale})


def test_the_ends_of_every_range_build():
  """Positive control: guidance 0 and 100, 1000 steps, LoRA scale -100 and 100, strength 1 build,
  and the 1000-step schedule at flow shift 1000 is finite and decreasing."""
  from pipelines.pipeline.checked.model_facts import ModelFacts

  facts = ModelFacts.tiny_random("float32")
  call = {"height": 32, "width": 32, "num_frames": 5, "seed": 0, "num_inference_steps": 4}
  for extra in ({"guidance_scale": 0.0}, {"guidance_scale": 100.0}, {"attention_kwargs": {"scale": -100.0}},
                {"attention_kwargs": {"scale": 100}}, {"strength": 1.0}):
    GenerationRequest.build(facts, "x", **(call | extra))
  request = GenerationRequest.build(facts, "x", **(call | {"num_inference_steps": 1000, "flow_shift": 1000.0}))
  sigmas = np.asarray(request.schedule().sigmas)
  assert len(sigmas) == 1001 and np.isfinite(sigmas).all() and (np.diff(sigmas) <= 0).all()


@pytest.mark.parametrize("flags,words", [(["--guidance", "1e30"], "--guidance: guidance_scale=1e+30 must be"),
                                         (["--steps", "5000"], "--steps: num_inference_steps=5000 must be at most"),
                                         (["--strength", "nan"], "--strength: strength=nan must be")])
def test_generate_refuses_a_number_out_of_range_before_loading(tmp_path, capsys, monkeypatch, flags, words):
  """exit 2 naming the flag, before any weight loads."""
  from pipelines.pipeline import wan_pipeline

  monkeypatch.setattr(wan_pipeline.WanPipeline, "tiny", lambda *a, **k: pytest.fail("loaded weights"))
  assert generate.main(["--prompt", PROMPT, *flags, "--out", str(tmp_path / "a.mp4")]) == 2
  assert words in capsys.readouterr().err


@pytest.mark.parametrize("call,words", [
    ({"height": 100_000, "width": 100_000}, "height=100000 is too large"),
    ({"height": 64, "width": 99_999}, "width=99999 is too large"),  # not "a multiple of 16: use 99984 or 100000"
    ({"height": 16_400, "width": 64}, "height=16400 is too large"),  # 1025 tokens a side
    ({"num_frames": 4097}, "num_frames=4097 is too large"),  # 1025 latent frames
])
def test_a_size_beyond_the_models_reach_is_refused_at_build(call, words):
  """A side (or a clip) longer than the transformer's RoPE table places tokens along is refused by
  `build` with what the limit is, why, and what the size would cost (tokens, GiB of latents), before
  anything is allocated (it used to fail allocating the noise: 46.6 GiB for 100000x100000). Control:
  the longest side and clip the table covers build."""
  from pipelines.pipeline.checked.model_facts import ModelFacts

  facts = ModelFacts.tiny_random("float32")
  base = {"height": 64, "width": 64, "num_frames": 5, "seed": 0, "num_inference_steps": 2}
  with pytest.raises(ValueError) as refused:
    GenerationRequest.build(facts, "x", **(base | call))
  message = str(refused.value)
  assert message.startswith(words), message
  assert "RoPE" in message and "GiB of latents" in message and "tokens" in message, message
  assert ("at most 16384 pixels" if "num_frames" not in call else "at most 4093 frames") in message, message
  for edge in ({"height": 16_384, "width": 16}, {"height": 16, "width": 16_384}, {"num_frames": 4093}):
    assert GenerationRequest.build(facts, "x", **(base | edge)).latent_shape[2:] in (
        (2, 2048, 2), (2, 2, 2048), (1024, 8, 8))


def test_generate_refuses_an_impossible_size_before_anything(tmp_path, capsys, monkeypatch):
  """`generate --size 100000x100000`: exit 2 naming --size and the limit, with no estimate line and
  no weights loaded (it estimated 13,354,766 h, then died allocating 46.6 GiB of noise)."""
  from pipelines.pipeline import wan_pipeline

  monkeypatch.setattr(wan_pipeline.WanPipeline, "tiny", lambda *a, **k: pytest.fail("loaded weights"))
  assert generate.main(["--prompt", PROMPT, "--size", "100000x100000", "--out", str(tmp_path / "a.mp4")]) == 2
  err = capsys.readouterr().err
  assert "--size: height=100000 is too large" in err and "at most 16384 pixels" in err, err
  assert err.count("\n") == 1 and "Traceback" not in err, err  # one line, no estimate before it
