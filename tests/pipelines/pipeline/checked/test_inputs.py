"""Tests for pipelines/pipeline/checked/inputs.py: the checks of a call's single arguments before any
compute (num_frames rounded to 4k + 1 with diffusers' warning)."""

from __future__ import annotations

import pytest

from pipelines.pipeline.checked import inputs

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_round_num_frames_warns_like_diffusers():
  with pytest.warns(UserWarning, match="rounding to 81"):
    assert inputs.round_num_frames(83) == 81
  assert inputs.round_num_frames(81) == 81
  with pytest.raises(ValueError, match="positive int"):
    inputs.round_num_frames(0)
