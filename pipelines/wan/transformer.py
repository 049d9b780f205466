"""Wan video transformer (diffusers' `WanTransformer3DModel`) in Flax NNX, sequence-parallel.

Glossary (DESIGN.md section 1): B batch, C latent channels, F / Hl / Wl latent frames / height /
width, T video tokens = (F/pt) * (Hl/ph) * (Wl/pw), L text tokens, N heads, H head dim,
D = N * H, E ffn width, Z layers, U / R Ulysses / ring degrees.

Order of ops and dtypes are those of diffusers (models/transformers/transformer_wan.py) loaded
with `torch_dtype=dtype`: every parameter is in `dtype` except the `_keep_in_fp32_modules` ones
(`time_embedder`, both `scale_shift_table`s, the cross-attention `norm2` affine), which stay fp32,
so the timestep MLP, all AdaLN modulation and every LayerNorm run in fp32 and are rounded to
`dtype` where diffusers calls `type_as`. Linear layers accumulate in fp32 and round once.

Sequence parallelism (DESIGN.md section 2): with a mesh, the video tokens are padded to a multiple
of U * R and constrained to `P(None, ("ring", "ulysses"), None)` for the whole forward; every
token-wise op runs on the local chunk; self-attention is `attention.usp_attention` with the valid
token count as `kv_valid_len` (padded keys masked), cross-attention is `attention.cross_attention`
(local per shard) against replicated text K/V (no mask: diffusers' Wan cross-attention uses none),
and padded rows are dropped before unpatchify. RoPE rows are global positions (the padded table is
sharded with the tokens). The blocks' weights are stacked on a leading Z axis and run by one
`lax.scan`, so the block is traced and compiled once whatever the depth. `forward` is `embed`
(patch and condition embeddings, RoPE), `run_blocks` (any range of blocks) and `unembed` (output
norm, projection, unpatchify), so a step cache (pipelines/wan/step_cache.py) can run block 0 and
blocks 1..Z-1 apart without a second copy of the block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import attention
import producers
from attention.mesh import SEQUENCE_AXES, MeshSpec, batch_axis, sequence_spec
from pipelines.wan.transformer_config import WanTransformerConfig

# diffusers `WanTransformer3DModel._keep_in_fp32_modules` that own parameters ("rope", "norm1",
# "norm3" own none); a parameter whose path holds one of these names is kept fp32.
KEEP_IN_FP32 = ("time_embedder", "scale_shift_table", "norm2")


def keeps_fp32(path: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` (our module path) stays fp32 whatever the model dtype."""
  return any(name in path for name in KEEP_IN_FP32)


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
  """

  def __init__(self, kernel: jax.Array, bias: jax.Array):
    self.kernel = nnx.Param(kernel)  # [I, O]
    self.bias = nnx.Param(bias)  # [O]

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    y = jnp.einsum("...I,IO->...O", x.astype(kernel.dtype), kernel,
                   preferred_element_type=jnp.float32)
    return (y + self.bias[...].astype(jnp.float32)).astype(kernel.dtype)


class MLP(nnx.Module):
  """linear_1 -> activation -> linear_2 (diffusers TimestepEmbedding / PixArtAlphaTextProjection)."""

  def __init__(self, params: Mapping[str, Any], activation):
    self.linear_1 = Dense(**params["linear_1"])
    self.linear_2 = Dense(**params["linear_2"])
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.linear_2(self.activation(self.linear_1(x)))


class PatchEmbedding(nnx.Module):
  """Conv3d with kernel = stride = (pt, ph, pw), as one einsum over non-overlapping patches.

  kernel [pt, ph, pw, C, D] (torch's [D, C, pt, ph, pw] transposed), bias [D].
  """

  def __init__(self, kernel: jax.Array, bias: jax.Array):
    self.kernel = nnx.Param(kernel)
    self.bias = nnx.Param(bias)

  def __call__(self, latents: jax.Array) -> jax.Array:
    """[B, C, F, Hl, Wl] -> [B, T, D] in the kernel dtype, tokens in (f, h, w) row-major order."""
    kernel = self.kernel[...]
    pt, ph, pw, _, _ = kernel.shape
    b, c, f, h, w = latents.shape
    # lowercase letters: p/q/r are offsets inside a (pt, ph, pw) patch.
    x = latents.astype(kernel.dtype).reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    y = jnp.einsum("BCFpHqWr,pqrCD->BFHWD", x, kernel, preferred_element_type=jnp.float32)
    y = (y + self.bias[...].astype(jnp.float32)).astype(kernel.dtype)
    return y.reshape(b, -1, y.shape[-1])


def timestep_embedding(timestep: jax.Array, dim: int, max_period: float = 10000.0) -> jax.Array:
  """Sinusoidal embedding, diffusers `Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)`.

  Args:
    timestep: [B], any real dtype (fractional timesteps allowed).
    dim: even embedding width.

  Returns:
    float32 [B, dim] = [cos(t * f_i), sin(t * f_i)], f_i = max_period ** (-i / (dim / 2)).

  Math: diffusers embeddings.get_timestep_embedding (DDPM sinusoidal embedding).
  """
  half = dim // 2
  exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half  # [dim/2]
  args = timestep.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]  # [B, dim/2]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class ConditionEmbedder(nnx.Module):
  """diffusers `WanTimeTextImageEmbedding` without the image branch."""

  def __init__(self, params: Mapping[str, Any]):
    self.time_embedder = MLP(params["time_embedder"], _silu)  # fp32 (kept in fp32)
    self.time_proj = Dense(**params["time_proj"])
    self.text_embedder = MLP(params["text_embedder"], _gelu_tanh)

  def __call__(self, timestep: jax.Array, text: jax.Array, *, freq_dim: int):
    """timestep [B], text [B, L, text_dim] in the model dtype.

    Returns:
      temb [B, D] and time_proj [B, 6, D] in the model dtype, text [B, L, D].
    """
    sinusoid = timestep_embedding(timestep, freq_dim)  # fp32 [B, freq_dim]
    temb = self.time_embedder(sinusoid).astype(text.dtype)  # diffusers: .type_as(text)
    time_proj = self.time_proj(_silu(temb))  # [B, 6 * D]
    time_proj = time_proj.reshape(time_proj.shape[0], 6, -1)
    return temb, time_proj, self.text_embedder(text)


class Attention(nnx.Module):
  """diffusers `WanAttention` weights: to_q/to_k/to_v/to_out [D, D], RMSNorm gains norm_q/norm_k [D]."""

  def __init__(self, params: Mapping[str, Any]):
    self.to_q = Dense(**params["to_q"])
    self.to_k = Dense(**params["to_k"])
    self.to_v = Dense(**params["to_v"])
    self.to_out = Dense(**params["to_out"])
    self.norm_q = nnx.Param(params["norm_q"])
    self.norm_k = nnx.Param(params["norm_k"])


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


class SequenceLayout:
  """Where the video tokens live: one device (mesh None) or sharded over ("ring", "ulysses"), the
  batch split over "cfg" when the mesh has a guidance split.

  Attributes:
    mesh: the (cfg, ring, ulysses) mesh or None.
    tokens: T, the valid token count.
    padded_tokens: T rounded up to a multiple of U * R (== T without a mesh).
    gather_weights: the block weights arrive sharded over the mesh (`MeshSpec.shard_weights`) and
      are gathered one layer at a time inside the layer scan.
    backend: the attention kernels' backend ("xla" | "pallas"), "auto" resolved for the mesh's
      platform (`attention.resolve_backend`).
  """

  def __init__(self, mesh: Mesh | None, tokens: int, attention_implementation: str = "auto",
               gather_weights: bool = False, attention_backend: str = "auto"):
    self.mesh = mesh
    self.tokens = tokens
    self.implementation = attention_implementation
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    self.backend = attention.resolve_backend(attention_backend, platform)
    self.padded_tokens = tokens
    self.gather_weights = bool(gather_weights) and mesh is not None
    if mesh is not None:
      spec = MeshSpec.of(mesh)  # ValueError unless the mesh has the mesh axes
      shards = spec.sequence_devices
      self.padded_tokens = -(-tokens // shards) * shards

  @property
  def padding(self) -> int:
    return self.padded_tokens - self.tokens

  def constrain(self, x: jax.Array) -> jax.Array:
    """Pins axis 1 (tokens) of [B, T, ...] to the sequence sharding (and axis 0 to the guidance
    split); a no-op without a mesh."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, sequence_spec(self.mesh)))

  def constrain_rows(self, x: jax.Array) -> jax.Array:
    """Pins axis 0 (batch) of a per-row array ([B, ...]: text states, time embeddings) to the
    guidance split, replicated otherwise; a no-op without a mesh."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(batch_axis(self.mesh))))

  def gathered(self, block: Any) -> Any:
    """One layer's weights, replicated (an all-gather of each sharded leaf) when the weights are
    sharded; as given otherwise."""
    if not self.gather_weights:
      return block
    replicated = NamedSharding(self.mesh, P())
    return jax.tree.map(lambda w: jax.lax.with_sharding_constraint(w, replicated), block)

  def constrain_table(self, x: jax.Array) -> jax.Array:
    """Pins axis 0 (tokens) of a [T, H/2] RoPE table to the sequence sharding."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(SEQUENCE_AXES, None)))

  def kv_valid_len(self, batch: int) -> jax.Array | None:
    """int32 [B] valid key count when tokens were padded, else None."""
    return jnp.full((batch,), self.tokens, jnp.int32) if self.padding else None

  def self_attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """[B, T, N, H] x3 -> [B, T, N, H]: local attention, or USP over the mesh.

    q arrives pre-scaled by H^-1/2 * log2(e) (applied by the q producer in fp32
    before its one rounding), so the base-2 kernels use it as is.
    """
    if self.mesh is None:
      return attention.local_attention(q, k, v, implementation=self.implementation, q_prescaled=True,
                                       backend=self.backend)
    return attention.usp_attention(q, k, v, mesh=self.mesh, kv_valid_len=self.kv_valid_len(q.shape[0]),
                                   implementation=self.implementation, q_prescaled=True, backend=self.backend)

  def cross_attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q [B, T, N, H] (sequence-sharded), k/v [B, L, N, H] (replicated) -> [B, T, N, H], no mask."""
    if self.mesh is None:
      return attention.local_attention(q, k, v, implementation=self.implementation, backend=self.backend)
    return attention.cross_attention(q, k, v, mesh=self.mesh, implementation=self.implementation,
                                     backend=self.backend)


class WanBlock(nnx.Module):
  """diffusers `WanTransformerBlock`; built with a leading Z axis on every array and scanned."""

  def __init__(self, params: Mapping[str, Any]):
    self.attn1 = Attention(params["attn1"])
    self.attn2 = Attention(params["attn2"])
    self.norm2 = LayerNorm(**params["norm2"]) if "norm2" in params else None
    self.ffn = FeedForward(params["ffn"])
    self.scale_shift_table = nnx.Param(params["scale_shift_table"])  # fp32 [6, D]

  def __call__(self, x_BTD: jax.Array, text_BLD: jax.Array, time_proj_B6D: jax.Array,
               rope: tuple[jax.Array, jax.Array], *, config: WanTransformerConfig,
               layout: SequenceLayout) -> jax.Array:
    """One block.

    Args:
      x_BTD: [B, T, D] video tokens in the model dtype (sequence-sharded under a mesh).
      text_BLD: [B, L, D] projected text states (replicated).
      time_proj_B6D: [B, 6, D] timestep projection in the model dtype.
      rope: (cos, sin) float32 [T, H/2] at the tokens' global positions.

    Returns:
      [B, T, D] in x's dtype.
    """
    dtype, eps, heads = x_BTD.dtype, config.eps, config.num_attention_heads
    b, t, d = x_BTD.shape
    head_dim = d // heads
    f32 = jnp.float32
    mod_B6D = self.scale_shift_table[...][None] + time_proj_B6D.astype(f32)  # fp32
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = jnp.split(mod_B6D, 6, axis=1)

    # 1. Self-attention: AdaLN, q/k RMSNorm across heads + RoPE, USP attention, gated residual.
    h_BTD = producers.layernorm_adaln(x_BTD, scale_msa, shift_msa, eps=eps)
    a = self.attn1
    q_BTNH = producers.rmsnorm_rope(a.to_q(h_BTD), a.norm_q[...], *rope, num_heads=heads, eps=eps,
                                    out_scale=head_dim ** -0.5 * math.log2(math.e))
    k_BTNH = producers.rmsnorm_rope(a.to_k(h_BTD), a.norm_k[...], *rope, num_heads=heads, eps=eps)
    v_BTNH = a.to_v(h_BTD).reshape(b, t, heads, head_dim)
    o_BTD = layout.self_attention(q_BTNH, k_BTNH, v_BTNH).reshape(b, t, d)
    x_BTD = (x_BTD.astype(f32) + a.to_out(o_BTD).astype(f32) * gate_msa).astype(dtype)
    x_BTD = layout.constrain(x_BTD)

    # 2. Cross-attention: affine LayerNorm (fp32), q/k RMSNorm (no RoPE), text K/V replicated,
    #    plain residual in the model dtype.
    h_BTD = x_BTD if self.norm2 is None else self.norm2(x_BTD, eps=eps)
    a = self.attn2
    q_BTNH = producers.rmsnorm_rope(a.to_q(h_BTD), a.norm_q[...], None, None, num_heads=heads, eps=eps)
    k_BLNH = producers.rmsnorm_rope(a.to_k(text_BLD), a.norm_k[...], None, None, num_heads=heads,
                                    eps=eps)
    v_BLNH = a.to_v(text_BLD).reshape(b, -1, heads, head_dim)
    o_BTD = layout.cross_attention(q_BTNH, k_BLNH, v_BLNH).reshape(b, t, d)
    x_BTD = layout.constrain(x_BTD + a.to_out(o_BTD))

    # 3. Feed-forward: AdaLN, GELU-tanh MLP, gated residual.
    h_BTD = producers.layernorm_adaln(x_BTD, c_scale_msa, c_shift_msa, eps=eps)
    f_BTD = self.ffn(h_BTD)
    x_BTD = (x_BTD.astype(f32) + f_BTD.astype(f32) * c_gate_msa).astype(dtype)
    return layout.constrain(x_BTD)


class WanTransformer(nnx.Module):
  """diffusers `WanTransformer3DModel` (text-to-video) as an NNX module; run it with `forward`.

  Parameter tree (our layout; `transformer_loading` maps diffusers keys onto it):
    patch_embedding.{kernel [pt, ph, pw, C, D], bias [D]}
    condition_embedder.{time_embedder.linear_1 [freq_dim, D], time_embedder.linear_2 [D, D],
      time_proj [D, 6D], text_embedder.linear_1 [text_dim, D], text_embedder.linear_2 [D, D]}
    blocks.{attn1, attn2}.{to_q, to_k, to_v, to_out} [Z, D, D], .{norm_q, norm_k} [Z, D],
      blocks.norm2.{weight, bias} [Z, D] (when cross_attn_norm), blocks.ffn.proj_in [Z, D, E],
      blocks.ffn.proj_out [Z, E, D], blocks.scale_shift_table [Z, 6, D]
    scale_shift_table [2, D], proj_out [D, C_out * pt * ph * pw]
  (every Dense has .kernel [I, O] and .bias [O]).
  """

  def __init__(self, config: WanTransformerConfig, params: Mapping[str, Any]):
    self.config = config
    self.patch_embedding = PatchEmbedding(**params["patch_embedding"])
    self.condition_embedder = ConditionEmbedder(params["condition_embedder"])
    self.blocks = WanBlock(params["blocks"])
    self.scale_shift_table = nnx.Param(params["scale_shift_table"])  # fp32 [2, D]
    self.proj_out = Dense(**params["proj_out"])

  @property
  def dtype(self) -> jnp.dtype:
    """The activation dtype (that of every parameter not kept in fp32)."""
    return self.patch_embedding.kernel.dtype


def _check_inputs(config: WanTransformerConfig, latents, timestep, text) -> None:
  if latents.ndim != 5 or latents.shape[1] != config.in_channels:
    raise ValueError(f"latents must be [B, C={config.in_channels}, F, Hl, Wl], got {latents.shape=}")
  batch = latents.shape[0]
  grid = latents.shape[2:]
  if any(n % p for n, p in zip(grid, config.patch_size)):
    raise ValueError(f"latent grid (F, Hl, Wl)={grid} must be divisible by {config.patch_size=}")
  tokens_grid = tuple(n // p for n, p in zip(grid, config.patch_size))
  if max(tokens_grid) > config.rope_max_seq_len:
    raise ValueError(f"token grid {tokens_grid} exceeds {config.rope_max_seq_len=} (diffusers' RoPE table)")
  if timestep.shape != (batch,):
    raise ValueError(f"timestep must be [B]=[{batch}] (per-token timesteps are not supported), "
                     f"got {timestep.shape=}")
  if text.ndim != 3 or text.shape[0] != batch or text.shape[2] != config.text_dim:
    raise ValueError(f"encoder_hidden_states must be [B={batch}, L, text_dim={config.text_dim}], "
                     f"got {text.shape=}")


@dataclasses.dataclass(frozen=True)
class ForwardContext:
  """What every block of one forward needs besides the video tokens (built by `embed`).

  Attributes:
    text_BLD: [B, L, D] projected text states (replicated).
    time_proj_B6D: [B, 6, D] timestep projection in the model dtype.
    temb_BD: [B, D] timestep embedding in the model dtype (the output norm's modulation).
    rope: (cos, sin) float32 [T, H/2] at the tokens' global positions (padded rows: cos 1, sin 0).
    layout: where the tokens live (mesh, valid and padded counts).
    latent_shape: (B, C, F, Hl, Wl) of the input latents.
  """
  text_BLD: jax.Array
  time_proj_B6D: jax.Array
  temb_BD: jax.Array
  rope: tuple[jax.Array, jax.Array]
  layout: SequenceLayout
  latent_shape: tuple[int, ...]


def embed(model: WanTransformer, latents: jax.Array, timestep: jax.Array,
          encoder_hidden_states: jax.Array, *, mesh: Mesh | None = None,
          attention_implementation: str = "auto", gather_weights: bool = False,
          attention_backend: str = "auto") -> tuple[jax.Array, ForwardContext]:
  """The part of `forward` before the blocks: patch embedding, condition embedder, RoPE table.

  Args: as `forward`.

  Returns:
    x_BTD: [B, T_padded, D] video tokens in the model dtype, T padded to a multiple of U * R with
      zero rows and sequence-sharded under a mesh; and the `ForwardContext` of the blocks.

  Raises:
    ValueError: as `forward`.
  """
  config = model.config
  _check_inputs(config, latents, timestep, encoder_hidden_states)
  dtype = model.dtype
  _, _, f, h, w = latents.shape
  pt, ph, pw = config.patch_size
  grid = (f // pt, h // ph, w // pw)
  if attention_implementation not in attention.IMPLEMENTATIONS:
    raise ValueError(f"unknown {attention_implementation=}; expected one of {attention.IMPLEMENTATIONS}")
  layout = SequenceLayout(mesh, math.prod(grid), attention_implementation, gather_weights, attention_backend)

  x_BTD = model.patch_embedding(latents.astype(dtype))
  temb_BD, time_proj_B6D, text_BLD = model.condition_embedder(
      timestep, encoder_hidden_states.astype(dtype), freq_dim=config.freq_dim)
  temb_BD, time_proj_B6D, text_BLD = (layout.constrain_rows(a) for a in (temb_BD, time_proj_B6D, text_BLD))
  # Padded rows get cos 1, sin 0 and zero tokens; padded keys are masked via kv_valid_len.
  cos, sin = producers.wan_rope_table(grid, config.attention_head_dim, length=layout.padded_tokens)
  rope = (layout.constrain_table(cos), layout.constrain_table(sin))
  x_BTD = layout.constrain(jnp.pad(x_BTD, ((0, 0), (0, layout.padding), (0, 0))))
  context = ForwardContext(text_BLD=text_BLD, time_proj_B6D=time_proj_B6D, temb_BD=temb_BD, rope=rope,
                           layout=layout, latent_shape=tuple(latents.shape))
  return x_BTD, context


def run_blocks(model: WanTransformer, x_BTD: jax.Array, context: ForwardContext, start: int = 0,
               stop: int | None = None) -> jax.Array:
  """Blocks start..stop-1 (Python slice bounds, static) on x, by one `lax.scan` over their weights.

  `run_blocks(m, x, c)` runs every block (what `forward` does); a step cache runs block 0 with
  `stop=1` and the rest with `start=1` (pipelines/wan/step_cache.py), the same scanned block.

  Args:
    x_BTD: [B, T_padded, D] in the model dtype (from `embed` or a previous `run_blocks`).
    context: from `embed` on the same call.

  Returns:
    [B, T_padded, D] in the model dtype, sequence-sharded under a mesh.

  Raises:
    ValueError: an empty or out-of-range block range.
  """
  layers = model.config.num_layers
  stop = layers if stop is None else stop
  if not 0 <= start < stop <= layers:
    raise ValueError(f"blocks {start}..{stop - 1} are not a non-empty range of the {layers} blocks")
  blocks = model.blocks
  if (start, stop) != (0, layers):
    blocks = jax.tree.map(lambda a: a[start:stop], blocks)  # the Z axis of every stacked array

  def body(x_BTD, block):
    block = context.layout.gathered(block)  # sharded weights: this layer's all-gather
    return block(x_BTD, context.text_BLD, context.time_proj_B6D, context.rope, config=model.config,
                 layout=context.layout), None

  x_BTD, _ = jax.lax.scan(body, x_BTD, blocks)
  return x_BTD


def unembed(model: WanTransformer, x_BTD: jax.Array, context: ForwardContext) -> jax.Array:
  """The part of `forward` after the blocks: output norm, projection, padded rows dropped, unpatchify.

  Args:
    x_BTD: [B, T_padded, D] in the model dtype (the last block's output).

  Returns:
    [B, C_out, F, Hl, Wl] in the model dtype.
  """
  config = model.config
  b, _, f, h, w = context.latent_shape
  pt, ph, pw = config.patch_size
  grid = (f // pt, h // ph, w // pw)
  # Output norm (fp32 modulation from the fp32 table + temb), projection, unpatchify.
  mod_B2D = model.scale_shift_table[...][None] + context.temb_BD[:, None, :].astype(jnp.float32)
  shift, scale = jnp.split(mod_B2D, 2, axis=1)
  x_BTD = producers.layernorm_adaln(x_BTD, scale, shift, eps=config.eps)
  x_BTP = model.proj_out(x_BTD)[:, : context.layout.tokens]  # P = pt * ph * pw * C_out
  x = x_BTP.reshape(b, *grid, pt, ph, pw, config.out_channels)
  x = x.transpose(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C_out, F/pt, pt, Hl/ph, ph, Wl/pw, pw]
  return x.reshape(b, config.out_channels, f, h, w)


def forward(model: WanTransformer, latents: jax.Array, timestep: jax.Array,
            encoder_hidden_states: jax.Array, *, mesh: Mesh | None = None,
            attention_implementation: str = "auto", gather_weights: bool = False,
            attention_backend: str = "auto") -> jax.Array:
  """Noise (flow) prediction of diffusers' `WanTransformer3DModel.forward`. Jit-friendly.

  `embed`, then every block (`run_blocks`), then `unembed`.

  Args:
    model: a `WanTransformer` (from `load_transformer` or `init_transformer`).
    latents: [B, C, F, Hl, Wl]; cast to the model dtype (diffusers' pipeline feeds
      `latents.to(transformer_dtype)`). F, Hl, Wl divisible by the patch size.
    timestep: [B] diffusion timesteps (0..1000, fractional allowed).
    encoder_hidden_states: [B, L, text_dim] text-encoder states; cast to the model dtype.
    mesh: None for one device, or a (cfg, ring, ulysses) mesh (`attention.MeshSpec(...).build()`):
      the forward then runs sequence-parallel over U * R devices, the batch split over the cfg
      axis (its size must divide B) (static under jit).
    attention_implementation: "auto" (fixed-m where the mesh-uniform gate admits it, else LSE),
      "lse" or "fixed_m" (forced; NaN where the gate rejects), for every self- and
      cross-attention (static under jit).
    gather_weights: the stacked block weights are sharded over the mesh (FSDP / ZeRO-3,
      `MeshSpec.shard_weights`): each layer's are all-gathered inside the layer scan (static).
    attention_backend: "auto" (Pallas kernels on TPU and GPU, XLA elsewhere), "xla" or "pallas"
      for every attention call (static; same numbers either way).

  Returns:
    [B, C_out, F, Hl, Wl] in the model dtype.

  Raises:
    ValueError: shapes that do not fit the config, or a mesh without the sequence axes.
  """
  x_BTD, context = embed(model, latents, timestep, encoder_hidden_states, mesh=mesh,
                         attention_implementation=attention_implementation, gather_weights=gather_weights,
                         attention_backend=attention_backend)
  return unembed(model, run_blocks(model, x_BTD, context), context)


def weight_shardings(state: Any, mesh: Mesh | None, shard_weights: bool = False) -> Any:
  """Where a `WanTransformer`'s weights (an `nnx.State`) go on `mesh`: a pytree of shardings.

  Replicated over the mesh by default (DESIGN.md section 2). With `shard_weights` (FSDP / ZeRO-3
  over all C * R * U devices), each stacked block weight [Z, ...] is split along its largest
  non-layer axis that the device count divides (`forward(..., gather_weights=True)` all-gathers one
  layer at a time inside the layer scan); the rest (embeddings, output head: a few percent of the
  weights) and block weights with no such axis stay replicated.

  Args:
    state: the weights (leaves are arrays; the block weights under a "blocks" key).
    mesh: None (one device: `SingleDeviceSharding` of the first device) or the mesh.
    shard_weights: split the block weights as above.
  """
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, state)

  def place(path, leaf) -> NamedSharding:
    in_blocks = any(getattr(k, "key", getattr(k, "name", None)) == "blocks" for k in path)
    if not (shard_weights and in_blocks):
      return NamedSharding(mesh, P())
    return _split_largest_axis(mesh, tuple(leaf.shape), first_axis=1)

  return jax.tree_util.tree_map_with_path(place, state)


def _split_largest_axis(mesh: Mesh, shape: tuple[int, ...], first_axis: int = 0) -> NamedSharding:
  """A sharding of `shape` over all of the mesh's devices along its largest axis (from
  `first_axis` on) that the device count divides; replicated when there is none."""
  devices = mesh.devices.size
  options = [d for d in range(first_axis, len(shape)) if shape[d] % devices == 0]
  if devices == 1 or not options:
    return NamedSharding(mesh, P())
  d = max(options, key=lambda i: shape[i])
  return NamedSharding(mesh, P(*([None] * d), tuple(mesh.axis_names)))


LARGE_LEAF_ELEMENTS = 1 << 20  # `large_leaf_shardings`' default: leaves of 4 MiB (fp32) or more


def large_leaf_shardings(tree: Any, mesh: Mesh, min_elements: int | None = None) -> Any:
  """Shardings for a weight tree that has no layer structure to gather from (the UMT5 text
  encoder): every leaf of at least `min_elements` values split along its largest axis that the
  device count divides, the rest replicated. Under jit GSPMD then partitions their matmuls
  (tensor-parallel; a reduction's order, and so its rounding, may change). `min_elements` defaults
  to `LARGE_LEAF_ELEMENTS`."""
  min_elements = LARGE_LEAF_ELEMENTS if min_elements is None else min_elements
  return jax.tree.map(lambda leaf: (_split_largest_axis(mesh, tuple(leaf.shape)) if leaf.size >= min_elements
                                    else NamedSharding(mesh, P())), tree)


def param_shapes(config: WanTransformerConfig) -> dict[str, Any]:
  """Our parameter tree (nested dicts of shape tuples), `WanTransformer`'s layout."""
  d, z, e = config.dim, config.num_layers, config.ffn_dim
  pt, ph, pw = config.patch_size

  def dense(i, o, layers=()):
    return {"kernel": (*layers, i, o), "bias": (*layers, o)}

  def attn():
    return {**{n: dense(d, d, (z,)) for n in ("to_q", "to_k", "to_v", "to_out")},
            "norm_q": (z, d), "norm_k": (z, d)}

  blocks = {"attn1": attn(), "attn2": attn(),
            "ffn": {"proj_in": dense(d, e, (z,)), "proj_out": dense(e, d, (z,))},
            "scale_shift_table": (z, 6, d)}
  if config.cross_attn_norm:
    blocks["norm2"] = {"weight": (z, d), "bias": (z, d)}
  return {
      "patch_embedding": {"kernel": (pt, ph, pw, config.in_channels, d), "bias": (d,)},
      "condition_embedder": {
          "time_embedder": {"linear_1": dense(config.freq_dim, d), "linear_2": dense(d, d)},
          "time_proj": dense(d, 6 * d),
          "text_embedder": {"linear_1": dense(config.text_dim, d), "linear_2": dense(d, d)},
      },
      "blocks": blocks,
      "scale_shift_table": (2, d),
      "proj_out": dense(d, config.out_channels * config.patch_volume),
  }


def _map_with_path(fn, tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
  """Applies fn(path, leaf) to every non-dict leaf of a nested dict."""
  return {k: _map_with_path(fn, v, (*path, k)) if isinstance(v, Mapping) else fn((*path, k), v)
          for k, v in tree.items()}


def build_transformer(config: WanTransformerConfig, params: Mapping[str, Any],
                      dtype: jnp.dtype = jnp.float32) -> WanTransformer:
  """Builds the module from a nested dict of arrays in our layout, casting per diffusers' policy.

  Every array is cast to `dtype` except those under `KEEP_IN_FP32`, which become fp32.

  Raises:
    ValueError: an array's shape differs from `param_shapes(config)` (names all of them).
  """
  shapes = param_shapes(config)
  bad = []

  def cast(path, shape):
    value = _lookup(params, path)
    if value is None or tuple(value.shape) != tuple(shape):
      bad.append(f"{'.'.join(path)}: got {None if value is None else tuple(value.shape)}, want {shape}")
      return None
    return jnp.asarray(value, jnp.float32 if keeps_fp32(path) else dtype)

  arrays = _map_with_path(cast, shapes)
  if bad:
    raise ValueError(f"parameters do not fit {config}:\n  " + "\n  ".join(bad))
  return WanTransformer(config, arrays)


def _lookup(tree: Mapping[str, Any], path: tuple[str, ...]):
  for key in path:
    if not isinstance(tree, Mapping) or key not in tree:
      return None
    tree = tree[key]
  return tree


def init_transformer(config: WanTransformerConfig, seed: int = 0,
                     dtype: jnp.dtype = jnp.float32) -> WanTransformer:
  """Random initialisation with torch's defaults (what diffusers gives before loading weights).

  Linear / Conv3d kernels and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)); RMSNorm / LayerNorm
  gains 1, biases 0; scale_shift_tables ~ N(0, 1) / sqrt(D) (diffusers' init). Drawn in fp32
  with numpy on the host (no per-parameter XLA compiles: those cost ~10 s for the tiny config on
  CPU) and cast as in `build_transformer`.
  """
  shapes = param_shapes(config)
  rng = np.random.default_rng(seed)
  fan_in = {"patch_embedding": config.in_channels * config.patch_volume}

  def draw(path, shape):
    if path[-1] == "scale_shift_table":
      return rng.standard_normal(shape, np.float32) / np.float32(math.sqrt(config.dim))
    if path[-1] in ("norm_q", "norm_k") or path[-2:] == ("norm2", "weight"):
      return np.ones(shape, np.float32)
    if path[-2:] == ("norm2", "bias"):
      return np.zeros(shape, np.float32)
    # Dense / Conv kernel [..., I, O] ([pt, ph, pw, C, D]) or its bias, sharing its fan-in.
    kernel_shape = _lookup(shapes, (*path[:-1], "kernel"))
    bound = np.float32(1.0 / math.sqrt(fan_in.get(path[0], kernel_shape[-2])))
    value = rng.random(shape, np.float32)
    value *= 2 * bound
    value -= bound
    return value

  def draw_and_cast(path, shape):
    # Cast leaf by leaf so that at most one fp32 host copy is alive at a time (1.3B: 5 GB fp32).
    return jnp.asarray(draw(path, shape), jnp.float32 if keeps_fp32(path) else dtype)

  params = _map_with_path(draw_and_cast, shapes)
  return build_transformer(config, params, dtype)


def count_params(model: WanTransformer) -> int:
  """Total number of parameters."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
