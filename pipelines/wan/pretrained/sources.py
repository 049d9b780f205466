"""A pipeline's parts read from single files or an official Wan folder: the component files opened
and renamed (`layouts`), their configs (inferred, `inference`, or from `config=`), the scheduler and
the tokenizer; what `WanPipeline.from_single_file` loads and `convert` writes. Weights stay
memory-mapped."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pipelines.storage import weights
from pipelines.wan import schedulers
from pipelines.wan.encoders import TokenizerNotFoundError, load_tokenizer
from pipelines.wan.pretrained import inference, layouts
from pipelines.wan.transformer import WanTransformerConfig
from pipelines.wan.vae import WanVAEConfig

TOKENIZER_FIX = ("pass tokenizer= (--tokenizer) a local folder holding the google/umt5-xxl tokenizer (e.g. the "
                 "tokenizer/ folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or the google/umt5-xxl/ folder of the "
                 "official release)")


@dataclasses.dataclass(frozen=True)
class Sources:
  """Where a pipeline's parts come from.

  Attributes:
    transformer, vae, text_encoder: the component files (`layouts.read_component`); an official
      folder's transformer is the folder itself.
    tokenizer: a tokenizer folder, or a pipeline folder holding tokenizer/.
    config: None (configs matched by the shapes: `inference`) or a diffusers folder whose JSON files
      are read.
    heads: the transformer's heads when known (an official config.json's `num_heads`).
  """
  transformer: str
  vae: str
  text_encoder: str
  tokenizer: str | None
  config: str | None = None
  heads: int | None = None

  @classmethod
  def official(cls, folder: str) -> Sources:
    """The sources of a folder in the official Wan layout (`layouts.OfficialFolder`)."""
    found = layouts.OfficialFolder.read(folder)
    return cls(transformer=folder, vae=found.vae, text_encoder=found.text_encoder, tokenizer=found.tokenizer,
               heads=found.heads())


@dataclasses.dataclass(frozen=True)
class Components:
  """`Sources` read: the renamed component files, their configs, the scheduler and the tokenizer."""
  transformer: layouts.ComponentFile
  transformer_config: WanTransformerConfig
  vae: layouts.ComponentFile
  vae_config: WanVAEConfig
  text_encoder: layouts.ComponentFile
  text_encoder_config: Any
  scheduler_config: Any
  tokenizer: Any

  @property
  def expand_timesteps(self) -> bool:
    """Wan 2.2 TI2V-5B (48 latent channels in both transformer and VAE): one timestep per token."""
    return self.transformer_config.in_channels == 48 and self.vae_config.z_dim == 48


def tokenizer_of(path: str | None) -> Any:
  """The transformers tokenizer of a tokenizer folder, or of a pipeline folder's tokenizer/.

  Raises:
    TokenizerNotFoundError: None or not a folder (no UMT5 tokenizer ships with this package).
  """
  if path is None:
    raise TokenizerNotFoundError(f"tokenizer=None: no UMT5 tokenizer ships with this package; {TOKENIZER_FIX}")
  if not os.path.isdir(path):
    raise TokenizerNotFoundError(f"tokenizer={path!r} is not a folder; {TOKENIZER_FIX}")
  if os.path.isdir(os.path.join(path, "tokenizer")):
    return load_tokenizer(path)
  import transformers
  return transformers.AutoTokenizer.from_pretrained(path)


def _configs(sources: Sources, transformer: layouts.ComponentFile) -> tuple[WanTransformerConfig, Any, Any]:
  """(transformer config, VAE config or None (inferred when read), scheduler config)."""
  if sources.config is not None:
    folder = sources.config
    return (WanTransformerConfig.from_dict(weights.read_config(os.path.join(folder, "transformer"))),
            WanVAEConfig.from_diffusers(weights.read_config(os.path.join(folder, "vae"))),
            schedulers.scheduler_config_from_dict(weights.read_json(os.path.join(folder, "scheduler",
                                                                                  "scheduler_config.json"))))
  config = inference.transformer_config(transformer.shapes, transformer.path, heads=sources.heads)
  # diffusers' Wan folders: flow shift 3.0 (Wan 2.1), 5.0 for Wan 2.2 TI2V-5B (48 latent channels)
  return config, None, schedulers.UniPCConfig(flow_shift=5.0 if config.in_channels == 48 else 3.0)


def check_no_image_branch(read: Components) -> None:
  """Raises CheckpointError for a Wan 2.1 image-to-video transformer: its CLIP vision encoder does
  not load from a single file here."""
  if read.transformer_config.has_image_branch:
    raise weights.CheckpointError(
        f"{read.transformer.path!r} is a Wan 2.1 image-to-video transformer (CLIP image branch); its CLIP vision "
        "encoder does not load from a single file here: use a diffusers folder (WanImageToVideoPipeline."
        "from_pretrained, generate --model)")


def read_sources(sources: Sources) -> Components:
  """Opens every component (headers only) and settles every config, before any weight is read.

  Raises:
    weights.CheckpointError: a missing, truncated or foreign file, shapes that match no Wan config.
    TokenizerNotFoundError: no tokenizer folder.
  """
  transformer = (layouts.OfficialFolder.transformer_of(sources.transformer) if os.path.isdir(sources.transformer)
                 else layouts.read_component(sources.transformer, "transformer"))
  config, vae_config, scheduler_config = _configs(sources, transformer)
  vae = layouts.read_component(sources.vae, "vae", vae_config)
  text = layouts.read_component(sources.text_encoder, "text_encoder")
  tokenizer = tokenizer_of(sources.tokenizer)
  return Components(transformer=transformer, transformer_config=config, vae=vae,
                    vae_config=vae_config or inference.vae_config(vae.shapes, vae.path), text_encoder=text,
                    text_encoder_config=inference.umt5_config(text.shapes, text.path),
                    scheduler_config=scheduler_config, tokenizer=tokenizer)
