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
from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, PipelineIndex, inference, layouts
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
  """Without `config=` the random tiny's shapes are matched to its config (8 heads of 16 channels, not
  ComfyUI's one head of 128), `heads=` (an official config.json's num_heads) gives the same, and the
  scheduler is UniPC at flow shift 3 (Wan 2.1's)."""
  folder_config = PipelineIndex.read(single["folder"]).transformer
  matched = read_sources(_sources(single))
  assert matched.transformer_config == folder_config and folder_config.num_attention_heads == 8
  assert matched.vae_config == WanVAEConfig.from_diffusers(weights.read_config(os.path.join(single["folder"], "vae")))
  read = read_sources(_sources(single, heads=folder_config.num_attention_heads))
  assert read.transformer_config == folder_config
  assert read.scheduler_config == schedulers.UniPCConfig(flow_shift=3.0)


def test_the_trained_tiny_files_are_refused_without_config():
  """The trained tiny's own files as single files: its transformer's shapes are its config's (8 heads of
  16), its VAE's are both shipped tiny folders', whose latent statistics differ, so the files are
  refused rather than read with either's; with `config=` they read."""
  files = _tiny_default_files()
  transformer = layouts.read_component(files.transformer, "transformer")
  assert inference.transformer_config(transformer.shapes) == PipelineIndex.read(TINY_DEFAULT_FOLDER).transformer
  with pytest.raises(ValueError, match=r"diffusion_pytorch_model.safetensors': its shapes \(base_dim=4, .*\) are "
                                       r"the VAE of tiny_default and of tiny_i2v.*pass the model's config: --config "
                                       r"FOLDER \(CLI\) or config=FOLDER \(Python\)"):
    read_sources(files)
  assert read_sources(dataclasses.replace(files, config=TINY_DEFAULT_FOLDER)).transformer_config.dim == 128


def _tiny_default_files() -> Sources:
  return Sources(transformer=os.path.join(TINY_DEFAULT_FOLDER, "transformer", "diffusion_pytorch_model.safetensors"),
                 vae=os.path.join(TINY_DEFAULT_FOLDER, "vae", "diffusion_pytorch_model.safetensors"),
                 text_encoder=os.path.join(TINY_DEFAULT_FOLDER, "text_encoder", "model.safetensors"),
                 tokenizer=TINY_DEFAULT_FOLDER)


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
