"""Two real-width Wan transformer blocks (Wan 2.1 1.3B: D = 1536, 12 heads x 128, FFN 8960, text
width 4096) run on the TPU against the same weights and inputs run on the CPU backend in fp32.

The model is `init_transformer` of the 1.3B config cut to 2 layers (random weights from seed 0:
torch's default init, as diffusers' before loading), on a small video: 3 latent frames of 480p's
30 x 52 latent grid, 1,170 tokens (not a multiple of any attention block), 512 text tokens. The
forward runs on a one-device mesh of each backend (`ParallelPlan` of `make_mesh(1, 1, [device])`:
the TPU's attention is the Pallas kernels, the CPU's XLA loops).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention import make_mesh
from pipelines.parallel.plan import ParallelPlan
from pipelines.pipeline.run.precision import matmul_precision
from pipelines.wan.transformer import forward, init_transformer, PRESETS
from tests.numerics import EPS_F32, within
from tests.tpu.backends import assert_on, cpu, on, tpu

pytestmark = pytest.mark.tpu

CONFIG = dataclasses.replace(PRESETS["wan2.1-t2v-1.3b"], num_layers=2)
GRID = (3, 30, 52)  # (F, Hl, Wl) -> 3 x 15 x 26 = 1,170 tokens
TEXT_TOKENS = 512

# fp32 against fp32, relative to the output's max: 2 blocks, each a chain of about 4 matmul-like
# sums (attention scores and values, projections, FFN) whose rounding errors grow like sqrt(K)
# with the longest K = 8,960 (the FFN): 2 * 4 * sqrt(8960) eps = 9e-5 (the bound of
# tests/pipelines/wan/transformer/test_model.py at this width); x 4 for the TPU's "highest" (bf16
# passes that come to about fp32, not IEEE fp32) and its own exp / tanh / rsqrt.
FP32_REL = 4 * CONFIG.num_layers * 4 * math.sqrt(CONFIG.ffn_dim) * EPS_F32
# bf16 against fp32, RMS relative to the output's RMS: per block about 16 roundings to bf16 (unit
# roundoff 2^-9) that change the output (8 Linear / attention outputs, and the bf16 weights of 8
# Linears), adding at most linearly over 2 blocks: 2 * 16 * 2^-9 = 0.0625.
BF16_RMS_REL = CONFIG.num_layers * 16 * 2.0**-9
# Measured on a v5e (JAX 0.10.2): fp32 at "highest" 2.5e-5 (FP32_REL 3.6e-4), bf16 5.5e-3 (0.0625).

_forward = jax.jit(forward, static_argnames=("plan",))


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  latents = rng.standard_normal((1, CONFIG.in_channels, *GRID), np.float32)
  timestep = np.array([500.0], np.float32)
  text = rng.standard_normal((1, TEXT_TOKENS, CONFIG.text_dim), np.float32)
  return latents, timestep, text


def _run(dtype, device: jax.Device) -> jax.Array:
  """The 2-block forward of `dtype` weights (drawn on the CPU, placed on `device`) on `device`."""
  with jax.default_device(cpu()):
    model = init_transformer(CONFIG, seed=0, dtype=dtype)
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, on(device, state))
  plan = ParallelPlan.build(make_mesh(1, 1, [device]), heads=CONFIG.num_attention_heads)
  out = _forward(model, *on(device, _inputs()), plan=plan)
  assert_on(out, device.platform, f"the {jnp.dtype(dtype).name} forward")
  return out


@pytest.fixture(scope="module")
def cpu_fp32() -> np.ndarray:
  with matmul_precision(jnp.float32):  # what the CPU does anyway
    return np.asarray(_run(jnp.float32, cpu()), np.float64)


def _errors(out: jax.Array, ref: np.ndarray) -> tuple[float, float]:
  """(max |out - ref| / max |ref|, RMS(out - ref) / RMS(ref))."""
  diff = np.asarray(jnp.asarray(out, jnp.float32), np.float64) - ref
  return (float(np.abs(diff).max() / np.abs(ref).max()),
          float(np.sqrt(np.mean(diff ** 2)) / np.sqrt(np.mean(ref ** 2))))


def test_fp32_blocks_at_highest_equal_the_cpu(cpu_fp32):
  """fp32 on the TPU under the pipeline's fp32 precision (`precision.matmul_precision`: "highest")
  is within `FP32_REL` of the CPU; the same forward at the TPU's default precision (one bf16 pass
  per matmul) is not (control: the bar tells the two apart)."""
  with matmul_precision(jnp.float32):
    assert jax.config.jax_default_matmul_precision == "highest"
    highest = _run(jnp.float32, tpu())
  worst, rms = _errors(highest, cpu_fp32)
  within(worst, FP32_REL, "fp32 TPU (highest) vs CPU, max / max|ref|", f"rms rel {rms:.3g}")
  default_worst, _ = _errors(_run(jnp.float32, tpu()), cpu_fp32)
  assert default_worst > FP32_REL, (f"control: the TPU's default precision is {default_worst:.3g} from the CPU, "
                                    f"within the fp32 bar {FP32_REL:.3g}: the bar cannot see bf16 passes")


def test_bf16_blocks_within_bf16_rounding_of_the_cpu_fp32(cpu_fp32):
  worst, rms = _errors(_run(jnp.bfloat16, tpu()), cpu_fp32)
  within(rms, BF16_RMS_REL, "bf16 TPU vs fp32 CPU, RMS / RMS(ref)", f"max rel {worst:.3g}")
