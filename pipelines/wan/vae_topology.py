"""The Wan 2.1 causal video VAE's architecture as data: one source for parameter shapes and the forward.

The encoder and decoder are flat sequences of layer descriptions (`CausalConv`, `ResBlock`,
`AttnBlock`, `Resample`, `NormSiLU`) named by diffusers' state-dict prefixes; `param_shapes` gives
the checkpoint-layout shape of every key they own and `to_jax_layout` converts one checkpoint
tensor to the layout `vae_layers` computes with. No compute; re-exported by `vae_layers`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class CausalConv:
  """`WanCausalConv3d` with a cubic kernel of side `kernel` (3: cached causal conv, 1: pointwise)."""
  name: str
  in_dim: int
  out_dim: int
  kernel: int


@dataclasses.dataclass(frozen=True)
class ResBlock:
  """`WanResidualBlock`: RMS-norm, SiLU, causal conv, twice; 1x1x1 conv shortcut when dims differ."""
  name: str
  in_dim: int
  out_dim: int


@dataclasses.dataclass(frozen=True)
class AttnBlock:
  """`WanAttentionBlock`: single-head self-attention over the H x W pixels of each frame."""
  name: str
  dim: int


@dataclasses.dataclass(frozen=True)
class Resample:
  """`WanResample` in mode upsample2d / upsample3d / downsample2d / downsample3d."""
  name: str
  mode: str
  dim: int
  out_dim: int


@dataclasses.dataclass(frozen=True)
class NormSiLU:
  """The heads' `norm_out` (`WanRMS_norm`) followed by SiLU."""
  name: str
  dim: int


Layer = CausalConv | ResBlock | AttnBlock | Resample | NormSiLU


def _mid_block(name: str, dim: int) -> list[Layer]:
  # WanMidBlock(num_layers=1): resnet, attention, resnet.
  return [ResBlock(f"{name}.resnets.0", dim, dim), AttnBlock(f"{name}.attentions.0", dim),
          ResBlock(f"{name}.resnets.1", dim, dim)]


def encoder_layers(
    *, in_channels: int, dim: int, z_dim: int, dim_mult: Sequence[int], num_res_blocks: int,
    attn_scales: Sequence[float], temperal_downsample: Sequence[bool]) -> tuple[Layer, ...]:
  """`WanEncoder3d` (is_residual=False) as a layer sequence; it outputs 2 * z_dim channels."""
  dims = [dim * u for u in (1, *dim_mult)]
  layers: list[Layer] = [CausalConv("encoder.conv_in", in_channels, dims[0], 3)]
  down: list[Layer] = []
  scale = 1.0
  for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
    for _ in range(num_res_blocks):
      down.append(ResBlock(f"encoder.down_blocks.{len(down)}", in_dim, out_dim))
      if scale in attn_scales:
        down.append(AttnBlock(f"encoder.down_blocks.{len(down)}", out_dim))
      in_dim = out_dim
    if i != len(dim_mult) - 1:
      mode = "downsample3d" if temperal_downsample[i] else "downsample2d"
      down.append(Resample(f"encoder.down_blocks.{len(down)}", mode, out_dim, out_dim))
      scale /= 2.0
  layers += down
  layers += _mid_block("encoder.mid_block", dims[-1])
  layers += [NormSiLU("encoder.norm_out", dims[-1]), CausalConv("encoder.conv_out", dims[-1], 2 * z_dim, 3)]
  return tuple(layers)


def decoder_layers(
    *, out_channels: int, dim: int, z_dim: int, dim_mult: Sequence[int], num_res_blocks: int,
    temperal_upsample: Sequence[bool]) -> tuple[Layer, ...]:
  """`WanDecoder3d` (is_residual=False) as a layer sequence."""
  dims = [dim * u for u in (dim_mult[-1], *dim_mult[::-1])]
  layers: list[Layer] = [CausalConv("decoder.conv_in", z_dim, dims[0], 3)]
  layers += _mid_block("decoder.mid_block", dims[0])
  for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
    if i > 0:
      in_dim //= 2  # Wan 2.1: each upsampler halves the channels (`upsample_out_dim = dim // 2`).
    for j in range(num_res_blocks + 1):
      layers.append(ResBlock(f"decoder.up_blocks.{i}.resnets.{j}", in_dim, out_dim))
      in_dim = out_dim
    if i != len(dim_mult) - 1:
      mode = "upsample3d" if temperal_upsample[i] else "upsample2d"
      layers.append(Resample(f"decoder.up_blocks.{i}.upsamplers.0", mode, out_dim, out_dim // 2))
  layers += [NormSiLU("decoder.norm_out", dims[-1]), CausalConv("decoder.conv_out", dims[-1], out_channels, 3)]
  return tuple(layers)


def param_shapes(layers: Sequence[Layer]) -> dict[str, tuple[int, ...]]:
  """Checkpoint-layout (PyTorch) shape of every parameter the layers use, keyed by diffusers name."""
  shapes: dict[str, tuple[int, ...]] = {}

  def conv(name, in_dim, out_dim, kernel):
    shapes[f"{name}.weight"] = (out_dim, in_dim, *kernel)
    shapes[f"{name}.bias"] = (out_dim,)

  for layer in layers:
    match layer:
      case CausalConv(name, i, o, k):
        conv(name, i, o, (k, k, k))
      case ResBlock(name, i, o):
        shapes[f"{name}.norm1.gamma"] = (i, 1, 1, 1)
        conv(f"{name}.conv1", i, o, (3, 3, 3))
        shapes[f"{name}.norm2.gamma"] = (o, 1, 1, 1)
        conv(f"{name}.conv2", o, o, (3, 3, 3))
        if i != o:
          conv(f"{name}.conv_shortcut", i, o, (1, 1, 1))
      case AttnBlock(name, d):
        shapes[f"{name}.norm.gamma"] = (d, 1, 1)
        conv(f"{name}.to_qkv", d, 3 * d, (1, 1))
        conv(f"{name}.proj", d, d, (1, 1))
      case Resample(name, mode, d, o):
        conv(f"{name}.resample.1", d, o, (3, 3))
        if mode == "upsample3d":
          conv(f"{name}.time_conv", d, 2 * d, (3, 1, 1))
        elif mode == "downsample3d":
          conv(f"{name}.time_conv", d, d, (3, 1, 1))
      case NormSiLU(name, d):
        shapes[f"{name}.gamma"] = (d, 1, 1, 1)
      case _:
        raise ValueError(f"unknown layer {layer=}")
  return shapes


def to_jax_layout(key: str, value):
  """Checkpoint (PyTorch) layout -> JAX layout for one parameter; works on numpy and jax arrays.

  Conv3d `[O, I, kt, kh, kw]` -> `[kt, kh, kw, I, O]`; Conv2d `[O, I, kh, kw]` -> `[1, kh, kw, I, O]`;
  gammas `[C, 1, 1(, 1)]` -> `[C]`; biases unchanged.

  Raises:
    ValueError: a weight that is neither 4-D nor 5-D.
  """
  if key.endswith(".gamma"):
    return value.reshape(value.shape[0])
  if key.endswith(".weight"):
    if value.ndim == 5:
      return value.transpose(2, 3, 4, 1, 0)
    if value.ndim == 4:
      return value.transpose(2, 3, 1, 0)[None]
    raise ValueError(f"conv weight {key!r} must be 4-D or 5-D, got {value.shape=}")
  return value
