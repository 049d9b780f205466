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
| mlperf-wan22-t2v | Wan 2.2 A14B (2 x 40 layers)      | UMT5-XXL (24 layers)         | Wan 2.1 | MLPerf's (README)      |

Architectures: DESIGN.md section 6 (diffusers' Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers configs).
`mlperf-wan22-t2v` carries MLPerf Inference's text-to-video settings (`MLPERF_SOURCE`); on a CPU
backend it runs reduced (`reduced_for_cpu`) and its record says it is not comparable
(`mlperf_comparability`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from pipelines.wan.pretrained import TINY_TRANSFORMER
from pipelines.wan.transformer import PRESETS as TRANSFORMER_PRESETS, WanTransformerConfig
from pipelines.wan.encoders import UMT5_PRESETS, UMT5Config
from pipelines.wan.vae import VAE_PRESETS, WanVAEConfig

_UMT5_XXL_WIDTH = dataclasses.replace(UMT5_PRESETS["umt5-xxl"], vocab_size=384, num_layers=1)

MLPERF_PRESET = "mlperf-wan22-t2v"
MLPERF_REFERENCE = "MLPerf Inference v6.0 wan-2.2-t2v-a14b, SingleStream (90th-percentile latency per video, s)"
# mlcommons/inference text_to_video/wan-2.2-t2v-a14b/inference_config.yaml (commit b66003e1), read by its
# run_mlperf.py: diffusers WanPipeline.from_pretrained(Wan-AI/Wan2.2-T2V-A14B-Diffusers, boundary_ratio=...,
# bf16, VAE fp32), the negative prompt `.strip()`ped, and the same fixed initial latent
# (data/fixed_latent.pt) for every prompt.
MLPERF_SETTINGS = {
    "height": 720, "width": 1280, "num_frames": 81, "fps": 16, "sample_steps": 20, "seed": 42,
    "guidance_scale": 4.0, "guidance_scale_2": 3.0, "boundary_ratio": 0.875,
    "negative_prompt": (
        "vivid colors, overexposed, static, blurry details, subtitles, style,\n"
        "work of art, painting, picture, still, overall grayish, worst quality,\n"
        "low quality, JPEG artifacts, ugly, deformed, extra fingers, poorly drawn hands,\n"
        "poorly drawn face, deformed, disfigured, deformed limbs, fused fingers,\n"
        "static image, cluttered background, three legs, many people in the background,\n"
        "walking backwards"),
}
MLPERF_SOURCE = "mlcommons/inference text_to_video/wan-2.2-t2v-a14b/inference_config.yaml (commit b66003e1)"
# MLPerf keeps the folder's scheduler: diffusers' scripts/convert_wan_to_diffusers.py writes UniPC with
# flow_shift 3.0 for Wan2.2-T2V-A14B (Wan's own script samples at 12.0; pipelines/commands/presets.py).
MLPERF_FLOW_SHIFT = 3.0


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
    guidance_2: the low-noise expert's CFG scale (two experts), or None.
    boundary_ratio: None (one transformer) or Wan 2.2's expert switch ratio (two experts, random
      weights each).
    negative_prompt, seed: the preset's own (None: the command's defaults).
    reference: the published benchmark the preset's settings reproduce, or None.
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
  guidance_2: float | None = None
  boundary_ratio: float | None = None
  negative_prompt: str | None = None
  seed: int | None = None
  reference: str | None = None
  expand_timesteps: bool = False

  def __post_init__(self):
    if self.height % 16 or self.width % 16 or self.height < 16 or self.width < 16:
      raise ValueError(f"{self.height=} and {self.width=} must be positive multiples of 16")
    if self.frames < 1 or (self.frames - 1) % 4:
      raise ValueError(f"{self.frames=} must be 4k + 1")
    if self.steps < 1 or self.max_sequence_length < 1:
      raise ValueError(f"{self.steps=} and {self.max_sequence_length=} must be positive")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"{self.dtype=} must be 'float32' or 'bfloat16'")
    if self.boundary_ratio is not None and not 0 < self.boundary_ratio < 1:
      raise ValueError(f"{self.boundary_ratio=} must lie in (0, 1)")
    if self.guidance_2 is not None and self.boundary_ratio is None:
      raise ValueError(f"{self.guidance_2=} is the second expert's scale; it needs a boundary_ratio")
    if self.text_encoder.d_model != self.transformer.text_dim:
      raise ValueError(f"text encoder d_model={self.text_encoder.d_model} != transformer "
                       f"text_dim={self.transformer.text_dim}")

  @property
  def latent_shape(self) -> tuple[int, int, int, int, int]:
    """[1, C, F, Hl, Wl] of one video."""
    s = self.vae.spatial_factor
    return (1, self.transformer.out_channels, (self.frames - 1) // 4 + 1, self.height // s, self.width // s)

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
        transformer=TRANSFORMER_PRESETS["wan2.1-t2v-1.3b"], text_encoder=UMT5_PRESETS["umt5-xxl"],
        vae=VAE_PRESETS["wan2.1"], height=480, width=832,
        frames=81, steps=10, max_sequence_length=512, guidance=5.0, flow_shift=3.0, dtype="bfloat16",
        description="Wan 2.1 T2V 1.3B architecture, full-size UMT5-XXL, random weights, 480p x 81 frames "
                    "(accelerators)"),
    "wan2.2-ti2v-5b": BenchPreset(
        transformer=TRANSFORMER_PRESETS["wan2.2-ti2v-5b"], text_encoder=UMT5_PRESETS["umt5-xxl"],
        vae=VAE_PRESETS["wan2.2"], height=704, width=1280, frames=121, steps=50, max_sequence_length=512,
        guidance=5.0, flow_shift=5.0, dtype="bfloat16", expand_timesteps=True,
        description="Wan 2.2 TI2V-5B architecture (its own VAE), full-size UMT5-XXL, random weights, "
                    "704x1280 x 121 frames, text-to-video (accelerators)"),
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
    MLPERF_PRESET: BenchPreset(
        transformer=TRANSFORMER_PRESETS["wan2.2-t2v-a14b"], text_encoder=dataclasses.replace(
            UMT5_PRESETS["umt5-xxl"], vocab_size=384), vae=VAE_PRESETS["wan2.1"],
        height=MLPERF_SETTINGS["height"], width=MLPERF_SETTINGS["width"], frames=MLPERF_SETTINGS["num_frames"],
        steps=MLPERF_SETTINGS["sample_steps"], max_sequence_length=512, guidance=MLPERF_SETTINGS["guidance_scale"],
        guidance_2=MLPERF_SETTINGS["guidance_scale_2"], boundary_ratio=MLPERF_SETTINGS["boundary_ratio"],
        flow_shift=MLPERF_FLOW_SHIFT, dtype="bfloat16", negative_prompt=MLPERF_SETTINGS["negative_prompt"],
        seed=MLPERF_SETTINGS["seed"], reference=MLPERF_REFERENCE,
        description="MLPerf Inference v6.0 text-to-video (Wan 2.2 T2V A14B, two experts): random weights at "
                    "its settings; the warm run's total is its latency per video"),
}


