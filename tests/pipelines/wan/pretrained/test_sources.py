"""pipelines/wan/pretrained/sources.py: single files read into a pipeline's components before any
weight is read: configs from `config=` or from the shapes (with an official folder's heads), the
scheduler's flow shift, the tokenizer's errors, and the refused Wan 2.1 image branch."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pipelines.pipeline import WanPipeline
from pipelines.storage import weights
from pipelines.wan import schedulers
from pipelines.wan.encoders import TokenizerNotFoundError
from pipelines.wan.pretrained import PipelineIndex
from pipelines.wan.pretrained.sources import Sources, check_no_image_branch, read_sources, tokenizer_of
from pipelines.wan.transformer import WanTransformerConfig
from pipelines.wan.vae import WanVAEConfig
from tests.pipelines.wan.pretrained import writers


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  return writers.write_single_files(WanPipeline.tiny(random=True), str(tmp_path_factory.mktemp("sources")))


def _sources(single, **kw) -> Sources:
  return Sources(transformer=single["transformer"], vae=single["vae"], text_encoder=single["text_encoder"],
                 tokenizer=single["folder"], **kw)


def test_config_folder_gives_the_folders_configs(single):
  """With `config=`, the transformer, VAE and scheduler configs are the diffusers folder's own."""
  read = read_sources(_sources(single, config=single["folder"]))
  folder = single["folder"]
  assert read.transformer_config == PipelineIndex.read(folder).transformer
  assert read.vae_config == WanVAEConfig.from_diffusers(weights.read_config(os.path.join(folder, "vae")))
  assert read.transformer.path == single["transformer"] and not read.expand_timesteps
  assert read.tokenizer is not None


def test_shapes_give_the_config_with_heads_from_the_official_config(single):
  """Without `config=` the shapes give the layout with head dim 128 (ComfyUI's rule: the tiny model's
  128 channels read as 1 head), `heads=` (an official config.json's num_heads) sets them, and the
  scheduler is UniPC at flow shift 3 (Wan 2.1's)."""
  folder_config = PipelineIndex.read(single["folder"]).transformer
  guessed = read_sources(_sources(single)).transformer_config
  assert (guessed.num_attention_heads, guessed.attention_head_dim) == (1, folder_config.dim)
  read = read_sources(_sources(single, heads=folder_config.num_attention_heads))
  assert read.transformer_config == folder_config
  assert read.scheduler_config == schedulers.UniPCConfig(flow_shift=3.0)


def test_tokenizer_errors_name_the_fix(tmp_path):
  for path, words in ((None, "tokenizer=None"), (str(tmp_path / "nowhere"), "is not a folder")):
    with pytest.raises(TokenizerNotFoundError, match=words) as refused:
      tokenizer_of(path)
    assert "google/umt5-xxl" in str(refused.value)


def test_a_wan21_image_branch_is_refused_naming_the_fix(single):
  read = read_sources(_sources(single, config=single["folder"]))
  check_no_image_branch(read)  # the control: text-to-video passes
  image = dataclasses.replace(read, transformer_config=dataclasses.replace(read.transformer_config, image_dim=1280))
  assert isinstance(image.transformer_config, WanTransformerConfig)
  with pytest.raises(weights.CheckpointError, match="image-to-video transformer.*diffusers folder"):
    check_no_image_branch(image)
