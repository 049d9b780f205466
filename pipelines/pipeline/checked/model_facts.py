"""What is known of a model before its weights load: `ModelFacts`, read from a folder's JSON files
(`from_folder`) or the embedded tiny models' configs. `GenerationRequest.build` checks a call against
them; the command line and the server read them before loading anything. How its videos become
tokens is `token_facts` (the planner's `parallel.token_facts.TokenFacts`, built here from the configs).

Glossary (DESIGN.md section 1): B' videos, C latent channels, F / Hl / Wl latent frames / height /
width, T video tokens.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import Any

from pipelines.parallel.token_facts import TokenFacts
from pipelines.wan import schedulers
from pipelines.wan.pretrained import GenerationDefaults
from pipelines.wan.transformer import WanTransformerConfig


@dataclasses.dataclass(frozen=True)
class ModelFacts:
  """What checking a request needs to know of the model, without its weights.

  Attributes:
    name: where the weights come from (folder path, "tiny" or "tiny-random").
    transformer: the experts' shared config (heads, patch, text_dim, in_channels).
    spatial_factor, temporal_factor: the VAE's compression (8 and 4 for Wan 2.1).
    boundary_ratio: None (one expert) or Wan 2.2's switch ratio (two experts).
    scheduler: the folder's scheduler config (`UniPCConfig`, `FlowEulerConfig` or `DPMSolverConfig`).
    max_sequence_length: the default text length L of calls.
    dtype: the transformer's dtype name ("float32" or "bfloat16").
    trained_video: (height, width, frames) when the weights know one video size only (the trained
      tiny default: 64 x 64 x 17); a request for another size warns. None: any size.
    quantize: the block weights' quantization (`wan.transformer.QUANTIZATION_MODES`), None: as loaded.
    image_to_video: the model is conditioned on an image (its transformer's input is noise, mask
      and condition latents: in_channels = 2 C + temporal_factor); its requests need `image`.
    expand_timesteps: one timestep per token (a Wan 2.2 TI2V folder's model_index.json
      `expand_timesteps`; `wan.conditioning.ti2v`).
    defaults: what a call leaves out (the folder's `generation_defaults.json`, else diffusers').
  """
  name: str
  transformer: WanTransformerConfig
  spatial_factor: int
  temporal_factor: int
  boundary_ratio: float | None
  scheduler: schedulers.SchedulerConfig
  max_sequence_length: int
  dtype: str
  trained_video: tuple[int, int, int] | None = None
  quantize: str | None = None
  expand_timesteps: bool = False
  image_to_video: bool = False
  defaults: GenerationDefaults = GenerationDefaults()

  def __post_init__(self):
    t = self.transformer
    want = 2 * t.out_channels + self.temporal_factor if self.image_to_video else t.out_channels
    if t.in_channels != want:
      kind = "image-to-video" if self.image_to_video else "text-to-video"
      raise ValueError(f"a {kind} transformer needs in_channels={want} (out_channels={t.out_channels}), got "
                       f"{t.in_channels}")
    context = 2 * t.out_channels + self.spatial_factor ** 2  # VACE: inactive + reactive latents, the pixel mask
    if t.has_vace and t.vace_in_channels != context:
      raise ValueError(f"a VACE transformer over this VAE needs vace_in_channels={context} (2 x {t.out_channels} "
                       f"latent channels + {self.spatial_factor}^2 mask channels), got {t.vace_in_channels}")

  @property
  def trained_frames(self) -> int | None:
    """The frames of the clips the model was trained on, or None (unknown: the random-weight tiny):
    the tiny default's 17, TI2V-5B's 121 (Wan2.2 configs/wan_ti2v_5B.py), else Wan's 81."""
    if self.trained_video is not None:
      return self.trained_video[2]
    return None if self.name == "tiny-random" else 121 if self.expand_timesteps else 81

  def fill(self, height: Any, width: Any, num_frames: Any, num_inference_steps: Any, guidance_scale: Any,
           guidance_scale_2: Any, *, custom_schedule: bool) -> tuple[Any, ...]:
    """A call's (height, width, num_frames, num_inference_steps, guidance_scale, guidance_scale_2)
    with each None taken from `defaults`: the steps only without a custom schedule (whose length is
    the count), the second scale only with the first (one given scale guides both experts). The
    context fuse's default is `window_inputs.check_context_windows`'."""
    d = self.defaults
    if guidance_scale is None:
      guidance_scale = d.guidance_scale
      if guidance_scale_2 is None and self.boundary_ratio is not None:
        guidance_scale_2 = d.guidance_scale_2
    if num_inference_steps is None and not custom_schedule:
      num_inference_steps = d.num_inference_steps
    return (d.height if height is None else height, d.width if width is None else width,
            d.num_frames if num_frames is None else num_frames, num_inference_steps, guidance_scale,
            guidance_scale_2)

  def warn_outside_world(self, prompts: Any) -> None:
    """Warns once for a call whose prompts the model's `GenerationDefaults.prompt_world` does not know."""
    world = self.defaults.prompt_world
    if world is not None and prompts and (note := world.outside(self.name, list(prompts))) is not None:
      warnings.warn(note, stacklevel=4)

  def outside_training(self, height: int, width: int, num_frames: int) -> str | None:
    """The warning for a size a one-size model (`trained_video`) was not trained at, or None."""
    if self.trained_video is None or (height, width, num_frames) == self.trained_video:
      return None
    h, w, f = self.trained_video
    return (f"the {self.name!r} model was trained at {w}x{h} x {f} frames only; {width}x{height} x {num_frames} "
            f"frames gives a video unlike its training (blotches, no shape): use {w}x{h} x {f} frames (a longer "
            f"video in context windows of that length: context_frames={f}), or a diffusers-format Wan folder for "
            "other sizes")

  @property
  def max_side(self) -> int:
    """The longest height or width in pixels the transformer can place: its RoPE table covers
    `rope_max_seq_len` token positions along each axis (diffusers' `WanRotaryPosEmbed`), a token being
    patch x VAE factor pixels a side (Wan 2.1: 1024 x 2 x 8 = 16384)."""
    return self.transformer.rope_max_seq_len * self.transformer.patch_size[1] * self.spatial_factor

  @property
  def max_clip_frames(self) -> int:
    """The longest clip (4k + 1 frames) the RoPE table covers along time (Wan 2.1: 1024 latent frames,
    4093 frames)."""
    return (self.transformer.rope_max_seq_len * self.transformer.patch_size[0] - 1) * self.temporal_factor + 1

  def check_reach(self, height: Any, width: Any, clip_frames: Any, clip_name: str = "num_frames") -> None:
    """Refuses a side or a clip longer than the transformer's RoPE table covers (`max_side`,
    `max_clip_frames`) before anything is allocated: the noise of a 100000x100000 video alone is tens
    of GiB. Only positive finite numbers are judged (the type and grid checks report the others).

    Raises:
      ValueError: naming the side (height / width) or the clip (`clip_name`), the limit, why, and the
        tokens and latents the video would take.
    """
    h, w, f = (_count(v) for v in (height, width, clip_frames))
    t = self.transformer
    cost = "" if None in (h, w, f) else self._cost(h, w, f)
    why = f"its transformer's RoPE table places at most {t.rope_max_seq_len} tokens along each axis"
    for name, value in (("height", h), ("width", w)):
      if value is not None and value > self.max_side:
        raise ValueError(f"{name}={value} is too large: {why}, a token being {t.patch_size[1]} x {self.spatial_factor} "
                         f"(patch x VAE factor) pixels, so height and width are at most {self.max_side} pixels{cost}; "
                         f"use a size within {self.max_side}x{self.max_side}")
    if f is not None and f > self.max_clip_frames:
      raise ValueError(f"{clip_name}={f} is too large: {why}, a latent frame being {self.temporal_factor} frames, so "
                       f"a clip is at most {self.max_clip_frames} frames{cost}; use at most {self.max_clip_frames} "
                       "(a longer video in context windows: context_frames)")

  def _cost(self, height: int, width: int, frames: int) -> str:
    """"; WxH x F frames would be T tokens and G GiB of latents per video" (float32 latents)."""
    grid = self.token_facts.latent_grid(frames, height, width)
    gib = 4 * self.transformer.out_channels * math.prod(grid) / 2 ** 30
    return (f"; {width}x{height} x {frames} frames would be {self.token_facts.latent_tokens(grid):,} tokens and "
            f"{gib:,.1f} GiB of latents per video")

  @classmethod
  def from_folder(cls, folder: str, dtype: str, name: str | None = None) -> ModelFacts:
    """The facts of a diffusers-format Wan folder from its JSON files (no weights read).

    Raises:
      weights.CheckpointError: a folder that is not a Wan pipeline, or unreadable configs.
    """
    import os

    from pipelines.storage import weights
    from pipelines.wan import encoders, pretrained, vae

    index = pretrained.PipelineIndex.read(folder)
    vae_config = vae.WanVAEConfig.from_diffusers(weights.read_config(os.path.join(folder, "vae")))
    scheduler = schedulers.scheduler_config_from_dict(weights.read_json(
        os.path.join(folder, "scheduler", "scheduler_config.json"), "the scheduler/ folder needs scheduler_config.json"))
    return cls(name=os.path.abspath(folder) if name is None else name, transformer=index.transformer,
               spatial_factor=vae_config.spatial_factor, temporal_factor=vae_config.temporal_factor,
               boundary_ratio=index.boundary_ratio, scheduler=scheduler,
               max_sequence_length=encoders.folder_text_length(folder), dtype=dtype,
               image_to_video=index.image_to_video,
               expand_timesteps=index.expand_timesteps, defaults=GenerationDefaults.read(folder))

  @classmethod
  def of_model(cls, model: str, dtype: str) -> ModelFacts:
    """The facts of `model`: "tiny", "tiny-i2v", "tiny-random" or a folder (`from_folder`)."""
    if model == "tiny-random":
      return cls.tiny_random(dtype)
    if model in ("tiny", "tiny-i2v"):
      return cls.tiny_default(dtype, image=model == "tiny-i2v")
    return cls.from_folder(model, dtype)

  @classmethod
  def from_components(cls, read: Any, dtype: str, name: str) -> ModelFacts:
    """The facts of single files read by `wan.pretrained.read_sources` (their headers and configs,
    no tensor data): what `WanPipeline.from_single_file` of the same sources will be.

    Args:
      read: the `wan.pretrained.Components`. name: the pipeline's name (the transformer's path).
    """
    from pipelines.wan import encoders

    return cls(name=name, transformer=read.transformer_config, spatial_factor=read.vae_config.spatial_factor,
               temporal_factor=read.vae_config.temporal_factor, boundary_ratio=None,
               scheduler=read.scheduler_config, dtype=dtype, expand_timesteps=read.expand_timesteps,
               max_sequence_length=encoders.text_length(getattr(read.tokenizer, "model_max_length", None)))

  @classmethod
  def tiny_default(cls, dtype: str, image: bool = False) -> ModelFacts:
    """The facts of the trained tiny default (`WanPipeline.tiny()`), which knows one video size;
    `image`: "tiny-i2v" (`WanPipeline.tiny(image=True)`: `TINY_I2V_FOLDER`, a TI2V folder)."""
    from pipelines.wan import pretrained

    folder = pretrained.TINY_I2V_FOLDER if image else pretrained.TINY_DEFAULT_FOLDER
    facts = cls.from_folder(folder, dtype, name="tiny-i2v" if image else "tiny")
    return dataclasses.replace(facts, trained_video=pretrained.TINY_TRAINED_VIDEO)

  @classmethod
  def tiny_random(cls, dtype: str) -> ModelFacts:
    """The facts of the random-weight tiny model (`WanPipeline.tiny(random=True)`)."""
    from pipelines.wan import encoders, pretrained, vae

    config = vae.VAE_PRESETS["tiny"]
    return cls(name="tiny-random", transformer=pretrained.TINY_TRANSFORMER, spatial_factor=config.spatial_factor,
               temporal_factor=config.temporal_factor, boundary_ratio=None, scheduler=pretrained.TINY_SCHEDULER,
               max_sequence_length=encoders.WAN_TEXT_LENGTH, dtype=dtype)

  @property
  def experts(self) -> int:
    return 1 if self.boundary_ratio is None else 2

  @property
  def token_facts(self) -> TokenFacts:
    """How this model's videos become tokens (`token_facts`), L its default text length."""
    return token_facts(self.transformer, spatial_factor=self.spatial_factor, temporal_factor=self.temporal_factor,
                       text_tokens=self.max_sequence_length)

  def latent_shape(self, batch: int, height: int, width: int, num_frames: int) -> tuple[int, ...]:
    """[B, C, F, Hl, Wl] for a video of `num_frames` (4k + 1) x height x width."""
    return (batch, self.transformer.out_channels, *self.token_facts.latent_grid(num_frames, height, width))

  def tokens(self, latent_shape: tuple[int, ...]) -> int:
    """T, the video tokens of one video: the latent grid over the patch size."""
    return self.token_facts.latent_tokens(latent_shape[2:])


