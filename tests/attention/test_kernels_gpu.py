"""The GPU kernel's own sizing (attention/kernels_gpu.py); its arithmetic is checked in interpret mode
beside the TPU kernel's in tests/attention/test_kernels.py (`attend_kernel(kernel="gpu")`)."""

import jax.numpy as jnp
import pytest

from attention import kernels_gpu


@pytest.mark.parametrize("bk,Hp,dtype,stages", [(128, 128, jnp.bfloat16, 2), (128, 64, jnp.float32, 2),
                                                (128, 128, jnp.float32, 1), (256, 128, jnp.bfloat16, 1)])
def test_gpu_pipeline_stages_fit_shared_memory(bk, Hp, dtype, stages):
  """The GPU kernel pipelines its key loop 2 deep only where two stages of K and V tiles fit the shared
  memory a Triton program may plan for: fp32 at bk = Hp = 128 asked an H200 for 262,656 bytes of its
  232,448 with 2 stages (measured), and runs with 1. The depth chosen always fits."""
  itemsize = jnp.dtype(dtype).itemsize
  assert kernels_gpu.gpu_pipeline_stages(bk, Hp, itemsize) == stages
  assert stages * 2 * bk * Hp * itemsize <= kernels_gpu.GPU_SHARED_BYTES
