"""Test harness: every test sees 8 fake CPU devices; or, with `WAN_TEST_PLATFORM=tpu`, the TPU pass.

XLA reads the device count when the backend initialises, so the flag must be set before anything
imports jax; pytest imports conftest.py first, which makes this the place. Flags already in
XLA_FLAGS are kept (e.g. `--xla_cpu_max_isa=AVX2` to round as another CPU does; docs/numerics.md); the
device count is added to them.

`WAN_TEST_PLATFORM=tpu` (end_to_end/tpu_recipe.sh sets it, on a machine with a TPU): JAX keeps its
own platforms (the TPU, and the CPU backend the tests compute their references on), no fake
devices, and only the tests marked `tpu` run (tests/tpu/). Without it those are collected and
skipped (`TPU_SKIP_REASON`), so the CPU suite and CI list them.
"""

import os
import sys

import pytest

from tests.harness import DEVICE_FLAG

PLATFORM_VARIABLE = "WAN_TEST_PLATFORM"
TPU_PASS = os.environ.get(PLATFORM_VARIABLE, "") == "tpu"
TPU_SKIP_REASON = "needs a TPU: bash end_to_end/tpu_recipe.sh runs them"

# generate's persistent compilation cache stays off (never the user's ~/.cache) unless a test
# points it at a temporary directory.
os.environ["WAN_USP_JAX_COMPILE_CACHE"] = "off"
if not TPU_PASS:
  os.environ["JAX_PLATFORMS"] = "cpu"
  _flags = os.environ.get("XLA_FLAGS", "")
  if DEVICE_FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --{DEVICE_FLAG}=8".strip()

import jax  # noqa: E402

if not TPU_PASS:
  assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.device_count()}"


def _check_tpu_pass() -> None:
  """The TPU pass needs a TPU as JAX's default backend and the CPU backend beside it.

  Raises:
    pytest.UsageError: naming what JAX sees and the fix.
  """
  if os.environ.get(PLATFORM_VARIABLE) not in (None, "", "tpu"):
    raise pytest.UsageError(f"{PLATFORM_VARIABLE}={os.environ[PLATFORM_VARIABLE]!r}: the only value is 'tpu' "
                            "(unset for the CPU suite)")
  if not TPU_PASS:
    return
  if jax.default_backend() != "tpu":
    raise pytest.UsageError(f"{PLATFORM_VARIABLE}=tpu but JAX's default backend is {jax.default_backend()!r} "
                            f"({jax.devices()}); run on a TPU machine with libtpu installed")
  try:
    jax.devices("cpu")
  except RuntimeError as e:
    raise pytest.UsageError(f"{PLATFORM_VARIABLE}=tpu needs the CPU backend too (the tests' references; "
                            f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}): unset JAX_PLATFORMS "
                            f"or set it to 'tpu,cpu' ({e})") from e


def pytest_configure(config):
  config.addinivalue_line("markers", "exhaustive: runs after the default set (tests/selection.py); "
                          "`-m exhaustive` selects it")
  config.addinivalue_line("markers", f"tpu: runs on a TPU against the CPU backend ({PLATFORM_VARIABLE}=tpu, "
                          "end_to_end/tpu_recipe.sh); skipped elsewhere")
  _check_tpu_pass()


def _select_platform(config, items) -> None:
  """The TPU pass keeps only the `tpu` tests (deselecting the rest); the CPU suite skips them."""
  on_tpu = [item for item in items if item.get_closest_marker("tpu") is not None]
  if TPU_PASS:
    rest = [item for item in items if item.get_closest_marker("tpu") is None]
    if rest:
      config.hook.pytest_deselected(items=rest)
      items[:] = on_tpu
    return
  for item in on_tpu:
    item.add_marker(pytest.mark.skip(reason=TPU_SKIP_REASON))


def pytest_collection_modifyitems(config, items):
  """The platform's tests (`_select_platform`); then marks the tests of `selection.EXHAUSTIVE` (and
  `large` ones) `exhaustive` and, without a `-m` that names `exhaustive`, leaves them out (the
  README's test command), as `-m` would."""
  from tests.selection import EXHAUSTIVE, is_exhaustive

  names = {n for item in items for n in (item.name, getattr(item, "originalname", item.name))}
  whole_suite = all(os.path.abspath(a) == os.path.dirname(os.path.abspath(__file__)) for a in config.args)
  if whole_suite and (unknown := sorted(EXHAUSTIVE - names)):
    raise pytest.UsageError(f"tests/selection.py names tests that do not exist: {unknown}")
  _select_platform(config, items)
  later = [item for item in items if is_exhaustive(item)]
  for item in later:
    item.add_marker("exhaustive")
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


# XLA:CPU maps each compiled program's code into the process (about 6 memory-map regions a program,
# measured with JAX 0.10.2), and JAX's caches keep every program a test module compiled. A worker
# that runs ~1000 tests holds tens of thousands of regions; past the kernel's vm.max_map_count
# (65,530 by default) LLVM's next code mapping fails and the worker dies with SIGSEGV inside a
# compile (seen in CI, in whichever test compiled then). Past `MAX_MAP_REGIONS` the caches are
# cleared between test modules (a module's own programs stay cached while it runs).
MAX_MAP_REGIONS = 20_000


def map_regions() -> int:
  """Memory-map regions of this process (Linux: lines of /proc/self/maps; 0 elsewhere)."""
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test module: `jax.clear_caches()` once the process maps more than `MAX_MAP_REGIONS`."""
  yield
  if map_regions() > MAX_MAP_REGIONS:
    import gc

    jax.clear_caches()
    gc.collect()
