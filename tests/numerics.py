"""Error checks that report their margins, shared by every numeric test.

A tolerance is either bit-exactness (only where that IS the property under test; the call site says
why) or an error bound in units of the compared values' scale, derived from error analysis: scale x
eps(dtype) x (roundings + accumulation length), stated where it is used. XLA:CPU's rounding differs
between CPUs (FMA contraction, vector width, transcendental approximations), so every bound keeps a
>= 4x margin over the worst error measured under three ISA settings: XLA_FLAGS unset,
--xla_cpu_max_isa=AVX2 and --xla_cpu_max_isa=SSE4_2.

Every check goes through `within`, so one run with NUMERICS_REPORT=FILE appends one JSON line per
check, {"test", "label", "err", "tol", "ratio"}, from which the largest error / tolerance ratio of
the suite can be read (the checks still assert).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

# fp32 unit roundoff (half the spacing at 1.0).
U32 = 2.0**-24
EPS_F32 = 2.0**-23  # np.finfo(np.float32).eps: spacing of fp32 at 1.0 (= 2 * U32)
EPS_BF16 = 2.0**-7  # spacing of bfloat16 at 1.0 (7 stored mantissa bits)

# Attention outputs are convex combinations of the rows of v, so their errors are in units of the
# value scale max|v|. First-order fp32 error per output: the logit/exp2-argument rounding,
# ~|argument| * U32 relative per weight with arguments of a few to ~20 units (base 2), plus the
# blocked sums over S keys; measured <= 7 U32 * max|v| on every ISA setting (the 4x4 grid of
# test_attention_local, H = 128, windows), so 32 keeps a >= 4x margin. Real bugs move outputs far
# more: one spurious zero key among S shifts them by ~|o| / S (1e-4 at S = 1,280 with |o| ~ 0.2).
FP32_ATTENTION_ULPS = 32

# Two fp32 runs of the whole pipeline (ours vs diffusers, or ours on two meshes, processes, batch
# layouts or attention paths): each transformer forward within ~1e-5 of its output's scale
# (tests/pipelines/wan/transformer/test_model.py) over a few steps, the decode within 1e-4 of the video's range
# (tests/pipelines/wan/vae/test_model.py), so the video's RMS error is <= 1e-4 of its range 1: PSNR >= 80 dB. Measured
# >= 142 dB under three ISA settings. Real bugs cost far more (spurious keys in the softmax: 43 dB).
FP32_VIDEO_PSNR_DB = 80.0


def fp32_attention_tol(v) -> float:
  """Absolute tolerance for fp32 attention outputs whose values are `v`: 32 * 2^-24 * max|v|."""
  return FP32_ATTENTION_ULPS * U32 * float(np.max(np.abs(np.asarray(v, np.float32))))


def within(err: float, tol: float, label: str = "", detail: str = "") -> None:
  """Asserts err <= tol; with NUMERICS_REPORT set, appends the pair to that JSON-lines file."""
  err, tol = float(err), float(tol)
  ratio = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)
  path = os.environ.get("NUMERICS_REPORT")
  if path:
    with open(path, "a") as f:  # one short O_APPEND write per line: safe across xdist workers
      f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                          "label": label, "err": err, "tol": tol, "ratio": ratio}) + "\n")
  assert err <= tol, f"{label}: error {err:.3g} > tolerance {tol:.3g}" + (detail and f"; {detail}")


def assert_close_scaled(actual, expected, *, rel: float, scale=None, name: str) -> None:
  """Asserts |actual - expected| <= rel * scale element-wise.

  Args:
    actual, expected: arrays of the same shape (any float dtype; compared in float64).
    rel: the tolerance in units of `scale`, e.g. `8 * EPS_F32` (a comment says where 8 comes from).
    scale: None for max|expected| (absolute error in units of the output's scale); or an array
      broadcastable to the values for a per-element scale, e.g. the magnitude of the largest term
      of a sum that cancels.
    name: what is compared, for the message and the report line.

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
  detail = ""
  if err.size:
    worst = np.unravel_index(np.argmax(err), err.shape)
    detail = (f"worst at {tuple(int(i) for i in worst)}: {a[worst]!r} vs {b[worst]!r} (scale "
              f"{scale[worst]:.3g}); {int(np.sum(err > rel))} of {err.size} elements over")
  within(err.max(initial=0.0), rel, name, detail)


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
  within(float(np.mean(a != b)), max_fraction_differing, f"{name} (fraction of elements differing)")


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
  within(rms, 10 ** (-min_db / 20), name, f"PSNR {value:.1f} dB < {min_db} dB")
  return value


def check_psnr(psnr_db: float, min_db: float, name: str) -> None:
  """As `assert_psnr_at_least` for a PSNR some tool already computed."""
  rms = 0.0 if math.isinf(psnr_db) else 10 ** (-psnr_db / 20)
  within(rms, 10 ** (-min_db / 20), name, f"PSNR {psnr_db:.1f} dB < {min_db} dB")
