"""How a model turns a video into tokens: `TokenFacts`, the one owner of "video -> tokens" that the
planner's estimates (`estimate`, `planner`) and the pipeline's shapes (`pipeline.checked.model_facts`) read.

A video of `frames` (4k + 1) x height x width becomes latents [C, F, Hl, Wl] with
F = (frames - 1) // temporal_factor + 1, Hl = height // spatial_factor, Wl = width // spatial_factor
(the VAE), then T = F/pt * Hl/ph * Wl/pw tokens (the transformer's patch embedding); every
cross-attention reads L text tokens and P image tokens beside them (DESIGN.md section 1). This layer
imports no model code: the numbers are read from the model's configs above it
(`pipeline.checked.model_facts.ModelFacts.token_facts`).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class TokenFacts:
  """What a model's token counts follow from.

  Attributes:
    temporal_factor: the VAE's frames per latent frame after the first (4 for every Wan VAE).
    spatial_factor: the VAE's pixels per latent along each side (8; 16 for Wan 2.2 TI2V-5B's VAE).
    patch_size: (pt, ph, pw), latents per token along (F, Hl, Wl) ((1, 2, 2) for every Wan).
    latent_channels: C (16 for Wan 2.1 / 2.2 A14B, 48 for TI2V-5B).
    image_tokens: P, image tokens every cross-attention attends to beside the text: 0 without an
      image branch (text-to-video, TI2V), 257 for Wan 2.1 I2V (one CLIP frame), 514 for FLF2V (two).
    text_tokens: L, text tokens per prompt (Wan: 512).

  Raises:
    ValueError: a factor, patch side, channel or text count below 1, or negative image tokens.
  """
  temporal_factor: int
  spatial_factor: int
  patch_size: tuple[int, int, int]
  latent_channels: int
  image_tokens: int = 0
  text_tokens: int = 512

  def __post_init__(self):
    object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
    counts = (self.temporal_factor, self.spatial_factor, *self.patch_size, self.latent_channels, self.text_tokens)
    if len(self.patch_size) != 3 or min(counts) < 1 or self.image_tokens < 0:
      raise ValueError(f"{self.temporal_factor=}, {self.spatial_factor=}, {self.patch_size=} (three sides), "
                       f"{self.latent_channels=} and {self.text_tokens=} must be >= 1 and "
                       f"{self.image_tokens=} >= 0")

  def latent_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(F, Hl, Wl) of a video of `frames` (4k + 1) frames of height x width pixels."""
    return ((frames - 1) // self.temporal_factor + 1, height // self.spatial_factor, width // self.spatial_factor)

  def latent_tokens(self, grid: tuple[int, ...]) -> int:
    """T of a latent grid (F, Hl, Wl): each side over its patch side."""
    return math.prod(n // p for n, p in zip(grid, self.patch_size, strict=True))

  def video_tokens(self, frames: int, height: int, width: int) -> int:
    """T, the tokens of one video of `frames` x height x width (Wan 2.1, 81 x 480 x 832: 21 x 30 x 52
    = 32,760)."""
    return self.latent_tokens(self.latent_grid(frames, height, width))

  @property
  def context_tokens(self) -> int:
    """L + P: the keys of every cross-attention (text, then image)."""
    return self.text_tokens + self.image_tokens
