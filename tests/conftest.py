"""Test harness: every test sees 8 fake CPU devices.

XLA reads the device count when the backend initialises, so the flag must be set before anything
imports jax; pytest imports conftest.py first, which makes this the place. Flags already in
XLA_FLAGS are kept (e.g. `--xla_cpu_max_isa=AVX2` to round as another CPU does; docs/numerics.md); the
device count is added to them.
"""

import os
import sys

import pytest

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


def pytest_configure(config):
  config.addinivalue_line("markers", "exhaustive: runs after the default set (tests/selection.py); "
                          "`-m exhaustive` selects it")


def pytest_collection_modifyitems(config, items):
  """Marks the tests of `selection.EXHAUSTIVE` (and `large` ones) `exhaustive`; without a `-m` that
  names `exhaustive`, leaves them out (the README's test command), as `-m` would."""
  from tests.selection import EXHAUSTIVE, is_exhaustive

  later = [item for item in items if is_exhaustive(item)]
  for item in later:
    item.add_marker("exhaustive")
  names = {n for item in items for n in (item.name, getattr(item, "originalname", item.name))}
  whole_suite = all(os.path.abspath(a) == os.path.dirname(os.path.abspath(__file__)) for a in config.args)
  if whole_suite and (unknown := sorted(EXHAUSTIVE - names)):
    raise pytest.UsageError(f"tests/selection.py names tests that do not exist: {unknown}")
  if "exhaustive" in (config.getoption("markexpr") or ""):
    return
  kept = [item for item in items if not is_exhaustive(item)]
  if len(kept) < len(items):
    config.hook.pytest_deselected(items=later)
    items[:] = kept


def pytest_collection_finish(session):
  """The torch references run torch's own convolutions, not oneDNN's: torch 2.13's oneDNN conv3d
  decodes a batch of videos wrongly on some AMD EPYC CPUs (measured: the diffusers Wan
  VAE's decode of a batch of 2, video 0 from its third frame on, 0.03-0.19 from the same video
  decoded alone; 5e-7 with oneDNN off), which a reference must not. Test modules import torch as
  they are collected, so this runs before any test (in every xdist worker)."""
  torch = sys.modules.get("torch")
  if torch is not None:
    torch.backends.mkldnn.enabled = False
