"""Tolerances in units of the compared values' scale, shared by every numeric test.

A tolerance is either bit-exactness (only where that IS the property under test; the call site says
why) or, through this module, an error bound in units of the output's scale derived from error
analysis: scale x eps(dtype) x (roundings + accumulation length), stated in a comment where it is
used. XLA:CPU's rounding differs between CPUs (FMA contraction, vector width, transcendental
approximations), so a bound must hold with margin under `XLA_FLAGS=--xla_cpu_max_isa=SSE4_2` and
`=AVX2` as well as on this machine; each bound here was checked to be >= 4x the worst error
measured under the three.

To re-measure, set TOL_REPORT to a file path: every check appends one JSON line
{"test", "name", "error", "tolerance", "ratio"} (ratio = error / tolerance; the check still asserts).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

EPS_F32 = 2.0**-23  # np.finfo(np.float32).eps: spacing of fp32 at 1.0
EPS_BF16 = 2.0**-7  # spacing of bfloat16 at 1.0 (7 stored mantissa bits)

# Two fp32 runs of the whole pipeline (ours vs diffusers, or ours on two meshes, processes, batch
# layouts or attention paths): each transformer forward within ~1e-5 of its output's scale
# (tests/test_transformer.py) over a few steps, the decode within 1e-4 of the video's range
# (tests/test_vae.py), so the video's RMS error is <= 1e-4 of its range 1: PSNR >= 80 dB. Measured
# >= 147 dB under three ISA settings.
FP32_VIDEO_PSNR_DB = 80.0


def check_error(error: float, tolerance: float, name: str, detail: str = "") -> None:
  """Asserts error <= tolerance (both >= 0, same units) and records the ratio under TOL_REPORT."""
  error, tolerance = float(error), float(tolerance)
  ratio = error / tolerance if tolerance > 0 else (0.0 if error == 0 else math.inf)
  path = os.environ.get("TOL_REPORT")
  if path:
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    line = json.dumps(dict(test=test, name=name, error=error, tolerance=tolerance, ratio=ratio))
    with open(path, "a") as f:  # one short O_APPEND write per line: safe across xdist workers
      f.write(line + "\n")
  assert error <= tolerance, (f"{name}: error {error:.3g} > tolerance {tolerance:.3g} "
                              f"(ratio {ratio:.2f}){'; ' + detail if detail else ''}")


def assert_close_scaled(actual, expected, *, rel: float, scale=None, name: str) -> None:
  """Asserts |actual - expected| <= rel * scale element-wise.

  Args:
    actual, expected: arrays of the same shape (any float dtype; compared in float64).
    rel: the tolerance in units of `scale`, e.g. `8 * EPS_F32` (say in a comment where 8 comes from).
    scale: None for max|expected| (absolute error in units of the output's scale); or an array
      broadcastable to the values for a per-element scale, e.g. the magnitude of the largest term
      of a sum that cancels.
    name: what is compared, for the message and the TOL_REPORT line.

  The recorded error is max(|actual - expected| / scale), in the same units as `rel`.
  """
  a = np.asarray(actual, np.float64)
  b = np.asarray(expected, np.float64)
  assert a.shape == b.shape, f"{name}: shapes {a.shape} vs {b.shape}"
  assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), f"{name}: non-finite values"
  if scale is None:
    scale = np.max(np.abs(b))
  scale = np.broadcast_to(np.asarray(scale, np.float64), a.shape)
  assert np.all(scale > 0), f"{name}: the scale must be positive (an all-zero reference?)"
  err = np.abs(a - b) / scale
  worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
  detail = (f"worst at {tuple(int(i) for i in worst)}: {a[worst]!r} vs {b[worst]!r} (scale "
            f"{scale[worst]:.3g}); {int(np.sum(err > rel))} of {err.size} elements over") if err.size else ""
  check_error(err.max(initial=0.0), rel, name, detail)


def assert_mostly_equal(actual, expected, *, max_fraction_differing: float, name: str) -> None:
  """Asserts that at most `max_fraction_differing` of the elements differ at all.

  For low-precision outputs whose rounding points are the property: with the same rounding points,
  only values whose exact result lies within a few fp32 ulps of a rounding boundary can round the
  other way (a fraction ~ fp32 eps / bf16 eps x roundings); a missing or extra rounding moves a
  large fraction (~25 % for one extra bf16 rounding).
  """
  a = np.asarray(actual, np.float64)
  b = np.asarray(expected, np.float64)
  assert a.shape == b.shape, f"{name}: shapes {a.shape} vs {b.shape}"
  fraction = float(np.mean(a != b))
  check_error(fraction, max_fraction_differing, f"{name} (fraction of elements differing)")


def assert_psnr_at_least(actual, expected, min_db: float, *, name: str) -> float:
  """Asserts PSNR(actual, expected) >= min_db for values in [0, 1]; returns the PSNR in dB.

  Recorded as the RMS error against 10^(-min_db / 20) (both in units of the data range 1), so the
  ratio reads like every other check: a 4x margin is 12 dB.
  """
  a = np.asarray(actual, np.float64)
  b = np.asarray(expected, np.float64)
  assert a.shape == b.shape, f"{name}: shapes {a.shape} vs {b.shape}"
  rms = float(np.sqrt(np.mean((a - b) ** 2)))
  value = math.inf if rms == 0 else -20 * math.log10(rms)
  check_error(rms, 10 ** (-min_db / 20), name, f"PSNR {value:.1f} dB < {min_db} dB")
  return value


def check_psnr(psnr_db: float, min_db: float, name: str) -> None:
  """As `assert_psnr_at_least` for a PSNR some tool already computed."""
  rms = 0.0 if math.isinf(psnr_db) else 10 ** (-psnr_db / 20)
  check_error(rms, 10 ** (-min_db / 20), name, f"PSNR {psnr_db:.1f} dB < {min_db} dB")
