"""The Wan causal video VAE's architecture as data: one source for parameter shapes and the forward.

The encoder and decoder are sequences of layer descriptions (`CausalConv`, `ResBlock`,
`AttnBlock`, `Resample`, `NormSiLU`, and for the Wan 2.2 VAE (`is_residual=True`) `ResidualGroup`:
a down/up block whose input also takes a parameter-free `Shortcut`) named by diffusers' state-dict
prefixes; `param_shapes` gives
the checkpoint-layout shape of every key they own and `to_jax_layout` converts one checkpoint
tensor to the layout `layers` computes with. No compute; the `vae` package names `to_jax_layout`.
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


@dataclasses.dataclass(frozen=True)
class Shortcut:
  """diffusers' parameter-free shortcuts of the Wan 2.2 residual blocks, on `[B, T, H, W, C]`.

  kind "avg_down" (`AvgDown3D`): space-to-channels by (factor_t, factor_s, factor_s), then the mean
  of each group of in_dim * factor / out_dim channels; "dup_up" (`DupUp3D`): each channel repeated
  out_dim * factor / in_dim times, then channels-to-space.
  """
  kind: str
  in_dim: int
  out_dim: int
  factor_t: int
  factor_s: int

  def __post_init__(self):
    factor = self.factor_t * self.factor_s ** 2
    if self.kind == "avg_down" and (self.in_dim * factor) % self.out_dim:
      raise ValueError(f"AvgDown3D: in_dim * factor = {self.in_dim} * {factor} must be divisible by {self.out_dim=}")
    if self.kind == "dup_up" and (self.out_dim * factor) % self.in_dim:
      raise ValueError(f"DupUp3D: out_dim * factor = {self.out_dim} * {factor} must be divisible by {self.in_dim=}")
    if self.kind not in ("avg_down", "dup_up"):
      raise ValueError(f"unknown shortcut {self.kind=}")


@dataclasses.dataclass(frozen=True)
class ResidualGroup:
  """`WanResidualDownBlock` / `WanResidualUpBlock`: body(x) + shortcut(x) (no shortcut: body(x))."""
  name: str
  body: tuple
  shortcut: Shortcut | None


Layer = CausalConv | ResBlock | AttnBlock | Resample | NormSiLU | ResidualGroup


def _mid_block(name: str, dim: int) -> list[Layer]:
  # WanMidBlock(num_layers=1): resnet, attention, resnet.
  return [ResBlock(f"{name}.resnets.0", dim, dim), AttnBlock(f"{name}.attentions.0", dim),
          ResBlock(f"{name}.resnets.1", dim, dim)]


def _residual_down(dims: Sequence[int], num_res_blocks: int, temperal_downsample: Sequence[bool]) -> list[Layer]:
  """The Wan 2.2 encoder's `WanResidualDownBlock`s (no attention: diffusers builds none there)."""
  groups: list[Layer] = []
  last = len(dims) - 2
  for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
    name = f"encoder.down_blocks.{i}"
    body: list[Layer] = []
    for j in range(num_res_blocks):
      body.append(ResBlock(f"{name}.resnets.{j}", in_dim if j == 0 else out_dim, out_dim))
    temporal = i != last and temperal_downsample[i]
    if i != last:
      body.append(Resample(f"{name}.downsampler", "downsample3d" if temporal else "downsample2d", out_dim, out_dim))
    shortcut = Shortcut("avg_down", in_dim, out_dim, 2 if temporal else 1, 2 if i != last else 1)
    groups.append(ResidualGroup(name, tuple(body), shortcut))
  return groups


def encoder_layers(
    *, in_channels: int, dim: int, z_dim: int, dim_mult: Sequence[int], num_res_blocks: int,
    attn_scales: Sequence[float], temperal_downsample: Sequence[bool], is_residual: bool = False) -> tuple[Layer, ...]:
  """`WanEncoder3d` as a layer sequence; it outputs 2 * z_dim channels."""
  dims = [dim * u for u in (1, *dim_mult)]
  layers: list[Layer] = [CausalConv("encoder.conv_in", in_channels, dims[0], 3)]
  if is_residual:
    down = _residual_down(dims, num_res_blocks, temperal_downsample)
  else:
    down = _plain_down(dims, num_res_blocks, attn_scales, temperal_downsample)
  layers += down
  layers += _mid_block("encoder.mid_block", dims[-1])
  layers += [NormSiLU("encoder.norm_out", dims[-1]), CausalConv("encoder.conv_out", dims[-1], 2 * z_dim, 3)]
  return tuple(layers)


