"""Test harness: every test sees 8 fake CPU devices.

XLA reads the device count when the backend initialises, so the flag must be set before anything
imports jax; pytest imports conftest.py first, which makes this the place. Flags already in
XLA_FLAGS are kept (e.g. `--xla_cpu_max_isa=AVX2` to round as another CPU does; README, Test); the
device count is added to them.
"""

import os

from tests.harness import DEVICE_FLAG

os.environ["JAX_PLATFORMS"] = "cpu"
# generate's persistent compilation cache stays off (never the user's ~/.cache) unless a test
# points it at a temporary directory.
os.environ["WAN_USP_JAX_COMPILE_CACHE"] = "off"
_flags = os.environ.get("XLA_FLAGS", "")
if DEVICE_FLAG not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --{DEVICE_FLAG}=8".strip()

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.device_count()}"
