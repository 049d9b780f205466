"""Error checks that can report their margins: every tolerance in the attention tests goes through
`within`, so one run with NUMERICS_REPORT=FILE records (test, label, error, tolerance) per check.

Run the suite under the three ISA settings (XLA_FLAGS unset, --xla_cpu_max_isa=AVX2, =SSE4_2) with
the report on to see the largest error / tolerance ratio; tolerances keep a >= 4x margin over it.
"""

from __future__ import annotations

import json
import os

import numpy as np

# fp32 unit roundoff.
U32 = 2.0**-24
# Attention outputs are convex combinations of the rows of v, so their errors are in units of the
# value scale max|v|. First-order fp32 error per output: the logit/exp2-argument rounding,
# ~|argument| * U32 relative per weight with arguments of a few to ~20 units (base 2), plus the
# blocked sums over S keys; measured <= 7 U32 * max|v| on every ISA setting (the 4x4 grid of
# test_attention_local, H = 128, windows), so 32 keeps a >= 4x margin. Real bugs move outputs far
# more: one spurious zero key among S shifts them by ~|o| / S (1e-4 at S = 1,280 with |o| ~ 0.2).
FP32_ATTENTION_ULPS = 32


def fp32_attention_tol(v) -> float:
  """Absolute tolerance for fp32 attention outputs whose values are `v`: 32 * 2^-24 * max|v|."""
  return FP32_ATTENTION_ULPS * U32 * float(np.max(np.abs(np.asarray(v, np.float32))))


def within(err: float, tol: float, label: str = "") -> None:
  """Asserts err <= tol; with NUMERICS_REPORT set, appends the pair to that JSON-lines file."""
  err = float(err)
  path = os.environ.get("NUMERICS_REPORT")
  if path:
    with open(path, "a") as f:
      f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                          "label": label, "err": err, "tol": tol, "ratio": err / tol}) + "\n")
  assert err <= tol, f"{label}: error {err:.3g} > tolerance {tol:.3g}"
