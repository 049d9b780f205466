"""The Wan transformer's layers (diffusers' `WanTransformer3DModel` parts) in Flax NNX.

Glossary (DESIGN.md section 1): B batch, C latent channels, F / Hl / Wl latent frames / height /
width, T video tokens, L text tokens, N heads, H head dim, D = N * H, E ffn width, Z layers.

Dtypes as diffusers loaded with `torch_dtype=dtype` (pipelines/wan/transformer/model.py): linear layers
accumulate in fp32 and round once to their kernel dtype; the fp32-kept modules (timestep MLP,
AdaLN tables, cross-attention `norm2`) compute in fp32. `WanBlock` holds every block's weights with
a leading Z axis and is run by the transformer's layer scan; where its tokens live and how its
attention is computed is the `SequenceLayout` it is called with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint

import producers
from pipelines.wan.transformer import quantization
from pipelines.wan.transformer.sequence_layout import SequenceLayout
from pipelines.wan.transformer.config import WanTransformerConfig
from pipelines.wan.transformer.timesteps import select_levels


def _silu(x: jax.Array) -> jax.Array:
  """torch's SiLU on CPU/GPU computes in fp32 and rounds once to x.dtype."""
  return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def _gelu_tanh(x: jax.Array) -> jax.Array:
  """torch's GELU(approximate="tanh"): fp32 compute, one rounding to x.dtype."""
  return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


