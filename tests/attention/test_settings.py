"""The attention settings (attention/settings.py): `BlockSizes` checks, the backend choice, the default
blocks per platform and TPU generation (also as the mesh calls look them up), and a JAX-free import."""

import jax
import pytest

from attention import BlockSizes, local_attention, make_mesh, resolve_backend, usp_attention
from attention import block_layout, blockwise
from attention.halo import halo_attention
from tests.attention.test_blockwise import _inputs
from tests.harness import REPO_ROOT

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


@pytest.mark.parametrize("bad", [dict(block_q=0), dict(block_kv=-4), dict(block_q=1.5), dict(block_kv_compute=0),
                                 dict(block_kv=1024, block_kv_compute=384)])
def test_bad_block_sizes_raise(bad):
  with pytest.raises(ValueError, match="BlockSizes"):
    BlockSizes(**bad)


def test_backend_choice_and_errors():
  assert resolve_backend("auto", "cpu") == "xla"
  assert resolve_backend("auto", "tpu") == resolve_backend("auto", "gpu") == "pallas"
  assert resolve_backend("xla", "tpu") == "xla"
  q, k, v = _inputs(1, 8, 8, 2, 2, 16)
  with pytest.raises(ValueError, match="unknown attention backend"):
    local_attention(q, k, v, backend="triton")
  with pytest.raises(ValueError, match="multiples of 128"):
    local_attention(q, k, v, backend="pallas", block_sizes=BlockSizes(64, 128))
  # Defaults follow the platform compiled for (a TPU mesh from a CPU host gets the TPU blocks).
  assert blockwise.check_block_sizes(None, "pallas", "tpu") == BlockSizes(512, 1024)
  # TPU v5e / v6e: their own entries (docs/measurements/attention.md, Block sizes per TPU generation).
  assert blockwise.check_block_sizes(None, "pallas", "tpu", "TPU v5 lite") == BlockSizes(4096, 1024)
  assert blockwise.check_block_sizes(None, "pallas", "tpu", "TPU v6 lite") == BlockSizes(1024, 1024)
  assert blockwise.check_block_sizes(None, "pallas", "tpu", "TPU v4") == BlockSizes(512, 1024)
  assert blockwise.check_block_sizes(None, "pallas", "cuda") == BlockSizes(128, 128)
  assert blockwise.check_block_sizes(None, "xla", "cpu") == BlockSizes(1024, 512)
  # Pallas blocks: powers of two >= 128, capped by the given sizes.
  layout = block_layout.BlockLayout.make(1000, 7, BlockSizes(512, 1024), "pallas")
  assert (layout.block_q, layout.block_kv, layout.T_pad, layout.S_pad) == (512, 128, 1024, 128)


def test_default_blocks_per_tpu_generation(monkeypatch):
  from attention import settings

  # Device kinds as JAX reports them (real chips and AOT topologies alike).
  assert settings.platform_key("tpu", "TPU v5 lite") == settings.platform_key("tpu", "TPU v5e") == "tpu-v5e"
  assert settings.platform_key("tpu", "TPU v6 lite") == settings.platform_key("tpu", "TPU v6e") == "tpu-v6e"
  assert settings.platform_key("tpu", "TPU v4") == settings.platform_key("tpu", None) == "tpu"
  assert settings.platform_key("cuda", "NVIDIA H100 80GB HBM3") == "gpu"
  assert settings.platform_key("cpu", "TPU v6 lite") == "cpu"  # a kind only counts on its platform
  # Each generation reads its own entry, other TPUs the plain "tpu" one, then the CPU's. Distinct
  # entries, so that equal defaults could not make the lookup pass by accident.
  sentinels = {"tpu-v5e": BlockSizes(128, 256), "tpu-v6e": BlockSizes(256, 128), "tpu": BlockSizes(384, 384)}
  for platform, sizes in sentinels.items():
    monkeypatch.setitem(settings.DEFAULT_BLOCKS, ("pallas", platform), sizes)
  assert blockwise.check_block_sizes(None, "pallas", "tpu", "TPU v5 lite") == sentinels["tpu-v5e"]
  assert blockwise.check_block_sizes(None, "pallas", "tpu", "TPU v6 lite") == sentinels["tpu-v6e"]
  assert blockwise.check_block_sizes(None, "pallas", "tpu", "TPU v5p") == sentinels["tpu"]
  assert BlockSizes.get_default("pallas", "tpu") == sentinels["tpu"]
  assert BlockSizes.get_default("xla", "tpu", "TPU v6 lite") == settings.DEFAULT_BLOCKS[("xla", "cpu")]
  with pytest.raises(ValueError, match="no default block sizes"):
    BlockSizes.get_default("triton", "cpu")
  # A mesh's calls pass its devices' kind (here the CPU's), not just the platform.
  seen = []

  def record(block_sizes, backend, platform=None, device_kind=None):
    seen.append((platform, device_kind))
    raise RuntimeError("recorded")

  monkeypatch.setattr(blockwise, "check_block_sizes", record)
  q, k, v = _inputs(1, 8, 8, 2, 2, 16)
  mesh = make_mesh(ulysses=2, ring=1)
  for call in (lambda: usp_attention(q, k, v, mesh=mesh),
               lambda: halo_attention(q, k, v, mesh=mesh, window=2)):
    with pytest.raises(RuntimeError, match="recorded"):
      call()
  assert seen == [("cpu", jax.devices()[0].device_kind)] * 2


def test_settings_import_without_jax():
  import pathlib
  import subprocess
  import sys

  code = "import sys, attention.settings as s; s.platform_key('tpu', 'TPU v6 lite'); print('jax' in sys.modules)"
  root = pathlib.Path(REPO_ROOT)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
  assert out.stdout.strip() == "False"
