"""Benchmark presets: model architectures (random weights) and run settings, and how to build them.

Every preset is a full Wan 2.1 T2V pipeline: transformer, UMT5 text encoder, Wan 2.1 VAE, flow
UniPC. Weights are random (nothing is downloaded): timings depend on shapes, not on values. The
tokenizer is ByT5's byte tokenizer (no files), so every text encoder has 384 token ids (the real
UMT5-XXL has 256,384; only the embedding table differs, which costs a gather, not FLOPs).

| preset        | transformer                          | text encoder                 | VAE     | default run            |
|---------------|--------------------------------------|------------------------------|---------|------------------------|
| tiny          | pipeline's tiny (8 x 16, 2 layers)   | tiny UMT5 (d 32, 2 layers)   | tiny    | 9 x 48 x 80, 3 steps   |
| 1.3b-width    | Wan 1.3B block (D 1536, N 12, E 8960), 2 layers | UMT5-XXL width (d 4096), 1 layer | Wan 2.1 | 17 x 128 x 128, 3 steps |
| wan2.1-1.3b   | Wan 2.1 1.3B (30 layers)             | UMT5-XXL (24 layers)         | Wan 2.1 | 81 x 480 x 832, bf16   |
| wan2.1-14b    | Wan 2.1 14B (40 layers)              | UMT5-XXL (24 layers)         | Wan 2.1 | 81 x 720 x 1280, bf16  |

Architectures: DESIGN.md section 6 (diffusers' Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers configs).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pipelines.wan.tiny import TINY_TRANSFORMER
from pipelines.wan.transformer_config import PRESETS as TRANSFORMER_PRESETS, WanTransformerConfig
from pipelines.wan.umt5 import PRESETS as UMT5_PRESETS, UMT5Config
from pipelines.wan.vae import VAE_PRESETS, WanVAEConfig

_UMT5_XXL_WIDTH = dataclasses.replace(UMT5_PRESETS["umt5-xxl"], vocab_size=384, num_layers=1)


@dataclasses.dataclass(frozen=True)
class BenchPreset:
  """One benchmark configuration.

  Attributes:
    transformer, text_encoder, vae: architectures (random weights).
    height, width, frames: video size (multiples of 16; 4k + 1 frames).
    steps: denoising steps.
    max_sequence_length: L, text tokens.
    guidance: CFG scale (> 1: cond and uncond every step).
    flow_shift: UniPC flow shift (Wan 2.1: 3.0 at 480p, 5.0 at 720p).
    dtype: "float32" or "bfloat16" for transformer and text encoder (the VAE stays float32).
    description: one line for the report.
  """
  transformer: WanTransformerConfig
  text_encoder: UMT5Config
  vae: WanVAEConfig
  height: int
  width: int
  frames: int
  steps: int
  max_sequence_length: int
  guidance: float
  flow_shift: float
  dtype: str
  description: str

  def __post_init__(self):
    if self.height % 16 or self.width % 16 or self.height < 16 or self.width < 16:
      raise ValueError(f"{self.height=} and {self.width=} must be positive multiples of 16")
    if self.frames < 1 or (self.frames - 1) % 4:
      raise ValueError(f"{self.frames=} must be 4k + 1")
    if self.steps < 1 or self.max_sequence_length < 1:
      raise ValueError(f"{self.steps=} and {self.max_sequence_length=} must be positive")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"{self.dtype=} must be 'float32' or 'bfloat16'")
    if self.text_encoder.d_model != self.transformer.text_dim:
      raise ValueError(f"text encoder d_model={self.text_encoder.d_model} != transformer "
                       f"text_dim={self.transformer.text_dim}")

  @property
  def latent_shape(self) -> tuple[int, int, int, int, int]:
    """[1, C, F, Hl, Wl] of one video."""
    return (1, self.transformer.in_channels, (self.frames - 1) // 4 + 1, self.height // 8, self.width // 8)

  @property
  def tokens(self) -> int:
    """T, video tokens per video."""
    _, _, f, h, w = self.latent_shape
    pt, ph, pw = self.transformer.patch_size
    return (f // pt) * (h // ph) * (w // pw)


PRESETS: dict[str, BenchPreset] = {
    "tiny": BenchPreset(
        transformer=TINY_TRANSFORMER, text_encoder=UMT5_PRESETS["tiny"], vae=VAE_PRESETS["tiny"],
        height=48, width=80, frames=9, steps=3, max_sequence_length=64, guidance=5.0, flow_shift=3.0,
        dtype="float32", description="the pipeline's tiny model: every code path, seconds on CPU"),
    "1.3b-width": BenchPreset(
        transformer=dataclasses.replace(TRANSFORMER_PRESETS["wan2.1-t2v-1.3b"], num_layers=2),
        text_encoder=_UMT5_XXL_WIDTH, vae=VAE_PRESETS["wan2.1"], height=128, width=128, frames=17,
        steps=3, max_sequence_length=512, guidance=5.0, flow_shift=3.0, dtype="float32",
        description="Wan 1.3B layer width (2 of 30 blocks), UMT5-XXL width (1 of 24 layers), real VAE; CPU-sized"),
    "wan2.1-1.3b": BenchPreset(
        transformer=TRANSFORMER_PRESETS["wan2.1-t2v-1.3b"], text_encoder=dataclasses.replace(
            UMT5_PRESETS["umt5-xxl"], vocab_size=384), vae=VAE_PRESETS["wan2.1"], height=480, width=832,
        frames=81, steps=10, max_sequence_length=512, guidance=5.0, flow_shift=3.0, dtype="bfloat16",
        description="Wan 2.1 T2V 1.3B architecture, random weights, 480p x 81 frames (accelerators)"),
    "wan2.1-1.3b-step": BenchPreset(
        transformer=TRANSFORMER_PRESETS["wan2.1-t2v-1.3b"], text_encoder=_UMT5_XXL_WIDTH, vae=VAE_PRESETS["wan2.1"],
        height=480, width=832, frames=81, steps=3, max_sequence_length=512, guidance=5.0, flow_shift=3.0,
        dtype="bfloat16",
        description="Wan 2.1 T2V 1.3B transformer (all 30 blocks) at 480p x 81 frames, UMT5-XXL width with 1 "
                    "of 24 layers (the text encoder runs once, not per step): the per-step comparison in minutes"),
    "wan2.1-14b": BenchPreset(
        transformer=TRANSFORMER_PRESETS["wan2.1-t2v-14b"], text_encoder=dataclasses.replace(
            UMT5_PRESETS["umt5-xxl"], vocab_size=384), vae=VAE_PRESETS["wan2.1"], height=720, width=1280,
        frames=81, steps=10, max_sequence_length=512, guidance=5.0, flow_shift=5.0, dtype="bfloat16",
        description="Wan 2.1 T2V 14B architecture, random weights, 720p x 81 frames (accelerators)"),
}


def init_ours(preset: BenchPreset, seed: int = 0):
  """Our `WanPipeline` with random weights (torch-default init, host-drawn), no files."""
  import jax
  import jax.numpy as jnp

  from pipelines.pipeline import WanPipeline
  from pipelines.wan import schedulers, tokenizer, umt5, vae
  from pipelines.wan.transformer import init_transformer

  dtype = jnp.dtype(preset.dtype)
  return WanPipeline(
      tokenizer=tokenizer.default_tokenizer(),
      text_encoder=(preset.text_encoder, umt5.init_umt5_params(preset.text_encoder, seed, dtype=dtype)),
      transformers=[init_transformer(preset.transformer, seed, dtype)],
      vae=vae.init_vae(preset.vae, jax.random.key(seed)),
      scheduler_config=schedulers.UniPCConfig(flow_shift=preset.flow_shift), name="random init")


def save_diffusers_pipeline(preset: BenchPreset, folder: str, seed: int = 0) -> None:
  """Builds diffusers' `WanPipeline` with random weights (torch's default init, `torch.manual_seed
  (seed)`) and writes it with `save_pretrained` (safetensors), for both pipelines to load.

  The transformer and text encoder are stored in the preset dtype (half the disk for bf16; both
  loaders read the very same stored values), the VAE in float32.

  Raises:
    FileExistsError: `folder` exists and is not empty.
  """
  import diffusers
  import torch
  import transformers

  if os.path.isdir(folder) and os.listdir(folder):
    raise FileExistsError(f"{folder=} is not empty; give a new folder for the random pipeline")
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[preset.dtype]
  torch.manual_seed(seed)
  transformer = diffusers.WanTransformer3DModel(**preset.transformer.to_dict())
  text_encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(**dataclasses.asdict(preset.text_encoder)))
  if torch_dtype != torch.float32:
    # diffusers warns about its keep-in-fp32 modules here; both loaders read the same stored values.
    transformer, text_encoder = transformer.to(torch_dtype), text_encoder.to(torch_dtype)
  vae = diffusers.AutoencoderKLWan(**_vae_kwargs(preset.vae))
  scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                flow_shift=preset.flow_shift, num_train_timesteps=1000)
  pipe = diffusers.WanPipeline(tokenizer=transformers.ByT5Tokenizer(), text_encoder=text_encoder,
                               transformer=transformer, vae=vae, scheduler=scheduler)
  pipe.save_pretrained(folder, safe_serialization=True)


def check_saved_pipeline(preset: BenchPreset, folder: str) -> None:
  """Raises ValueError unless `folder`'s transformer and text encoder configs are the preset's
  (a reused --folder must hold the architecture being benchmarked)."""
  from pipelines.storage import weights

  saved = WanTransformerConfig.from_dict(weights.read_config(os.path.join(folder, "transformer")))
  text = UMT5Config.from_dict(weights.read_config(os.path.join(folder, "text_encoder")))
  if saved != preset.transformer or text != preset.text_encoder:
    raise ValueError(f"{folder=} holds another architecture (transformer {saved}, text encoder {text}) "
                     f"than the preset; remove it or pass a new --folder")


def _vae_kwargs(config: WanVAEConfig) -> dict[str, Any]:
  return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
