"""Test harness: every test sees 8 fake CPU devices.

XLA reads the device count when the backend initialises, so the flag must be set before anything
imports jax; pytest imports conftest.py first, which makes this the place.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.device_count()}"
