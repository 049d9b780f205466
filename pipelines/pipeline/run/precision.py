"""The matmul precision a pipeline stage runs under: float32 weights mean float32 products.

XLA:TPU runs float32 matmuls and convolutions in one bfloat16 pass by default (`Precision.DEFAULT`:
the operands rounded to bf16, products summed in fp32), so a float32 pipeline on a TPU computed
bf16-like videos: the tiny default's fp32 video (the README's prompt, seed 0) on a TPU v5e was
65.6 dB PSNR from the CPU's, 116.7 dB with "highest" (tests/tpu/test_pipeline.py; 47-60 dB was
reported from other runs).
"highest" asks for full fp32 products (on TPU several bf16 passes per product; on CPU it is what
fp32 already does, so the CPU's videos are bit for bit as before).

One rule, applied where a `WanPipeline` call runs its stages (docs/numerics.md, "Matmul precision"):
- a call's run (`runner.Runner.run`, which `WanPipeline.generate` runs, once per window for
  continued windows: the text encoder, the compiled denoise steps, the text K/V) runs under the
  pipeline's dtype (`pipe.dtype`, the transformer's and text encoder's);
- the VAE stages (the decode and its compile-ahead lowering, `decoding.py`; the conditioning and
  video-to-video encodes, `runner.Runner`) run under the VAE's dtype (`pipe.vae.dtype`): a float32
  VAE (every preset's default, and the tiny models') decodes at full fp32 under a bf16 pipeline too.
  The conditioning stage also runs Wan 2.1 I2V's CLIP image encoder, which computes in fp32 always.
- bfloat16 stages are left as they are: bf16 x bf16 products are exact in one pass, and the fp32
  odds and ends of a bf16 model keep the platform's default.
- An explicit caller's choice wins: inside `jax.default_matmul_precision(...)` (or with
  `JAX_DEFAULT_MATMUL_PRECISION` / `jax.config.update("jax_default_matmul_precision", ...)`) the
  pipeline changes nothing. A bf16 VAE under a fp32 pipeline therefore runs under "highest".

The setting is part of what a program computes, so compiled programs are kept per precision: JAX's
jit cache keys on it (`include_in_jit_key`), and so does `step.CompiledSteps`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp

# What a float32 stage asks for: jax's legacy name for `Precision.HIGHEST` (full fp32 products).
FLOAT32_PRECISION = "highest"


def matmul_precision(dtype: Any) -> contextlib.AbstractContextManager[None]:
  """The context a stage whose weights are `dtype` runs in.

  Args:
    dtype: the stage's dtype (a numpy / JAX dtype or its name, e.g. "float32", jnp.bfloat16).

  Returns:
    `jax.default_matmul_precision("highest")` for float32 when no default matmul precision is set
    (`jax.config.jax_default_matmul_precision` is None, read now: in this thread, inside any
    enclosing context); otherwise a context that changes nothing.

  Raises:
    TypeError: `dtype` is not a dtype (as `jnp.dtype`).
  """
  if jnp.dtype(dtype) != jnp.float32 or jax.config.jax_default_matmul_precision is not None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision(FLOAT32_PRECISION)