class Dense(nnx.Module):
  """torch `nn.Linear`: y = x W + b with kernel [I, O] (torch's weight transposed).

  The input is cast to the kernel's dtype (as diffusers feeds each Linear its own dtype), the
  product accumulates in fp32, the fp32 bias is added and the result is rounded once to the kernel
  dtype. Stacked (scanned) copies carry a leading Z axis on both arrays.

  A quantized kernel (`quantization.quantize_transformer`: a `qwix.QArray`, int8 or fp8 values
  with fp32 scales per output channel) runs `quantization.dense`: weight-only, or int8 x int8 when
  `int8_activations` is set; the output then takes the bias's dtype (the model dtype).
  """

  def __init__(self, kernel: jax.Array, bias: jax.Array):
    self.kernel = nnx.Param(kernel)  # [I, O]
    self.bias = nnx.Param(bias)  # [O]
    self.int8_activations = False  # w8a8 (set by quantization.quantize_transformer)

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel.get_value()
    if isinstance(kernel, qwix.QArray):
      return quantization.dense(x, kernel, self.bias[...], int8_activations=self.int8_activations)
    y = jnp.einsum("...I,IO->...O", x.astype(kernel.dtype), kernel,
                   preferred_element_type=jnp.float32)
    return (y + self.bias[...].astype(jnp.float32)).astype(kernel.dtype)

  def heads(self, x: jax.Array, num_heads: int) -> jax.Array:
    """This Linear split into heads: [B, T, I] -> [B, T, N, H] (O = N H), the values of
    `self(x).reshape(B, T, N, H)`, laid out heads-major on TPU (`_heads_major`).

    The kernel is read as N head kernels [N, I, H] (a quantized one by `quantization.heads_kernel`),
    so each output is the same dot product, accumulated in fp32, scaled, biased and rounded as in
    `__call__` (bitwise the same on XLA:CPU, tests/pipelines/wan/transformer/test_quantization.py).
    Why: XLA:TPU relaid a [B, T, D] projection out to [B, N, T, H] in two bf16 copies (1.9
    Mcycles each in the 14B 720p step on v6e:2x4); a dot with the heads axis major in its kernel
    writes that layout itself (docs/measurements/tpu-step.md).
    """
    kernel, bias = self.kernel.get_value(), self.bias[...].reshape(num_heads, -1)
    if isinstance(kernel, qwix.QArray):
      return _heads_major(quantization.dense(x, quantization.heads_kernel(kernel, num_heads), bias,
                                             int8_activations=self.int8_activations))
    inputs, outputs = kernel.shape
    kernel_NIH = kernel.reshape(inputs, num_heads, outputs // num_heads).transpose(1, 0, 2)
    y = jnp.einsum("...I,NIH->...NH", x.astype(kernel.dtype), kernel_NIH, preferred_element_type=jnp.float32)
    return _heads_major((y + bias.astype(jnp.float32)).astype(kernel.dtype))


  def from_heads(self, x_BTNH: jax.Array) -> jax.Array:
    """This Linear on an input split into heads: [B, T, N, H] -> [B, T, O] (I = N H), the values of
    `self(x.reshape(B, T, I))`. On TPU it contracts over (N, H) (`contract_heads`), so a
    heads-major x (the attention's output there) is read where it lies rather than relaid out to
    [B, T, I] first (two 1.7-ms copies a 1.3B 480p block, modelled offline for v5e); elsewhere, and
    for a quantized kernel, it is `self` of the joined heads (XLA:CPU would contract head by head
    and sum, another rounding order)."""
    joined = lambda x: self(x.reshape(*x.shape[:-2], -1))  # noqa: E731
    if isinstance(self.kernel.get_value(), qwix.QArray):
      return joined(x_BTNH)
    return jax.lax.platform_dependent(x_BTNH, tpu=self.contract_heads, default=joined)

  def contract_heads(self, x_BTNH: jax.Array) -> jax.Array:
    """`from_heads` as one contraction over (N, H) with the kernel read as [N, H, O] (an unquantized
    kernel): the same products, summed in the order the backend's dot takes, fp32, then the bias
    and one rounding as `__call__`."""
    kernel = self.kernel.get_value()
    N, H = x_BTNH.shape[-2:]
    y = jnp.einsum("...NH,NHO->...O", x_BTNH.astype(kernel.dtype), kernel.reshape(N, H, -1),
                   preferred_element_type=jnp.float32)
    return (y + self.bias[...].astype(jnp.float32)).astype(kernel.dtype)


def _heads_major(x_BTNH: jax.Array) -> jax.Array:
  """[B, T, N, H] pinned to the [B, N, T, H] layout on TPU (whole (T, H) slabs per head: what
  `producers.rmsnorm_rope` and the USP exchange read); a no-op elsewhere."""
  return jax.lax.platform_dependent(x_BTNH, tpu=lambda v: with_layout_constraint(v, Layout((0, 2, 1, 3))),
                                    default=lambda v: v)


class MLP(nnx.Module):
  """linear_1 -> activation -> linear_2 (diffusers TimestepEmbedding / PixArtAlphaTextProjection)."""

  def __init__(self, params: Mapping[str, Any], activation):
    self.linear_1 = Dense(**params["linear_1"])
    self.linear_2 = Dense(**params["linear_2"])
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.linear_2(self.activation(self.linear_1(x)))


class PatchEmbedding(nnx.Module):
  """Conv3d with kernel = stride = (pt, ph, pw), as one matmul over non-overlapping patches.

  kernel [pt, ph, pw, C, D] (torch's [D, C, pt, ph, pw] transposed), bias [D]. `patches` cuts the
  latents into token rows (a reshape, no arithmetic) and `project` embeds rows, so a sequence-
  parallel forward shards the rows before projecting them (each device embeds its own tokens).
  """

  def __init__(self, kernel: jax.Array, bias: jax.Array):
    self.kernel = nnx.Param(kernel)
    self.bias = nnx.Param(bias)

  def patches(self, latents: jax.Array) -> jax.Array:
    """[B, C, F, Hl, Wl] -> [B, T, K] in the kernel dtype, K = pt ph pw C in (p, q, r, C) order,
    tokens in (f, h, w) row-major order (lowercase p/q/r: offsets inside a patch)."""
    kernel = self.kernel[...]
    pt, ph, pw, _, _ = kernel.shape
    b, c, f, h, w = latents.shape
    x = latents.astype(kernel.dtype).reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    x = x.transpose(0, 2, 4, 6, 3, 5, 7, 1)  # [B, F', H', W', pt, ph, pw, C]
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), pt * ph * pw * c)

  def project(self, patches_BTK: jax.Array) -> jax.Array:
    """[B, T, K] -> [B, T, D] in the kernel dtype: fp32 accumulation, fp32 bias, one rounding."""
    kernel = self.kernel[...]
    y = jnp.einsum("BTK,KD->BTD", patches_BTK, kernel.reshape(-1, kernel.shape[-1]),
                   preferred_element_type=jnp.float32)
    return (y + self.bias[...].astype(jnp.float32)).astype(kernel.dtype)

  def __call__(self, latents: jax.Array) -> jax.Array:
    """[B, C, F, Hl, Wl] -> [B, T, D] in the kernel dtype, tokens in (f, h, w) row-major order."""
    return self.project(self.patches(latents))