def init_ours(preset: BenchPreset, seed: int = 0, vae_dtype: str = "float32"):
  """Our `WanPipeline` with random weights (torch-default init; drawn on the accelerator where there is
  one), no files; the VAE in `vae_dtype` (float32 as every pipeline's default)."""
  import jax
  import jax.numpy as jnp

  from end_to_end.bench import timed_runs
  from pipelines.pipeline import WanPipeline
  from pipelines.wan import schedulers, vae
  from pipelines.wan.encoders import default_tokenizer, init_umt5_params
  from pipelines.wan.transformer import init_transformer

  dtype = jnp.dtype(preset.dtype)
  experts = 1 if preset.boundary_ratio is None else 2
  clock = [time.perf_counter()]

  def timed(name, value):  # each part's seconds printed: a slow load says where it goes
    now = time.perf_counter()
    print(f"  random init: {name} {now - clock[0]:.1f} s (host peak {timed_runs.peak_host_gib()} GiB)", flush=True)
    clock[0] = now
    return value

  text_params = timed("text encoder", host_random_umt5(preset.text_encoder, seed, dtype)
                      if preset.text_encoder.num_layers > 2 else init_umt5_params(preset.text_encoder, seed, dtype=dtype))
  on_device = jax.default_backend() != "cpu"  # seconds there, where numpy takes a minute for 5 B values
  transformers = timed("transformer", [init_transformer(preset.transformer, seed + i, dtype, on_device=on_device)
                                       for i in range(experts)])
  return WanPipeline(
      tokenizer=default_tokenizer(), expand_timesteps=preset.expand_timesteps,
      text_encoder=(preset.text_encoder, text_params), transformers=transformers,
      vae=timed("VAE", jax.block_until_ready(vae.init_vae(preset.vae, jax.random.key(seed),
                                                          dtype=jnp.dtype(vae_dtype)))),
      boundary_ratio=preset.boundary_ratio,
      scheduler_config=schedulers.UniPCConfig(flow_shift=preset.flow_shift), name="random init")


