"""The Pallas attention kernels (attention/kernels.py) compiled for the TPU (Mosaic, not interpret
mode) at real Wan shapes, against dense fp32 attention computed on the CPU backend.

The CPU suite checks the same kernels exactly in interpret mode (tests/attention/test_kernels.py);
this checks what Mosaic compiles of them: 32,760 tokens x 12 heads x 128 (Wan 2.1 1.3B, 480x832 x
81 frames: 21 x 30 x 52 tokens, not a multiple of any block, so the tail block is masked) and 40
heads x 128 (Wan 14B's heads) at 10,800 tokens (1280x720 x 9 frames), both paths (online-softmax
LSE and fixed-m) and "auto" (the cond between them). The dense reference is computed for `ROWS`
query rows spread over the sequence (first and last included) against every key: all 32,760 rows
would be a 12 x 32,760^2 fp32 score matrix (51 GB) on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import BlockSizes, attention_reference, local_attention
from tests.numerics import U32, within
from tests.tpu.backends import assert_on, cpu, on, tpu

pytestmark = pytest.mark.tpu

# name -> (tokens T = S, heads N = K), head dim 128, one video.
SHAPES = {"wan2.1-1.3b-480p": (32760, 12), "wan-14b-heads": (10800, 40)}
H = 128
ROWS = 512
# None: the chip's default blocks; "chunks": 2048-key blocks in 512-key chunks (`block_kv_compute`),
# whose padded last block masks only its chunks past the real keys.
BLOCKS = {"default": None, "chunks": BlockSizes(4096, 2048, 512)}
U_BF16 = 2.0**-9  # bf16 unit roundoff (8 significant bits)


def _inputs(T: int, N: int, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """bf16 q, k, v [1, T, N, H] on the CPU: q, k ~ N(0, 1) (logits of unit scale after 1/sqrt(H)),
  k with mean 0.5 (fixed-m's virtual centring has work to do), v ~ N(1, 1) (outputs of order 1, so
  the output's own rounding shows)."""
  rng = np.random.default_rng(seed)
  shape = (1, T, N, H)
  q = rng.standard_normal(shape, np.float32)
  k = rng.standard_normal(shape, np.float32) + 0.5
  v = rng.standard_normal(shape, np.float32) + 1.0
  return tuple(on(cpu(), jnp.asarray(x, jnp.bfloat16)) for x in (q, k, v))


def _dense_rows(q, k, v, rows: np.ndarray) -> jax.Array:
  """fp32 dense attention of the bf16 inputs (exact in fp32: `attention_reference`, HIGHEST
  matmuls) for query `rows` against every key, on the CPU."""
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  out = jax.jit(attention_reference)(f32(q[:, rows]), f32(k), f32(v))
  assert_on(out, "cpu", "the dense reference")
  return out


@pytest.mark.parametrize("blocks", list(BLOCKS))
@pytest.mark.parametrize("implementation", ["lse", "fixed_m", "auto"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compiled_kernel_equals_dense_fp32(shape, implementation, blocks):
  """Both paths, and "auto" (the gate's `lax.cond` between the two kernels, as the model calls it),
  compiled by Mosaic (a `tpu_custom_call` in the program), at the default blocks and in key chunks,
  within the bound below of dense fp32 attention of the same bf16 inputs."""
  T, N = SHAPES[shape]
  q, k, v = _inputs(T, N, seed=T + N)
  call = jax.jit(functools.partial(local_attention, implementation=implementation, backend="pallas",
                                   block_sizes=BLOCKS[blocks]))
  args = on(tpu(), (q, k, v))
  lowered = call.lower(*args)
  assert "tpu_custom_call" in lowered.as_text(), "the Pallas kernel was not lowered to Mosaic for the TPU"
  out = lowered.compile()(*args)
  assert_on(out, "tpu", "the kernel")
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  rows = np.unique(np.linspace(0, T - 1, ROWS).round().astype(int))
  ref = np.asarray(_dense_rows(q, k, v, rows), np.float64)
  got = np.asarray(jnp.asarray(out[:, rows], jnp.float32), np.float64)
  assert np.all(np.isfinite(got)), f"{implementation}: non-finite outputs (fixed-m's gate refused?)"
  # Both see the same bf16 inputs; the kernel's products q.k and p.v are of bf16 operands (exact in
  # the MXU's fp32 accumulators). Its two roundings beyond fp32: the probabilities p enter p.v as
  # bf16 (each weight w_j off by a factor 1 + d_j, |d_j| <= 2^-9, while l sums the fp32 p: the
  # output moves by sum_j w_j d_j v_j, at most 2^-9 max|v|), and the output is stored in bf16
  # (2^-9 |o| <= 2^-9 max|v|). The fp32 remainder (exp2 of arguments of a few units, sums of
  # block_kv terms and S / block_kv carries) is below 64 fp32 ulps of max|v|.
  v_max = float(jnp.max(jnp.abs(jnp.asarray(v, jnp.float32))))
  tol = (2 * U_BF16 + 64 * U32) * v_max
  err = np.abs(got - ref)
  # Measured on a v5e (JAX 0.10.2), default blocks: 0.0040 for every shape and path, tol 0.024-0.025
  # (the chunked blocks are not yet run on a chip).
  within(float(err.max()), tol, f"{shape} {implementation} {blocks} max |kernel - dense|",
         f"rms {float(np.sqrt(np.mean(err ** 2))):.3g}")
