"""Tests for end_to_end/quality/quant_error.py: the one-step noise-prediction error of quantized weights.

Checks on the trained tiny default (one seed, 2 steps): the unquantized float32 candidate reproduces
the reference exactly (negative control: the error is the quantization's, nothing else); errors
of weight-only int8 on all layers add in power over the layers taken alone (uncorrelated rounding:
e_all^2 ~ sum e_layer^2); fp8's 3 mantissa bits cost more than int8's per-channel grid.
"""

from __future__ import annotations

import pytest

from end_to_end.quality import quant_error
from pipelines import WanPipeline
from pipelines.wan.transformer import quantization


@pytest.fixture(scope="module")
def pipe():
  return WanPipeline.tiny("float32")


def test_errors_are_the_quantizations_and_add_in_power(pipe):
  every = quantization.QUANTIZED_LINEARS
  ffn = tuple(p for p in every if p[0] == "ffn")
  rest = tuple(p for p in every if p[0] != "ffn")
  plan = [("float32", None, "none", every), ("float32", "int8", "all", every), ("float32", "int8", "ffn", ffn),
          ("float32", "int8", "attention", rest), ("float32", "fp8", "all", every)]
  none, int8, int8_ffn, int8_rest, fp8 = (row["rel_rms"] for row in quant_error.measure(pipe, [0], 2, plan))
  assert none == 0.0
  assert 1e-3 < int8 < fp8  # int8 weight error ~0.5 % of each weight: ~0.7 % of eps (measured)
  assert int8_ffn ** 2 + int8_rest ** 2 == pytest.approx(int8 ** 2, rel=0.25)


def test_keep_names_the_layers():
  assert quant_error.parse_keep("ffn.proj_in, attn1.to_v") == (("ffn", "proj_in"), ("attn1", "to_v"))
  assert quant_error.parse_keep(None) == ()
  with pytest.raises(ValueError, match="ffn.proj_up not among the quantized layers"):
    quant_error.parse_keep("ffn.proj_up")
  rows = [row for row in quant_error.default_plan((("ffn", "proj_in"),)) if row[2] == "all but --keep"]
  assert [(dtype, mode) for dtype, mode, *_ in rows] == [("bfloat16", "int8"), ("bfloat16", "fp8")]
  assert all(("ffn", "proj_in") not in layers and len(layers) == 9 for *_, layers in rows)
