"""Tests for pipelines/wan/step_cache/spec.py: MagCache spec strings with a ratios file, the ratios
resampled to the step count as diffusers' `nearest_interp`, the shipped tiny ratios, and the refusals
of missing or bad ratios (no JAX needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.wan import step_cache

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_mag_ratios_file_and_resampling(tmp_path, tiny):
  path = tmp_path / "ratios.json"
  path.write_text(json.dumps({"ratios": [1.0, 0.5, 2.0]}))
  spec = step_cache.parse_step_cache(f"mag:0.1:2@{path}", model="/some/folder")
  assert (spec.threshold, spec.max_skips, spec.ratios) == (0.1, 2, (1.0, 0.5, 2.0))
  # Index round(i * 2 / 4) with round-half-to-even, as torch.round in diffusers' nearest_interp.
  np.testing.assert_array_equal(step_cache.nearest_interp(spec.ratios, 5), [1.0, 1.0, 0.5, 2.0, 2.0])
  tiny_spec = step_cache.parse_step_cache("mag:0.1", model="tiny")
  # The shipped file: the trained tiny default's 8 steps (tests/pipelines/wan/step_cache/test_calibration.py).
  assert tiny_spec.max_skips == step_cache.MAG_DEFAULT_MAX_SKIPS and len(tiny_spec.ratios) == 8


def test_mag_without_ratios_needs_a_calibration_for_a_folder(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"ratios": [1.0, -1.0]}))
  with pytest.raises(step_cache.StepCacheError, match="calibrate_cache --model FOLDER"):
    step_cache.parse_step_cache("mag:0.1", model="/models/wan")
  with pytest.raises(step_cache.StepCacheError, match="finite numbers > 0"):
    step_cache.parse_step_cache(f"mag:0.1@{bad}", model="tiny")
  with pytest.raises(step_cache.StepCacheError, match="threshold"):
    step_cache.StepCacheSpec("first-block", float("inf"))
