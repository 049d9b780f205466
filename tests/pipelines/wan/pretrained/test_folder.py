"""`PipelineIndex` (pipelines/wan/pretrained/folder.py): what a diffusers Wan folder holds, from its
JSON files only, and each refusal naming the folder and the fix. Folders are the embedded tiny
default's JSON layout (weights linked, never read), edited per case."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pipelines.storage.weights import CheckpointError
from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, TINY_TRANSFORMER, PipelineIndex


def _folder(tmp_path, **index_changes) -> str:
  """A copy of the tiny default's layout (weights as links) with model_index.json edited."""
  folder = tmp_path / "wan"
  shutil.copytree(TINY_DEFAULT_FOLDER, folder, copy_function=os.symlink)
  index = json.loads((folder / "model_index.json").read_text())
  (folder / "model_index.json").unlink()
  (folder / "model_index.json").write_text(json.dumps({**index, **index_changes}))
  return str(folder)


def test_tiny_default_is_one_text_to_video_expert():
  index = PipelineIndex.read(TINY_DEFAULT_FOLDER)
  assert index.experts == ("transformer",) and index.boundary_ratio is None and not index.has_transformer_2
  assert not index.image_to_video and not index.expand_timesteps and not index.image_encoder
  assert index.transformer.num_attention_heads == TINY_TRANSFORMER.num_attention_heads
  assert [os.path.basename(p) for p in index.weight_folders] == ["transformer", "text_encoder", "vae"]
  index.check_weights()  # headers of the shipped safetensors read


def test_two_experts_and_their_boundary(tmp_path):
  folder = _folder(tmp_path, boundary_ratio=0.875, transformer_2=["diffusers", "WanTransformer3DModel"])
  os.symlink(os.path.join(TINY_DEFAULT_FOLDER, "transformer"), os.path.join(folder, "transformer_2"))
  index = PipelineIndex.read(folder)
  assert index.experts == ("transformer", "transformer_2") and index.boundary_ratio == 0.875


@pytest.mark.parametrize("changes,message", [
    ({"_class_name": "StableDiffusionPipeline"},
     r"name='StableDiffusionPipeline'; only \['WanImageToVideoPipeline', 'WanPipeline', 'WanVACEPipeline', "
     r"'WanVideoToVideoPipeline'\] folders load"),
    ({"expand_timesteps": "yes"}, r"expand_timesteps='yes' must be true or false"),
    ({"boundary_ratio": 0.875}, r"boundary_ratio"),
    ({"expand_timesteps": True, "boundary_ratio": 0.9, "transformer_2": ["diffusers", "WanTransformer3DModel"]},
     r"no released Wan|boundary_ratio"),
])
def test_refusals_name_the_folder_and_the_fix(tmp_path, changes, message):
  with pytest.raises(CheckpointError, match=message):
    PipelineIndex.read(_folder(tmp_path, **changes))


def test_missing_index_or_component(tmp_path):
  with pytest.raises(CheckpointError, match="has no model_index.json; pass a diffusers-format Wan pipeline"):
    PipelineIndex.read(str(tmp_path))
  folder = _folder(tmp_path)
  shutil.rmtree(os.path.join(folder, "vae"))
  with pytest.raises(CheckpointError, match=r"has no vae/ folder"):
    PipelineIndex.read(folder)


def test_truncated_weights_are_named(tmp_path):
  folder = tmp_path / "wan"
  shutil.copytree(TINY_DEFAULT_FOLDER, folder)
  path = folder / "vae" / "diffusion_pytorch_model.safetensors"
  path.write_bytes(path.read_bytes()[:100])
  index = PipelineIndex.read(str(folder))  # JSON only: still reads
  with pytest.raises(CheckpointError, match=r"truncated or corrupt safetensors file.*download or convert it again"):
    index.check_weights()
