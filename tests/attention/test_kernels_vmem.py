"""The TPU kernel's own scoped VMEM limit (`kernels.tpu_vmem_limit`): large blocks compile without a
process-wide `--xla_tpu_scoped_vmem_limit_kib`, and the default blocks' programs are unchanged."""

import re

import jax
import jax.numpy as jnp
import pytest

from attention import BlockSizes, local_attention
from attention import kernels

MiB = 2 ** 20
# What Mosaic (libtpu 0.0.42, compiled ahead for one v5e: `bench.tune_blocks --topology v5e:2x2
# --seq 32768`) asked for the block pairs it refused at XLA's 16 MiB default, [1, 32768, 12, 128]
# bf16: (block_q, block_kv) -> (LSE, fixed-m) MiB.
MOSAIC_V5E = {(2048, 1024): (18.43, 16.44), (2048, 2048): (24.81, 21.84), (4096, 1024): (29.89, 26.22),
              (4096, 2048): (48.13, 42.84)}


@pytest.mark.parametrize("blocks", sorted(MOSAIC_V5E))
def test_the_bound_covers_what_mosaic_asked_for(blocks):
  need = kernels.tpu_vmem_bytes(*blocks, 1, 128, 2)
  assert need >= max(MOSAIC_V5E[blocks]) * MiB
  assert kernels.tpu_vmem_limit(*blocks, 1, 128, 2) == min(need, kernels.TPU_VMEM_LIMIT_CAP)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_the_default_blocks_keep_xla_s_default(itemsize):
  """1024 x 1024 (v6e's default; bf16 and fp32 inputs) stays within XLA's default limit."""
  default = kernels.tpu_vmem_limit(1024, 1024, 1, 128, itemsize)
  assert default is None and kernels.tpu_vmem_limit(8192, 8192, 1, 128, 2) == kernels.TPU_VMEM_LIMIT_CAP


def _scoped_sizes(block_sizes: BlockSizes) -> list[int]:
  """The scoped-memory sizes in the TPU custom call of our kernel, lowered for a TPU here (no chip)."""
  q = jax.ShapeDtypeStruct((1, 8192, 2, 128), jnp.bfloat16)
  fn = jax.jit(lambda q, k, v: local_attention(q, k, v, implementation="fixed_m", block_sizes=block_sizes,
                                               backend="pallas"))
  text = fn.trace(q, q, q).lower(lowering_platforms=("tpu",)).as_text()
  call = text[text.index("@tpu_custom_call"):]
  config = call[:call.index("}\"")]
  return [int(x) for x in re.findall(r"\\22size\\22: (\d+)", config)]


def test_the_lowered_kernel_carries_the_limit():
  """4096 x 2048 asks for its bound in the custom call's scoped memory configs; 1024 x 1024 for none
  (the positive control: the same kernel, XLA's default)."""
  assert _scoped_sizes(BlockSizes(4096, 2048)) == [kernels.tpu_vmem_limit(4096, 2048, 1, 128, 2)]
  assert _scoped_sizes(BlockSizes(1024, 1024)) == []