def host_random_umt5(config, seed: int, dtype) -> dict:
  """Random UMT5 weights in host memory (numpy), with `init_umt5_params`' tree and stds, made on the
  host alone: each leaf repeats one block of `TILE` normal draws (its own) to its size, at memory
  speed (seconds for UMT5-XXL's 5.7 B values; drawing them on a TPU and copying them back took 98 s
  and the chip runtime's first-transfer set-up). The values are not a trained model's: timing
  depends on shapes only; a memory plan then uploads them for the encode or encodes on the host."""
  import jax
  import numpy as np

  from pipelines.wan.encoders import init_umt5_params

  c = config
  small = jax.eval_shape(lambda: init_umt5_params(dataclasses.replace(c, vocab_size=8, num_layers=1), seed,
                                                  dtype=dtype))
  rng = np.random.default_rng(seed)
  stds = {"q": (c.d_model * c.d_kv) ** -0.5, "o": (c.num_heads * c.d_kv) ** -0.5, "rel_bias": c.d_model ** -0.5, "embedding": 1.0}

  def leaf(path, struct):
    name = path[-1].key
    shape = ((c.vocab_size, c.d_model) if name == "embedding" else
             (c.num_layers, *struct.shape[1:]) if path[0].key == "layers" else struct.shape)
    if "norm" in name:
      return np.ones(shape, struct.dtype)
    out = np.empty(shape, struct.dtype)
    flat = out.reshape(-1)
    tile = (stds.get(name, shape[1] ** -0.5) * rng.standard_normal(min(flat.size, TILE), np.float32)).astype(struct.dtype)
    whole = flat.size // tile.size * tile.size
    flat[:whole].reshape(-1, tile.size)[:] = tile
    flat[whole:] = tile[:flat.size - whole]
    return out

  return jax.tree_util.tree_map_with_path(leaf, small)


TILE = 2 ** 22  # normal draws per `host_random_umt5` leaf, repeated to its size


# What `reduced_for_cpu` keeps of a preset meant for accelerators: one block per expert, one text
# encoder layer, a 5 x 64 x 112 video (2 x 8 x 14 latents, 56 tokens); widths, steps, guidance,
# expert switch and dtype unchanged.
CPU_REDUCTION = dict(layers=1, text_layers=1, frames=5, height=64, width=112)


def reduced_for_cpu(preset: BenchPreset) -> BenchPreset:
  """`preset` cut to `CPU_REDUCTION` (its description says so): the same code paths and layer
  widths in minutes on a CPU, at a size whose timings compare with nothing published."""
  r = CPU_REDUCTION
  return dataclasses.replace(
      preset, transformer=dataclasses.replace(preset.transformer, num_layers=r["layers"]),
      text_encoder=dataclasses.replace(preset.text_encoder, num_layers=r["text_layers"]),
      frames=r["frames"], height=r["height"], width=r["width"],
      description=(f"REDUCED for CPU ({r['layers']} of {preset.transformer.num_layers} blocks per expert, "
                   f"{r['text_layers']} of {preset.text_encoder.num_layers} text encoder layers, "
                   f"{r['frames']}x{r['height']}x{r['width']} instead of {preset.frames}x{preset.height}x"
                   f"{preset.width}); NOT comparable to published numbers. " + preset.description))


def mlperf_comparability(preset: BenchPreset, *, reduced: bool, changed: list[str], runs: int) -> dict[str, Any]:
  """Whether a run of `preset` gives a number comparable to `preset.reference` (its warm run's
  total against the published latency per video).

  Args:
    reduced: the preset was cut by `reduced_for_cpu`.
    changed: the command-line options that changed the preset's settings (e.g. ["--steps"]).
    runs: calls per pipeline (the comparable number is a warm run's).

  Returns:
    {"reference", "comparable" (bool), "reasons" (why not; empty when comparable)}.
  """
  reasons = []
  if reduced:
    reasons.append("reduced for CPU: " + ", ".join(f"{k} {v}" for k, v in CPU_REDUCTION.items()))
  if changed:
    reasons.append("settings changed by " + ", ".join(changed))
  if runs < 2:
    reasons.append("no warm run (--runs 1): the one run includes compiling")
  return dict(reference=preset.reference, comparable=not reasons, reasons=reasons)


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