def timestep_embedding(timestep: jax.Array, dim: int, max_period: float = 10000.0) -> jax.Array:
  """Sinusoidal embedding, diffusers `Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)`.

  Args:
    timestep: [B] or [B, T] (per-token, Wan 2.2 TI2V), any real dtype (fractional timesteps allowed).
    dim: even embedding width.

  Returns:
    float32 [..., dim] = [cos(t * f_i), sin(t * f_i)], f_i = max_period ** (-i / (dim / 2)).

  Math: diffusers embeddings.get_timestep_embedding (DDPM sinusoidal embedding), applied to the
  flattened timesteps as diffusers' `WanTransformer3DModel` does for a 2-D timestep.
  """
  half = dim // 2
  exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half  # [dim/2]
  args = timestep.astype(jnp.float32)[..., None] * jnp.exp(exponent)  # [..., dim/2]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def _gelu(x: jax.Array) -> jax.Array:
  """torch's exact GELU: fp32 compute, one rounding to x.dtype."""
  return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


class ImageEmbedder(nnx.Module):
  """diffusers `WanImageEmbedding`: (+ pos_embed) -> FP32LayerNorm -> Linear [I, I] -> GELU ->
  Linear [I, D] -> FP32LayerNorm (both norms eps 1e-5, torch's default); I = image_dim."""

  EPS = 1e-5

  def __init__(self, params: Mapping[str, Any]):
    self.norm1 = LayerNorm(**params["norm1"])  # fp32 (kept in fp32)
    self.proj_in = Dense(**params["proj_in"])
    self.proj_out = Dense(**params["proj_out"])
    self.norm2 = LayerNorm(**params["norm2"])
    self.pos_embed = nnx.Param(params["pos_embed"]) if "pos_embed" in params else None  # [P, I]

  def __call__(self, image_BJI: jax.Array) -> jax.Array:
    """[B', J, I] CLIP states in the model dtype -> [B, P, D] (with `pos_embed`, FLF2V: B' = 2B
    rows, each video's first and last frame, joined into one row of P = 2J tokens)."""
    if self.pos_embed is not None:
      pos_PI = self.pos_embed[...]
      image_BJI = image_BJI.reshape(-1, *pos_PI.shape) + pos_PI.astype(image_BJI.dtype)
    h = self.norm1(image_BJI, eps=self.EPS)
    h = self.proj_out(_gelu(self.proj_in(h)))
    return self.norm2(h, eps=self.EPS)


class ConditionEmbedder(nnx.Module):
  """diffusers `WanTimeTextImageEmbedding` (the image branch only where the config has one)."""

  def __init__(self, params: Mapping[str, Any]):
    self.time_embedder = MLP(params["time_embedder"], _silu)  # fp32 (kept in fp32)
    self.time_proj = Dense(**params["time_proj"])
    self.text_embedder = MLP(params["text_embedder"], _gelu_tanh)
    self.image_embedder = ImageEmbedder(params["image_embedder"]) if "image_embedder" in params else None

  def __call__(self, timestep: jax.Array, *, dtype: jnp.dtype, freq_dim: int):
    """timestep [B] (per video) or [B, T] (per token, Wan 2.2 TI2V) -> temb [B, D] / [B, T, D] and
    time_proj [B, 6, D] / [B, T, 6, D] in the model `dtype` (every row computed on its own, so a
    sequence-sharded [B, T] timestep gives sharded results). The text branch (`text_embedder`:
    [B, L, text_dim] -> [B, L, D]) runs apart, once per prompt (`transformer.text_kv`); the image
    states go through `image_embedder` apart."""
    sinusoid = timestep_embedding(timestep, freq_dim)  # fp32 [..., freq_dim]
    temb = self.time_embedder(sinusoid).astype(dtype)  # diffusers: .type_as(encoder_hidden_states)
    time_proj = self.time_proj(_silu(temb))  # [..., 6 * D]
    return temb, time_proj.reshape(*time_proj.shape[:-1], 6, -1)


