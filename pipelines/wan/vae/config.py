"""The Wan causal video VAE's configuration (diffusers' `AutoencoderKLWan` config.json) and presets:
the Wan 2.1 VAE (z_dim 16, 8x spatial) and the Wan 2.2 TI2V-5B VAE (z_dim 48, residual blocks,
2x2 patching, 16x spatial).

Field names and defaults are diffusers'; `WanVAEConfig.from_diffusers` reads a released vae
`config.json` unchanged. The config also names its layers (`encoder_layers`, `decoder_layers`,
`quant_layers`: `topology` descriptions) and their checkpoint shapes. No compute; the `vae`
package names its public names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pipelines.wan.vae import topology

# Wan 2.1 VAE latent statistics (diffusers `AutoencoderKLWan` defaults, also in the released config).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# Wan 2.2 VAE (TI2V-5B) latent statistics (diffusers scripts/convert_wan_to_diffusers.py, vae22 config).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)


# Keys of released vae config.json files that diffusers' `AutoencoderKLWan` does not take (the
# converted Wan 2.2 VAE config carries `clip_output: false`); skipped by `from_diffusers`.
IGNORED_KEYS = ("clip_output",)


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
  """`AutoencoderKLWan` config; field names and defaults are diffusers' (the released Wan 2.1 VAE).

  `is_residual=True` is the Wan 2.2 VAE's topology (residual down / up blocks with `AvgDown3D` /
  `DupUp3D` shortcuts, upsamplers that keep the channels); `patch_size` p folds p x p pixels into
  channels before the encoder and back after the decoder, so `in_channels` / `out_channels` count
  3 p^2 and the spatial factor is 2^(len(dim_mult) - 1) * p. `dropout` is accepted and ignored;
  `from_diffusers` also skips `clip_output` (a key of the converted Wan 2.2 config that diffusers'
  `AutoencoderKLWan` does not take).
  """
  base_dim: int = 96
  decoder_base_dim: int | None = None
  z_dim: int = 16
  dim_mult: tuple[int, ...] = (1, 2, 4, 4)
  num_res_blocks: int = 2
  attn_scales: tuple[float, ...] = ()
  temperal_downsample: tuple[bool, ...] = (False, True, True)
  dropout: float = 0.0
  latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
  latents_std: tuple[float, ...] = WAN21_LATENTS_STD
  is_residual: bool = False
  in_channels: int = 3
  out_channels: int = 3
  patch_size: int | None = None
  scale_factor_temporal: int | None = 4
  scale_factor_spatial: int | None = 8

  def __post_init__(self):
    for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
      object.__setattr__(self, name, tuple(getattr(self, name)))
    if self.patch_size is not None and (not isinstance(self.patch_size, int) or self.patch_size < 1):
      raise ValueError(f"{self.patch_size=} must be None or a positive int")
    for name in ("in_channels", "out_channels"):
      if getattr(self, name) % self.patch ** 2:
        raise ValueError(f"{name}={getattr(self, name)} must be a multiple of patch_size^2 = {self.patch ** 2} "
                         "(3 video channels per pixel of a patch)")
    for name in ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.decoder_base_dim is not None and self.decoder_base_dim < 1:
      raise ValueError(f"{self.decoder_base_dim=} must be >= 1 or None")
    if len(self.dim_mult) < 1 or min(self.dim_mult) < 1:
      raise ValueError(f"{self.dim_mult=} must be a non-empty list of positive multipliers")
    if len(self.temperal_downsample) != len(self.dim_mult) - 1:
      raise ValueError(f"{self.temperal_downsample=} needs len(dim_mult) - 1 = {len(self.dim_mult) - 1} entries")
    if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
      raise ValueError(f"latents_mean/std need {self.z_dim=} entries, got {len(self.latents_mean)}, "
                       f"{len(self.latents_std)}")
    if self.scale_factor_spatial is not None and self.scale_factor_spatial != self.spatial_factor:
      raise ValueError(f"{self.scale_factor_spatial=} disagrees with {self.dim_mult=} "
                       f"(2 ** {len(self.dim_mult) - 1} = {self.spatial_factor})")
    if self.scale_factor_temporal is not None and self.scale_factor_temporal != self.temporal_factor:
      raise ValueError(f"{self.scale_factor_temporal=} disagrees with {self.temperal_downsample=} "
                       f"(2 ** {sum(self.temperal_downsample)} = {self.temporal_factor})")

  @property
  def patch(self) -> int:
    """p, the pixels per side folded into channels (1 without `patch_size`)."""
    return self.patch_size or 1

  @property
  def video_channels(self) -> int:
    """Channels of the encoder's input video / the decoder's output video (3)."""
    return self.in_channels // self.patch ** 2

  @property
  def spatial_factor(self) -> int:
    """Pixels per latent per side: 8 for Wan 2.1, 16 for Wan 2.2 (2^3 x the 2x2 patch)."""
    return 2 ** (len(self.dim_mult) - 1) * self.patch

  @property
  def temporal_factor(self) -> int:
    return 2 ** sum(self.temperal_downsample)

  @classmethod
  def from_diffusers(cls, raw: Mapping[str, Any]) -> WanVAEConfig:
    """From a diffusers vae `config.json` dict; `_`-prefixed keys are metadata and skipped.

    Raises:
      ValueError: `_class_name` is not AutoencoderKLWan, an unknown key, or a failed validation.
    """
    class_name = raw.get("_class_name", "AutoencoderKLWan")
    if class_name != "AutoencoderKLWan":
      raise ValueError(f"expected an AutoencoderKLWan config, got {class_name=}")
    fields = {f.name for f in dataclasses.fields(cls)}
    raw = {k: v for k, v in raw.items() if k not in IGNORED_KEYS}
    unknown = sorted(k for k in raw if not k.startswith("_") and k not in fields)
    if unknown:
      raise ValueError(f"unknown AutoencoderKLWan config keys {unknown}; known: {sorted(fields)}")
    return cls(**{k: v for k, v in raw.items() if k in fields})

  def encoder_layers(self) -> tuple[topology.Layer, ...]:
    return topology.encoder_layers(
        in_channels=self.in_channels, dim=self.base_dim, z_dim=self.z_dim, dim_mult=self.dim_mult,
        num_res_blocks=self.num_res_blocks, attn_scales=self.attn_scales,
        temperal_downsample=self.temperal_downsample, is_residual=self.is_residual)

  def decoder_layers(self) -> tuple[topology.Layer, ...]:
    return topology.decoder_layers(
        out_channels=self.out_channels, dim=self.decoder_base_dim or self.base_dim, z_dim=self.z_dim,
        dim_mult=self.dim_mult, num_res_blocks=self.num_res_blocks,
        temperal_upsample=self.temperal_downsample[::-1], is_residual=self.is_residual)

  def quant_layers(self) -> tuple[topology.CausalConv, topology.CausalConv]:
    """`quant_conv` (after the encoder) and `post_quant_conv` (before the decoder), both 1x1x1."""
    return (topology.CausalConv("quant_conv", 2 * self.z_dim, 2 * self.z_dim, 1),
            topology.CausalConv("post_quant_conv", self.z_dim, self.z_dim, 1))

  def decode_layers(self) -> tuple[topology.Layer, ...]:
    """What a latent chunk runs through to become video: `post_quant_conv`, then `decoder_layers`."""
    return (self.quant_layers()[1], *self.decoder_layers())

  def param_shapes(self) -> dict[str, tuple[int, ...]]:
    """Checkpoint-layout shape of every `AutoencoderKLWan` state-dict key."""
    return topology.param_shapes((*self.encoder_layers(), *self.quant_layers(), *self.decoder_layers()))


VAE_PRESETS = {
    "wan2.1": WanVAEConfig(),
    # The parity-test topology: every layer kind, 3 channels wide.
    "tiny": WanVAEConfig(base_dim=3, dim_mult=(1, 1, 1, 1), num_res_blocks=1),
    # The Wan 2.2 topology at tiny widths (parity tests, the tiny TI2V folder): every layer kind,
    # AvgDown3D groups of 4 and 8, DupUp3D repeats of 4 and 8, a decoder wider than the encoder.
    "tiny-ti2v": WanVAEConfig(base_dim=4, decoder_base_dim=6, z_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
                              is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                              scale_factor_spatial=16, latents_mean=tuple(0.1 * i for i in range(8)),
                              latents_std=tuple(0.5 + 0.1 * i for i in range(8))),
    # Wan 2.2 TI2V-5B (diffusers' converted vae22 config).
    "wan2.2": WanVAEConfig(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12,
                           out_channels=12, patch_size=2, scale_factor_spatial=16,
                           latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD),
}
