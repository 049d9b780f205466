"""Step-cache calibrations belong to a model: pipelines/wan/step_cache/calibration.py, the shipped tiny
file (pipelines/wan/step_cache/mag_ratios_tiny.json) and end_to_end/train/calibrate_cache.py's defaults."""

from __future__ import annotations

import json

import pytest

from end_to_end.train import calibrate_cache
from pipelines import WanPipeline
from pipelines.commands import presets
from pipelines.wan import step_cache
from pipelines.wan.step_cache import calibration as mag_calibration
from tests.harness import user_docs

TRAINED = dict(height=64, width=64, num_frames=17, steps=8, max_sequence_length=64)
# The first shipped file's metadata (random-weight tiny model, before fingerprints were recorded).
OLD_FILE = {"method": "mag", "model": "tiny", "steps": 50, "ratios": [1.0] * 50,
            "calibration": {"size": "256x256", "frames": 17, "max_sequence_length": 512}}


@pytest.fixture(scope="module")
def shipped():
  with open(step_cache.TINY_RATIOS_FILE, encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def fingerprints():
  return {"trained": WanPipeline.tiny().fingerprint(), "random": WanPipeline.tiny(random=True).fingerprint()}


def test_shipped_file_is_the_trained_default_at_its_settings(shipped, fingerprints):
  """The file the embedded model's `mag:` uses was measured on that model (its fingerprint) at the
  size, frames, steps and text length it runs at by default (generate's "tiny" preset)."""
  preset = presets.PRESETS["tiny"]
  assert (preset.width, preset.height, preset.frames, preset.steps) == (64, 64, 17, 8)
  assert presets.default_text_length("tiny") == 64
  assert mag_calibration.check_calibration(shipped, model="tiny", fingerprint=fingerprints["trained"],
                                           **TRAINED) is None
  assert len(shipped["ratios"]) == 8 and shipped["ratios"][0] == 1.0
  # Positive control: the random-weight model has another fingerprint, and the check sees it.
  assert fingerprints["random"] != fingerprints["trained"]
  warning = mag_calibration.check_calibration(shipped, model="tiny", fingerprint=fingerprints["random"],
                                              **TRAINED)
  assert warning is not None and warning.startswith(
      f"the MagCache ratios were calibrated for model fingerprint {fingerprints['trained'][:12]}... "
      f"(this run: {fingerprints['random'][:12]}...);"), warning


@pytest.mark.parametrize("change,named", [
    (dict(height=256, width=256), "width 64 (this run: 256), height 64 (this run: 256)"),
    (dict(num_frames=33), "frames 17 (this run: 33)"),
    (dict(steps=50), "steps 8 (this run: 50)"),
    (dict(max_sequence_length=512), "max sequence length 64 (this run: 512)"),
    (dict(model="other"), "model 'tiny' (this run: 'other')"),
])
def test_each_mismatch_is_named(shipped, change, named):
  kwargs = {"model": "tiny", "fingerprint": shipped["model_fingerprint"], **TRAINED, **change}
  warning = mag_calibration.check_calibration(shipped, source="mag_ratios_tiny.json", **kwargs)
  assert warning is not None and warning.startswith("mag_ratios_tiny.json were calibrated for " + named)
  size = f"{kwargs['width']}x{kwargs['height']}"
  assert f"calibrate_cache --model MODEL --size {size} --frames {kwargs['num_frames']} --steps {kwargs['steps']}" \
         in warning


def test_old_file_layout_is_read_and_flagged():
  """The first shipped file (random weights, 256x256, 512 tokens, 50 steps) against the trained
  default's run: every difference named, and the missing fingerprint said."""
  warning = mag_calibration.check_calibration(OLD_FILE, model="tiny", fingerprint="0" * 64, **TRAINED)
  for part in ("width 256 (this run: 64)", "height 256 (this run: 64)", "steps 50 (this run: 8)",
               "max sequence length 512 (this run: 64)", "do not record the model fingerprint"):
    assert part in warning, warning
  assert "frames" not in warning.split("do not record")[0]  # 17 frames match
  # Comparisons the caller leaves out (no fingerprint, no text length) are not reported.
  assert mag_calibration.check_calibration(OLD_FILE, model="tiny", height=256, width=256, num_frames=17,
                                           steps=50) is None


def test_calibrate_cache_defaults_are_the_models_own():
  args = calibrate_cache.build_parser().parse_args(["--out", "x.json"])
  assert args.model == "tiny" and args.size is args.frames is args.steps is args.max_sequence_length is None
  assert calibrate_cache.model_settings("tiny") == {"width": 64, "height": 64, "frames": 17, "steps": 8,
                                                     "guidance": 2.0, "max_sequence_length": 64}
  assert calibrate_cache.model_settings("tiny-random")["max_sequence_length"] == 512
  model_help = next(a.help for a in calibrate_cache.build_parser()._actions if a.dest == "model")
  assert "'tiny' (the trained embedded default" in model_help and "'tiny-random' (embedded random" in model_help


def test_record_fields_round_trip(shipped):
  fields = mag_calibration.record_fields(model="tiny", fingerprint="f" * 64, width=64, height=64, frames=17,
                                         steps=8, max_sequence_length=64)
  assert set(fields) == set(mag_calibration.FIELDS) and set(mag_calibration.FIELDS) <= set(shipped)
  assert mag_calibration.check_calibration(fields, model="tiny", fingerprint="f" * 64, **TRAINED) is None


@pytest.fixture(scope="module")
def trained():
  return WanPipeline.tiny()


# The thresholds proposed for the README (measured with end_to_end.quality.step_cache on the trained
# default at 64x64 x 17, 8 steps, three prompts: mag:0.15 skips steps 2 and 4, first-block:0.2
# two or three of steps 2, 4, 6; never the last).
README_SPECS = ("mag:0.15", "first-block:0.2")


@pytest.mark.parametrize("spec", README_SPECS)
def test_readme_thresholds_skip_some_steps_but_not_the_last(trained, spec):
  result = trained.run("a blue square moving left", height=64, width=64, num_frames=17, num_inference_steps=8,
                       seed=0, max_sequence_length=64, step_cache=spec, progress=False, decode=False)
  skipped = result.settings["step_cache"]["skipped_steps"]
  assert 2 <= len(skipped) <= 3 and 7 not in skipped, (spec, skipped)


def test_random_models_ratios_skip_the_last_step_of_the_trained_default(trained):
  """Positive control for the test above (the issue's case): the random-weight model's ratios
  (~1.0) on the trained default make mag:0.05 skip 5 of 8 steps, the last among them."""
  from tests.pipelines.wan.step_cache.test_forward import RANDOM_RATIOS
  result = trained.run("a blue square moving left", height=64, width=64, num_frames=17, num_inference_steps=8,
                       seed=0, max_sequence_length=64, step_cache=f"mag:0.05@{RANDOM_RATIOS}", progress=False,
                       decode=False)
  assert result.settings["step_cache"]["skipped_steps"] == [2, 3, 4, 6, 7]


def test_readme_shows_these_thresholds():
  """The docs' step-cache examples (README.md, docs/) use the thresholds measured above (and no other)."""
  import re
  shown = set(re.findall(r"--step-cache ((?:mag|first-block):[0-9.]+)", user_docs()))
  assert shown == set(README_SPECS), shown