def _plain_down(dims: Sequence[int], num_res_blocks: int, attn_scales: Sequence[float],
                temperal_downsample: Sequence[bool]) -> list[Layer]:
  """The Wan 2.1 encoder's down blocks (resnets, attention at `attn_scales`, resamplers), flat."""
  down: list[Layer] = []
  scale = 1.0
  for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
    for _ in range(num_res_blocks):
      down.append(ResBlock(f"encoder.down_blocks.{len(down)}", in_dim, out_dim))
      if scale in attn_scales:
        down.append(AttnBlock(f"encoder.down_blocks.{len(down)}", out_dim))
      in_dim = out_dim
    if i != len(dims) - 2:
      mode = "downsample3d" if temperal_downsample[i] else "downsample2d"
      down.append(Resample(f"encoder.down_blocks.{len(down)}", mode, out_dim, out_dim))
      scale /= 2.0
  return down


def _residual_up(dims: Sequence[int], num_res_blocks: int, temperal_upsample: Sequence[bool]) -> list[Layer]:
  """The Wan 2.2 decoder's `WanResidualUpBlock`s: channels are not halved by the upsamplers."""
  groups: list[Layer] = []
  last = len(dims) - 2
  for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
    name = f"decoder.up_blocks.{i}"
    body: list[Layer] = [ResBlock(f"{name}.resnets.{j}", in_dim if j == 0 else out_dim, out_dim)
                         for j in range(num_res_blocks + 1)]
    shortcut = None
    if i != last:
      temporal = temperal_upsample[i]
      body.append(Resample(f"{name}.upsampler", "upsample3d" if temporal else "upsample2d", out_dim, out_dim))
      shortcut = Shortcut("dup_up", in_dim, out_dim, 2 if temporal else 1, 2)
    groups.append(ResidualGroup(name, tuple(body), shortcut))
  return groups


def decoder_layers(
    *, out_channels: int, dim: int, z_dim: int, dim_mult: Sequence[int], num_res_blocks: int,
    temperal_upsample: Sequence[bool], is_residual: bool = False) -> tuple[Layer, ...]:
  """`WanDecoder3d` as a layer sequence."""
  dims = [dim * u for u in (dim_mult[-1], *dim_mult[::-1])]
  layers: list[Layer] = [CausalConv("decoder.conv_in", z_dim, dims[0], 3)]
  layers += _mid_block("decoder.mid_block", dims[0])
  if is_residual:
    layers += _residual_up(dims, num_res_blocks, temperal_upsample)
    return (*layers, NormSiLU("decoder.norm_out", dims[-1]),
            CausalConv("decoder.conv_out", dims[-1], out_channels, 3))
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


def decode_flops(layers: Sequence[Layer], frames: int, height: int, width: int) -> float:
  """Matmul FLOPs (2 per multiply-add) of decoding latents of `frames` x `height` x `width` through
  `layers` (`WanVAEConfig.decode_layers`) as the chunked decode runs them: the first latent
  frame alone (an upsample3d keeps its one frame), each later one doubled by every upsample3d.

  Counts the convolutions as `layers` runs them (a k x k x k kernel: 2 k^3 I O per output pixel; an
  upsampler's 3 x 3 on the doubled grid as four 2 x 2 phases on the input's, padded by one row and
  column: 2 x 16 I O per input pixel, 4/9 of the 3 x 3's; its 3 x 1 x 1 time_conv, I -> 2 I, on
  every frame but the first chunk's) and
  the per-frame attention (q, k, v and output projections, q k^T and p v over H W pixels). Norms,
  SiLU, sums and resizes are not matmuls (a few % of the FLOPs at Wan widths) and are left out.
  `decode_flops` with `encoder_layers` is not the encode (its downsamplers shrink, not grow, frames).
  """
  return _walk_flops(layers, frames, height, width)[0]


def _walk_flops(layers: Sequence[Layer], f: int, h: int, w: int) -> tuple[float, int, int, int]:
  """(`decode_flops` of `layers` on f x h x w, the f x h x w they output)."""
  total = 0.0
  for layer in layers:
    match layer:
      case ResidualGroup(_, body, _):
        flops, f, h, w = _walk_flops(body, f, h, w)
        total += flops
      case CausalConv(_, i, o, k):
        total += 2.0 * k ** 3 * i * o * f * h * w
      case ResBlock(_, i, o):
        total += 2.0 * 27 * (i * o + o * o) * f * h * w + (2.0 * i * o * f * h * w if i != o else 0.0)
      case AttnBlock(_, c):
        n = h * w
        total += f * (2.0 * n * c * 4 * c + 4.0 * n * n * c)
      case Resample(_, mode, i, o) if mode.startswith("up"):
        if mode == "upsample3d":
          total += 2.0 * 3 * i * 2 * i * (f - 1) * h * w
          f = 2 * f - 1
        total += 2.0 * 16 * i * o * f * (h + 1) * (w + 1)  # `layers.upsample_conv`: 4 phases of 2 x 2
        h, w = 2 * h, 2 * w
      case Resample():
        raise ValueError(f"decode_flops counts a decoder; {layer.name} is a {layer.mode}")
  return total, f, h, w


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
      case ResidualGroup(_, body, _):
        shapes.update(param_shapes(body))
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
