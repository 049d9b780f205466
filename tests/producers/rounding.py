"""What the producers' tests share: the token grid, the q pre-scale, and the fp32 and bf16 error
bounds of a normalised output against its float64 oracle (test_query_key.py, test_block_input.py)."""

import math

import numpy as np

from tests.numerics import EPS_BF16, EPS_F32, assert_close_scaled, assert_mostly_equal

GRID = (3, 5, 7)  # odd (F, Hl/2, Wl/2): T = 105
NUM_TOKENS = math.prod(GRID)
Q_SCALE = 0.125 * math.log2(math.e)  # H ** -0.5 * log2(e) for H = 64


def _round_to(values, dtype):
  """float64 values rounded once to dtype, returned as float64."""
  return np.asarray(np.asarray(values, np.float64).astype(dtype), np.float64)


def _f32_rel(width):
  """fp32 error bound of a normalised output (RMSNorm or LayerNorm over D = width, then gain,
  modulation or rotation), in units of its scale.

  sqrt(D) eps: the D-term statistics sum, in whatever order and vector width XLA picks for the CPU
  (rounding errors of a sum grow like sqrt(D) in any order; the rsqrt halves them); 4 eps: the
  rsqrt (XLA's approximation differs by CPU), the gain, the rotation's two products and sum (an
  FMA or not) and out_scale, about one rounding each. Against torch, whose own rounding is within
  the same bound, the difference is at most twice this; the 4x margin over the worst error
  measured under three ISA settings (tests/numerics.py) leaves room for that.
  """
  return (4 + math.sqrt(width)) * EPS_F32


def _assert_bf16_rounding_points(out, want, scale, *, roundings, width, name):
  """bf16 results with the reference's rounding points.

  The fp32 intermediates differ from the reference's by <= _f32_rel(D) of the scale, so a rounding
  point rounds the other way only where the exact value lies that close to a bf16 rounding
  boundary: a fraction <= 2 _f32_rel(D) / EPS_BF16 of the values at each rounding point (both sides
  of a boundary), each flip reaching <= 2 outputs (a flipped norm output moves both outputs of its
  rotated pair). A flip moves an output by <= 1.5 bf16 ulps (EPS_BF16 of the scale; sqrt(2) through
  the rotation). Bounds: 4x both (a flip is all or nothing, so the measured worst equals the
  analysis whenever one happens). A missing or extra bf16 rounding moves 10-25 % of the outputs.
  """
  assert_close_scaled(out, want, rel=4 * roundings * 1.5 * EPS_BF16, scale=scale, name=name)
  flip_fraction = 2 * 2 * _f32_rel(width) / EPS_BF16  # two sides of a boundary, <= 2 outputs
  assert_mostly_equal(out, want, max_fraction_differing=4 * roundings * flip_fraction, name=name)