class Attention(nnx.Module):
  """diffusers `WanAttention` weights: to_q/to_k/to_v/to_out [D, D], RMSNorm gains norm_q/norm_k [D];
  with an image branch (Wan 2.1 I2V cross-attention) also add_k_proj/add_v_proj [D, D] and the
  image keys' RMSNorm gain norm_added_k [D]."""

  def __init__(self, params: Mapping[str, Any]):
    self.to_q = Dense(**params["to_q"])
    self.to_k = Dense(**params["to_k"])
    self.to_v = Dense(**params["to_v"])
    self.to_out = Dense(**params["to_out"])
    self.norm_q = nnx.Param(params["norm_q"])
    self.norm_k = nnx.Param(params["norm_k"])
    image = "add_k_proj" in params
    self.add_k_proj = Dense(**params["add_k_proj"]) if image else None
    self.add_v_proj = Dense(**params["add_v_proj"]) if image else None
    self.norm_added_k = nnx.Param(params["norm_added_k"]) if image else None


def cross_attention_kv(to_k: Dense, to_v: Dense, norm_k: jax.Array, states_BLD: jax.Array, *, heads: int,
                       eps: float) -> tuple[jax.Array, jax.Array]:
  """Keys and values of one block's cross-attention over conditioning states: k = RMSNorm(states
  W_k) across heads (no RoPE), v = states W_v (diffusers `WanAttnProcessor`: `attn.to_k`,
  `attn.norm_k`, `attn.to_v` on `encoder_hidden_states`). They depend on the prompt and the weights
  only, not on the step, so the pipeline computes them once per prompt (`transformer.text_kv`); an
  image branch passes its own projections (`add_k_proj`, `add_v_proj`, `norm_added_k`).

  Args:
    to_k, to_v: the block's projections (kernel [D, D]); norm_k: RMSNorm gain [D].
    states_BLD: [B, L, D] projected conditioning states in the model dtype.

  Returns:
    (k_BLNH, v_BLNH), each [B, L, N, H] in the model dtype.
  """
  b, l, d = states_BLD.shape
  k_BLNH = producers.rmsnorm_rope(to_k(states_BLD), norm_k, None, None, num_heads=heads, eps=eps)
  return k_BLNH, to_v(states_BLD).reshape(b, l, heads, d // heads)


class LayerNorm(nnx.Module):
  """diffusers `FP32LayerNorm(D, eps, elementwise_affine=True)`: fp32 stats and affine, weight/bias [D]."""

  def __init__(self, weight: jax.Array, bias: jax.Array):
    self.weight = nnx.Param(weight)
    self.bias = nnx.Param(bias)

  def __call__(self, x: jax.Array, *, eps: float) -> jax.Array:
    """[B, T, D] -> [B, T, D] in x.dtype (`producers.layer_norm`)."""
    return producers.layer_norm(x, self.weight[...], self.bias[...], eps=eps)


class FeedForward(nnx.Module):
  """diffusers `FeedForward(D, inner_dim=E, activation_fn="gelu-approximate")`.

  [B, T, D] -> proj_in [D, E] -> GELU-tanh -> proj_out [E, D] -> [B, T, D].
  """

  def __init__(self, params: Mapping[str, Any]):
    self.proj_in = Dense(**params["proj_in"])
    self.proj_out = Dense(**params["proj_out"])

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.proj_out(_gelu_tanh(self.proj_in(x)))



class WanBlock(nnx.Module):
  """diffusers `WanTransformerBlock`; built with a leading Z axis on every array and scanned."""

  def __init__(self, params: Mapping[str, Any]):
    self.attn1 = Attention(params["attn1"])
    self.attn2 = Attention(params["attn2"])
    self.norm2 = LayerNorm(**params["norm2"]) if "norm2" in params else None
    self.ffn = FeedForward(params["ffn"])
    self.scale_shift_table = nnx.Param(params["scale_shift_table"])  # fp32 [6, D]

  def __call__(self, x_BTD: jax.Array, text_kv: tuple[jax.Array, jax.Array], time_proj: jax.Array,
               rope: tuple[jax.Array, jax.Array], *, config: WanTransformerConfig,
               layout: SequenceLayout, image_kv: tuple[jax.Array, jax.Array] | None = None,
               time_index: jax.Array | None = None, attend=None) -> jax.Array:
    """One block.

    Args:
      x_BTD: [B, T, D] video tokens in the model dtype (sequence-sharded under a mesh).
      text_kv: this block's cross-attention keys and values of the text, [B, L, N, H] each
        (`cross_attention_kv`; replicated, computed once per prompt).
      time_proj: [B, 1, 6, D] (per video), [B, T, 6, D] (per token, Wan 2.2 TI2V; sharded like
        the tokens) or [B, K, 6, D] (per level, with `time_index`) timestep projection in the
        model dtype.
      rope: (cos, sin) float32 [T, H/2] at the tokens' global positions.
      image_kv: this block's cross-attention keys and values of the image, [B, P, N, H] each
        (`cross_attention_kv` of `add_k_proj`, `add_v_proj`, `norm_added_k` on the embedded CLIP
        states; replicated; Wan 2.1 I2V / FLF2V) or None.
      time_index: int32 [B, T] each token's level of a per-level `time_proj` (sharded like the
        tokens; `timesteps.TokenTimesteps`), or None.
      attend: the self-attention, (q, k, v) [B, T, N, H] each -> [B, T, N, H] (q pre-scaled as
        `SequenceLayout.self_attention` takes it); None for `layout.self_attention`. A causal
        stream passes one that attends to its KV cache too (`pipelines.wan.causal`).

    Returns:
      [B, T, D] in x's dtype.
    """
    dtype, eps, heads = x_BTD.dtype, config.eps, config.num_attention_heads
    q_scale = (x_BTD.shape[-1] // heads) ** -0.5 * math.log2(math.e)  # the producers pre-scale q (base 2)
    f32 = jnp.float32
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = self._modulations(time_proj, time_index)

    # 1. Self-attention: AdaLN, q/k RMSNorm across heads + RoPE, USP attention, gated residual.
    h_BTD = producers.layernorm_adaln(x_BTD, scale_msa, shift_msa, eps=eps)
    a = self.attn1
    q_BTNH = producers.rmsnorm_rope(a.to_q.heads(h_BTD, heads), a.norm_q[...], *rope, num_heads=heads, eps=eps,
                                    out_scale=q_scale)
    k_BTNH = producers.rmsnorm_rope(a.to_k.heads(h_BTD, heads), a.norm_k[...], *rope, num_heads=heads, eps=eps)
    v_BTNH = a.to_v.heads(h_BTD, heads)
    o_BTNH = (attend or layout.self_attention)(q_BTNH, k_BTNH, v_BTNH)
    x_BTD = (x_BTD.astype(f32) + a.to_out.from_heads(o_BTNH).astype(f32) * gate_msa).astype(dtype)
    x_BTD = layout.constrain(x_BTD)

    # 2. Cross-attention: affine LayerNorm (fp32), q RMSNorm (no RoPE) against the text K/V
    #    (replicated, computed before the loop), plain residual in the model dtype.
    h_BTD = x_BTD if self.norm2 is None else self.norm2(x_BTD, eps=eps)
    a = self.attn2
    q_BTNH = producers.rmsnorm_rope(a.to_q.heads(h_BTD, heads), a.norm_q[...], None, None, num_heads=heads, eps=eps,
                                    out_scale=q_scale)
    o_BTNH = layout.cross_attention(q_BTNH, *text_kv)
    if image_kv is not None:
      # diffusers `WanAttnProcessor` ("I2V task"): the same queries against the image's K/V (no
      # mask), added to the text term before `to_out`.
      o_BTNH = o_BTNH + layout.cross_attention(q_BTNH, *image_kv)
    x_BTD = layout.constrain(x_BTD + a.to_out.from_heads(o_BTNH))

    # 3. Feed-forward: AdaLN, GELU-tanh MLP, gated residual.
    h_BTD = producers.layernorm_adaln(x_BTD, c_scale_msa, c_shift_msa, eps=eps)
    f_BTD = self.ffn(h_BTD)
    x_BTD = (x_BTD.astype(f32) + f_BTD.astype(f32) * c_gate_msa).astype(dtype)
    return layout.constrain(x_BTD)

  def _modulations(self, time_proj: jax.Array, time_index: jax.Array | None) -> list[jax.Array]:
    """The six AdaLN modulations, fp32 [B, 1 or T, D] each (diffusers: `scale_shift_table +
    temb.float()`, chunked): with `time_index` each token's level selected, each of the six apart,
    so each is a [B, T, D] value beside the op that reads it (`timesteps` module doc)."""
    mod = self.scale_shift_table[...][None, None] + time_proj.astype(jnp.float32)  # [B, 1 or T or K, 6, D]
    parts = [mod[:, :, i] for i in range(6)]
    return parts if time_index is None else [select_levels(part, time_index) for part in parts]
