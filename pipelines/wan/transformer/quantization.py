"""Weight quantization of the Wan transformer's block linear layers: int8, fp8 (e4m3), int8 w8a8.

Glossary (DESIGN.md section 1): B batch, T tokens, D model width, E ffn width, Z layers; a Linear's
kernel is [I, O] ([Z, I, O] stacked over the blocks).

What is quantized: the eight Linear layers of every block and every VACE block (`QUANTIZED_LINEARS`: self- and
cross-attention q, k, v, out; the feed-forward's proj_in, proj_out), about 98 % of a Wan
transformer's weights. What keeps its dtype, and why:
- the norms' gains (`norm_q`, `norm_k`, `norm2`): D values per layer, multiplied into every token;
- the AdaLN modulation tables (`scale_shift_table`s, fp32 as in diffusers) and the timestep MLP
  (`time_embedder`, fp32 in diffusers) and `time_proj`: they scale, shift and gate every block's
  residual stream, so an error there moves every token of every block;
- the patch embedding, the text embedder and the output head (`proj_out`): the input and output
  of the whole network, small (a few % of the weights), and `proj_out`'s error lands directly on
  the noise prediction;
- every bias (O values per Linear; added in fp32).

Modes (`QUANTIZATION_MODES`), all with one scale per (layer, output channel), symmetric, from the
absolute max over the input axis I (qwix's `absmax` calibration):
- "int8": weight-only. s = absmax / 127.5, q = round(w / s) in [-128, 127] int8, so
  |w - q s| <= s / 2 (round to nearest; +absmax saturates to 127, exactly s / 2 off).
- "fp8": weight-only. s = absmax / 448, q = e4m3fn(w / s) (round to nearest even), so
  |w - q s| <= 2^-4 |w| where |w / s| >= 2^-6 (3 mantissa bits) and <= 2^-10 s below (subnormals).
- "int8-w8a8": the "int8" weights, and every quantized Linear's input is quantized per token (row)
  to int8 with a dynamic fp32 scale (absmax of the row / 127.5); the product is an int8 x int8
  `jax.lax.dot_general` accumulating in int32, scaled by s_x s_w afterwards (qwix's
  `dot_general`). Runs anywhere XLA does, CPU included.

The weight-only matmul (`dense`) applies the scale after the accumulation: y = (x @ q) s + b, x
cast to the model dtype, q cast to the model dtype (exact: every int8 and e4m3 value is a bf16
value), fp32 accumulation, scale and bias in fp32, one rounding to the model dtype. With a scale
per output channel this equals x @ (q s) in exact arithmetic, and no dequantized copy of the
weight is rounded to bf16. (qwix's `dot_general` with a floating-point left operand dequantizes the
weight to its scale's dtype first, an fp32 weight: the reason this path is ours.)

Storage: the kernel's `nnx.Param` holds a `qwix.QArray` (qvalue int8 / float8_e4m3fn [Z, I, O],
scale float32 [Z, 1, O]), two pytree leaves that `weight_placement.weight_shardings` places like
any weight: with sharded weights both are split over the devices and the layer scan all-gathers
the 1-byte values and the scales. A `Dense` with `int8_activations` set runs w8a8.

Measured error (docs/measurements/quantization.md; `python -m end_to_end.quality.quant_error`):
on the trained tiny default the int8 weight error moves the noise prediction about as much as all
of bf16's rounding does (relative RMS 0.68 % vs 0.83 %), so a bf16 model with int8 weights costs
~2.3 dB of PSNR on average over seeds, fp8 ~6 dB (e4m3's 3 mantissa bits: 4.5x int8's weight error
whatever the scales). The feed-forward (60 % of int8's error power) and the self-attention's v and out
(30 %) contribute most. Its weights are near-Gaussian within each channel (absmax 2.4-3.9 std, no
outlier channels), so finer scales gain little there: scales per 32 inputs instead of per channel
cut the weight error by 10-20 % (30 % in the feed-forward's proj_out).

Source of the math: per-channel symmetric quantization as in qwix (google/qwix, core/qarray.py)
and AQT; LLM.int8 / SmoothQuant's per-token dynamic activation scales for w8a8.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix

from pipelines.wan.transformer.config import WanTransformerConfig

QUANTIZATION_MODES = ("int8", "fp8", "int8-w8a8")
QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int8-w8a8": jnp.int8}
# The block Linear layers that are quantized (paths under `blocks`, each a `Dense`).
QUANTIZED_LINEARS = (("attn1", "to_q"), ("attn1", "to_k"), ("attn1", "to_v"), ("attn1", "to_out"),
                     ("attn2", "to_q"), ("attn2", "to_k"), ("attn2", "to_v"), ("attn2", "to_out"),
                     ("ffn", "proj_in"), ("ffn", "proj_out"))


def check_quantization(mode: Any) -> str | None:
  """None or one of `QUANTIZATION_MODES`, as given.

  Raises:
    ValueError: anything else, naming the value and the choices.
  """
  if mode is None or (isinstance(mode, str) and mode in QUANTIZATION_MODES):
    return mode
  raise ValueError(f"quantize={mode!r} is not supported; use None (the weights as loaded) or one of "
                   f"{QUANTIZATION_MODES}")


def quantize_kernel(kernel: jax.Array, mode: str) -> qwix.QArray:
  """A Linear kernel [..., I, O] (any leading axes, e.g. Z) quantized per output channel.

  Returns:
    `qwix.QArray`: qvalue int8 (or float8_e4m3fn for "fp8") [..., I, O], scale float32
    [..., 1, O]; `dequantize` gives w within the module docstring's bounds.
  """
  channels = tuple(a for a in range(kernel.ndim) if a != kernel.ndim - 2)
  return qwix.quantize(kernel.astype(jnp.float32), QTYPES[mode], channelwise_axes=channels,
                       scale_dtype=jnp.float32)


def fp8_qarray(qvalue: jax.Array, scale: jax.Array) -> qwix.QArray:
  """An "fp8" kernel from e4m3 values [..., I, O] and float32 scales [..., 1, O] quantized elsewhere
  (a ComfyUI scaled-fp8 file's, `load_transformer_state`): what `quantize_kernel` returns for "fp8"."""
  return qwix.QArray(qvalue=qvalue, scale=scale, zero_point=None, qtype=QTYPES["fp8"])


quantize_kernel_jit = jax.jit(quantize_kernel, static_argnums=1)  # compiled once per shape and mode


def dequantize(kernel: qwix.QArray) -> jax.Array:
  """q * s in float32, the shape of the quantized kernel."""
  return qwix.dequantize(kernel)


def dense(x: jax.Array, kernel: qwix.QArray, bias: jax.Array, *, int8_activations: bool = False) -> jax.Array:
  """y = x W + b with a quantized kernel W = q s (module docstring: weight-only or w8a8).

  Args:
    x: [..., I] activations in any float dtype.
    kernel: `quantize_kernel` of [I, O] (one layer: no leading axes), or `heads_kernel` of it:
      [N, I, H] values, [N, 1, H] scales.
    bias: [O] in the model dtype, or [N, H] for a heads kernel: the output's dtype.
    int8_activations: w8a8: x quantized per row to int8, int8 x int8 -> int32 matmul.

  Returns:
    [..., O] (a heads kernel: [..., N, H]) in bias.dtype, rounded once from fp32; a heads kernel's
    values are the plain kernel's, reshaped (the same products, sums and scalings per output).
  """
  dtype, spec = bias.dtype, "...I,NIH->...NH" if kernel.qvalue.ndim == 3 else "...I,IO->...O"
  rhs_contracting = kernel.qvalue.ndim - 2
  if int8_activations:
    rows = tuple(range(x.ndim - 1))
    x_q = qwix.quantize(x.astype(jnp.float32), jnp.int8, channelwise_axes=rows, scale_dtype=jnp.float32)
    y = qwix.dot_general(x_q, kernel, (((x.ndim - 1,), (rhs_contracting,)), ((), ())),
                         preferred_element_type=jnp.float32)
  else:
    y = jnp.einsum(spec, x.astype(dtype), kernel.qvalue.astype(dtype), preferred_element_type=jnp.float32)
    y = y * kernel.scale[:, 0] if kernel.qvalue.ndim == 3 else y * kernel.scale[0]
  return (y + bias.astype(jnp.float32)).astype(dtype)


def heads_kernel(kernel: qwix.QArray, num_heads: int) -> qwix.QArray:
  """A quantized [I, O] kernel as N head kernels: values [N, I, H], scales [N, 1, H] (O = N H;
  each output channel keeps its own scale), for `dense` to write [..., N, H] directly."""
  (inputs, outputs), qtype = kernel.qvalue.shape, kernel.qtype
  qvalue = kernel.qvalue.reshape(inputs, num_heads, outputs // num_heads).transpose(1, 0, 2)
  scale = kernel.scale.reshape(1, num_heads, outputs // num_heads).transpose(1, 0, 2)
  return qwix.QArray(qvalue=qvalue, scale=scale, zero_point=None, qtype=qtype)


def block_stacks(config: WanTransformerConfig) -> tuple[str, ...]:
  """The stacks of blocks whose Linear kernels are quantized: "blocks", and "vace_blocks" with VACE."""
  return ("blocks", "vace_blocks") if config.has_vace else ("blocks",)


def quantize_transformer(model: Any, mode: str | None) -> Any:
  """Quantizes a `WanTransformer`'s block Linear kernels in place (`QUANTIZED_LINEARS`); returns it.

  Works on concrete and abstract (`nnx.eval_shape`) models; each kernel is replaced as it is
  quantized. A kernel already quantized to this mode's type (at load) is kept. None returns the
  model untouched.

  Raises:
    ValueError: an unknown mode, or a kernel quantized to another type.
  """
  mode = check_quantization(mode)
  if mode is None:
    return model
  for stack, path in ((stack, path) for stack in block_stacks(model.config) for path in QUANTIZED_LINEARS):
    layer = getattr(model, stack)
    for name in path:
      layer = getattr(layer, name)
    kernel = layer.kernel.get_value()
    if isinstance(kernel, qwix.QArray):
      if jnp.dtype(kernel.qtype) != jnp.dtype(QTYPES[mode]):
        raise ValueError(f"{stack}.{'.'.join(path)} is quantized to {jnp.dtype(kernel.qtype).name} already, "
                         f"not {mode}; quantize the full-precision weights")
    else:
      layer.kernel.set_value(quantize_kernel_jit(kernel, mode))
    layer.int8_activations = mode == "int8-w8a8"
  return model


def quantized_counts(config: WanTransformerConfig) -> tuple[int, int]:
  """(quantized kernel values, their fp32 scales) of one transformer of `config`: what the mesh
  planner counts as 1-byte and 4-byte weights (`pipelines.parallel.planner.candidates`)."""
  d, e = config.dim, config.ffn_dim
  z = config.num_layers + (len(config.vace_layers) if config.has_vace else 0)  # VACE blocks quantized alike
  values = z * (8 * d * d + 2 * d * e)
  scales = z * (8 * d + e + d)
  return values, scales
