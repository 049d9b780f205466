"""A tiny diffusers `WanVACEPipeline` folder for the VACE tests: the embedded tiny default's text
encoder, tokenizer, VAE, scheduler and trained transformer, plus random VACE blocks at layers 0 and
2 (96 context channels), saved by diffusers' own `WanVACETransformer3DModel.save_pretrained`."""

from __future__ import annotations

import json
import os
import shutil

from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER
from tests.torch_weights import randomize


def build_vace_folder(root: str, *, boundary_ratio: float | None = None) -> str:
  """Writes the folder under `root` and returns `root`. With `boundary_ratio`, a two-expert folder as
  Wan 2.2 VACE-Fun A14B's: `transformer_2/` (the low-noise expert) is the same model with other
  random VACE blocks and output head, and the index names it and the boundary."""
  import diffusers

  for part in ("text_encoder", "tokenizer", "vae", "scheduler"):
    shutil.copytree(os.path.join(TINY_DEFAULT_FOLDER, part), os.path.join(root, part))
  base = diffusers.WanTransformer3DModel.from_pretrained(os.path.join(TINY_DEFAULT_FOLDER, "transformer"))
  config = {k: v for k, v in base.config.items() if not k.startswith("_")}
  model = diffusers.WanVACETransformer3DModel(**config, vace_layers=[0, 2], vace_in_channels=96)
  missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
  assert not unexpected and all(k.startswith("vace_") for k in missing)
  randomize(model.vace_blocks, seed=3, spread=0.5)
  randomize(model.vace_patch_embedding, seed=4, spread=0.5)
  model.save_pretrained(os.path.join(root, "transformer"), safe_serialization=True)
  if boundary_ratio is not None:
    randomize(model.vace_blocks, seed=5, spread=0.5)
    randomize(model.proj_out, seed=6, spread=0.5)
    model.save_pretrained(os.path.join(root, "transformer_2"), safe_serialization=True)
  with open(os.path.join(TINY_DEFAULT_FOLDER, "model_index.json")) as f:
    index = json.load(f)
  index.update(_class_name="WanVACEPipeline", transformer=["diffusers", "WanVACETransformer3DModel"])
  index.pop("expand_timesteps")
  if boundary_ratio is not None:
    index.update(transformer_2=["diffusers", "WanVACETransformer3DModel"], boundary_ratio=boundary_ratio)
  with open(os.path.join(root, "model_index.json"), "w") as f:
    json.dump(index, f)
  return root