def image_tokens(transformer: WanTransformerConfig) -> int:
  """P, the image tokens every cross-attention attends to beside the text: 0 without an image branch;
  FLF2V's `pos_embed_seq_len` (two CLIP frames, 514); else one CLIP frame's (Wan 2.1 I2V: Wan's
  ViT-H/14 at 224, `CLIPVisionConfig().tokens` = 16 x 16 + 1 = 257)."""
  if not transformer.has_image_branch:
    return 0
  if transformer.pos_embed_seq_len is not None:
    return transformer.pos_embed_seq_len
  from pipelines.wan.encoders import CLIPVisionConfig

  return CLIPVisionConfig().tokens


def token_facts(transformer: WanTransformerConfig, *, spatial_factor: int, temporal_factor: int,
                text_tokens: int) -> TokenFacts:
  """The `TokenFacts` of a model from its configs: the transformer's patch, latent channels and image
  tokens (`image_tokens`), the VAE's factors (`WanVAEConfig.spatial_factor` / `temporal_factor`), L.

  Raises:
    ValueError: a count out of range (`TokenFacts`).
  """
  return TokenFacts(temporal_factor=temporal_factor, spatial_factor=spatial_factor,
                    patch_size=transformer.patch_size, latent_channels=transformer.out_channels,
                    image_tokens=image_tokens(transformer), text_tokens=text_tokens)


def _count(value: Any) -> int | None:
  """A positive finite real number as an int, else None (left to the type and range checks)."""
  real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 1
  return int(value) if real else None
