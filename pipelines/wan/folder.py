"""A diffusers-format Wan pipeline folder, read from its JSON files only (`PipelineIndex`)."""

from __future__ import annotations

import dataclasses
import os

from pipelines.storage import weights
from pipelines.wan.transformer_config import WanTransformerConfig


@dataclasses.dataclass(frozen=True)
class PipelineIndex:
  """What a diffusers Wan folder holds, read from its JSON files only (no weights).

  Attributes:
    folder: the pipeline folder.
    transformer: config of `transformer/`.
    has_transformer_2: `transformer_2/` is present and named in model_index.json.
    boundary_ratio: Wan 2.2 expert switch (None for Wan 2.1).
    expand_timesteps: one timestep per token (Wan 2.2 TI2V-5B; `wan.ti2v`).
  """
  folder: str
  transformer: WanTransformerConfig
  has_transformer_2: bool
  boundary_ratio: float | None
  expand_timesteps: bool = False

  @classmethod
  def read(cls, folder: str) -> PipelineIndex:
    """Reads model_index.json and transformer/config.json.

    Raises:
      weights.CheckpointError: no folder, no or invalid model_index.json, not a WanPipeline,
        `expand_timesteps` not a bool or with two experts, `boundary_ratio` without
        `transformer_2/` or outside (0, 1), a missing component folder.
    """
    path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(path):
      raise weights.CheckpointError(
          f"{folder!r} has no model_index.json; pass a diffusers-format Wan pipeline folder (holding "
          "model_index.json, transformer/, text_encoder/, tokenizer/, vae/, scheduler/)")
    index = weights.read_json(path, "a Wan pipeline folder needs model_index.json")
    name = index.get("_class_name", "WanPipeline")
    if name != "WanPipeline":
      raise weights.CheckpointError(f"{path!r}: {name=}; only text-to-video WanPipeline folders load")
    expand = index.get("expand_timesteps", False)
    if not isinstance(expand, bool):
      raise weights.CheckpointError(f"{path!r}: expand_timesteps={expand!r} must be true or false")
    for component in ("transformer", "text_encoder", "tokenizer", "vae", "scheduler"):
      if not os.path.isdir(os.path.join(folder, component)):
        raise weights.CheckpointError(f"{folder!r} has no {component}/ folder; a Wan pipeline needs it")
    named_2 = isinstance(index.get("transformer_2"), list) and index["transformer_2"][0] is not None
    has_2 = named_2 and os.path.isdir(os.path.join(folder, "transformer_2"))
    boundary = index.get("boundary_ratio")
    if boundary is not None:
      if not 0 < float(boundary) < 1:
        raise weights.CheckpointError(f"{path!r}: boundary_ratio={boundary} must be in (0, 1)")
      if not has_2:
        raise weights.CheckpointError(
            f"{path!r} sets boundary_ratio={boundary} (Wan 2.2 two experts) but {folder!r} has no "
            "transformer_2/ named in model_index.json; add the low-noise expert or drop boundary_ratio")
      boundary = float(boundary)
    if expand and boundary is not None:
      raise weights.CheckpointError(f"{path!r}: expand_timesteps (Wan 2.2 TI2V-5B, one transformer) with "
                                    f"boundary_ratio={boundary} (two experts) is no released Wan")
    config = WanTransformerConfig.from_dict(weights.read_config(os.path.join(folder, "transformer")))
    return cls(folder=folder, transformer=config, has_transformer_2=has_2, boundary_ratio=boundary,
               expand_timesteps=expand)

  @property
  def weight_folders(self) -> list[str]:
    """The component folders whose safetensors are loaded, in loading order."""
    names = ["transformer"] + (["transformer_2"] if self.boundary_ratio is not None else [])
    return [os.path.join(self.folder, n) for n in names + ["text_encoder", "vae"]]

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
