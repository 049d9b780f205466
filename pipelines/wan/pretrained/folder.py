"""A diffusers-format Wan pipeline folder, read from its JSON files only (`PipelineIndex`)."""

from __future__ import annotations

import dataclasses
import os

from pipelines.storage import weights
from pipelines.wan.transformer import WanTransformerConfig


# model_index.json `_class_name`s that load, and whether each is image-to-video.
# model_index.json `_class_name`s that load, and whether the folder is image-to-video (channel-conditioned).
# A VACE folder is known by its transformer (`vace_layers`), a video-to-video one is a text-to-video model.
PIPELINE_CLASSES = {"WanPipeline": False, "WanImageToVideoPipeline": True, "WanVACEPipeline": False,
                    "WanVideoToVideoPipeline": False}


@dataclasses.dataclass(frozen=True)
class PipelineIndex:
  """What a diffusers Wan folder holds, read from its JSON files only (no weights).

  Attributes:
    folder: the pipeline folder.
    transformer: config of the first expert's folder.
    has_transformer_2: `transformer_2/` is present and named in model_index.json.
    boundary_ratio: Wan 2.2 expert switch (None for one expert).
    experts: the expert folders loaded, in order: ("transformer",), ("transformer", "transformer_2")
      or, for a Wan 2.2 folder saved with `boundary_ratio` 1.0 (every step is the low-noise
      expert's; diffusers' tests save such folders without `transformer/`), ("transformer_2",).
    image_to_video: `_class_name` is WanImageToVideoPipeline and not a TI2V folder (the channel-
      conditioned models).
    image_encoder: `image_encoder/` and `image_processor/` are present and named (Wan 2.1 I2V / FLF2V).
    expand_timesteps: one timestep per token (Wan 2.2 TI2V-5B; `wan.conditioning.ti2v`).
  """
  folder: str
  transformer: WanTransformerConfig
  has_transformer_2: bool
  boundary_ratio: float | None
  experts: tuple[str, ...] = ("transformer",)
  image_to_video: bool = False
  image_encoder: bool = False
  expand_timesteps: bool = False

  @classmethod
  def read(cls, folder: str) -> PipelineIndex:
    """Reads model_index.json and the first expert's config.json.

    Raises:
      weights.CheckpointError: no folder, no or invalid model_index.json, not a WanPipeline /
        WanImageToVideoPipeline, `expand_timesteps` not a bool or with two experts, `boundary_ratio` without
        `transformer_2/` or outside (0, 1], a missing component folder, an image branch without
        `image_encoder/` and `image_processor/`.
    """
    path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(path):
      raise weights.CheckpointError(
          f"{folder!r} has no model_index.json; pass a diffusers-format Wan pipeline folder (holding "
          "model_index.json, transformer/, text_encoder/, tokenizer/, vae/, scheduler/)")
    index = weights.read_json(path, "a Wan pipeline folder needs model_index.json")
    name = index.get("_class_name", "WanPipeline")
    if name not in PIPELINE_CLASSES:
      raise weights.CheckpointError(f"{path!r}: {name=}; only {sorted(PIPELINE_CLASSES)} folders load")
    expand = index.get("expand_timesteps", False)
    if not isinstance(expand, bool):
      raise weights.CheckpointError(f"{path!r}: expand_timesteps={expand!r} must be true or false")
    for component in ("text_encoder", "tokenizer", "vae", "scheduler"):
      if not os.path.isdir(os.path.join(folder, component)):
        raise weights.CheckpointError(f"{folder!r} has no {component}/ folder; a Wan pipeline needs it")
    present = {c for c in ("transformer", "transformer_2", "image_encoder", "image_processor")
               if isinstance(index.get(c), list) and index[c][0] is not None
               and os.path.isdir(os.path.join(folder, c))}
    boundary, experts = _experts(path, folder, index.get("boundary_ratio"), present)
    if expand and boundary is not None:
      raise weights.CheckpointError(f"{path!r}: expand_timesteps (Wan 2.2 TI2V-5B, one transformer) with "
                                    f"boundary_ratio={boundary} (two experts) is no released Wan")
    config = WanTransformerConfig.from_dict(weights.read_config(os.path.join(folder, experts[0])))
    encoder = {"image_encoder", "image_processor"} <= present
    if config.has_image_branch and not encoder:
      raise weights.CheckpointError(
          f"{folder!r}: the transformer has an image branch (image_dim={config.image_dim}) but the folder "
          "has no image_encoder/ and image_processor/ named in model_index.json; add them (the CLIP "
          "vision model and its CLIPImageProcessor)")
    return cls(folder=folder, transformer=config, has_transformer_2="transformer_2" in present,
               boundary_ratio=boundary, experts=experts, image_to_video=PIPELINE_CLASSES[name] and not expand,
               image_encoder=encoder and config.has_image_branch, expand_timesteps=expand)

  @property
  def weight_folders(self) -> list[str]:
    """The component folders whose safetensors are loaded, in loading order."""
    names = [*self.experts, "text_encoder", "vae"] + (["image_encoder"] if self.image_encoder else [])
    return [os.path.join(self.folder, n) for n in names]

  def check_weights(self) -> None:
    """File-level checks of every weight file, reading headers only (no tensor data): safetensors
    present (pickle-only folders refused) and not truncated or corrupt. Key names and shapes are
    checked when a component loads (`weights.check_state_dict`).

    Raises:
      weights.CheckpointError: the first bad folder or file, naming it.
    """
    from safetensors import SafetensorError, safe_open

    for component in self.weight_folders:
      for path in weights.safetensors_files(component):
        try:
          with safe_open(path, framework="numpy"):
            pass
        except (SafetensorError, OSError) as e:
          raise weights.CheckpointError(
              f"cannot read {path!r} (truncated or corrupt safetensors file: {e}); download or "
              "convert it again") from e


def _experts(path: str, folder: str, boundary, present: set[str]) -> tuple[float | None, tuple[str, ...]]:
  """(boundary_ratio, expert folders) of a model_index.json (see `PipelineIndex.experts`)."""
  if boundary is None:
    if "transformer" not in present:
      raise weights.CheckpointError(f"{folder!r} has no transformer/ folder named in model_index.json; a Wan "
                                    "pipeline needs it")
    return None, ("transformer",)
  if not 0 < float(boundary) <= 1:
    raise weights.CheckpointError(f"{path!r}: boundary_ratio={boundary} must be in (0, 1]")
  if "transformer_2" not in present:
    raise weights.CheckpointError(
        f"{path!r} sets boundary_ratio={boundary} (Wan 2.2 two experts) but {folder!r} has no "
        "transformer_2/ named in model_index.json; add the low-noise expert or drop boundary_ratio")
  if float(boundary) == 1.0:  # t < 1000 at every step: only the low-noise expert runs
    return None, ("transformer_2",)
  if "transformer" not in present:
    raise weights.CheckpointError(f"{folder!r} has no transformer/ folder named in model_index.json, needed "
                                  f"below boundary_ratio={boundary}")
  return float(boundary), ("transformer", "transformer_2")
