"""Tests for pipelines/wan/transformer/config.py: a diffusers `config.json` read back and round-tripped,
and the image branch's fields checked (reference: the config diffusers saves, diffusers_folders.py)."""

from __future__ import annotations

import json
import os

import pytest

from pipelines.wan.transformer import WanTransformerConfig
from tests.pipelines.wan.transformer.diffusers_folders import _folder

pytestmark = pytest.mark.numerics  # .ci/run: once more under XLA_FLAGS=--xla_cpu_max_isa=AVX2


def test_config_round_trip_and_checks_image_fields():
  folder = _folder("n2h12")
  with open(os.path.join(folder, "config.json")) as f:
    raw = json.load(f)
  config = WanTransformerConfig.from_dict(raw)
  assert config.num_attention_heads == 2 and config.dim == 24 and config.patch_size == (1, 2, 2)
  assert WanTransformerConfig.from_dict(config.to_dict()) == config
  # The image branch (Wan 2.1 I2V): image_dim and added_kv_proj_dim (= D).
  image = WanTransformerConfig.from_dict({**raw, "image_dim": 1280, "added_kv_proj_dim": 24})
  assert image.has_image_branch and WanTransformerConfig.from_dict(image.to_dict()) == image
  # image_dim alone (diffusers' own I2V test model): the image tokens join the text context
  context = WanTransformerConfig.from_dict({**raw, "image_dim": 1280})
  assert context.has_image_branch and context.image_in_context and not image.image_in_context
  with pytest.raises(ValueError, match="needs image_dim"):
    WanTransformerConfig.from_dict({**raw, "added_kv_proj_dim": 24})
  with pytest.raises(ValueError, match="must equal D=24"):
    WanTransformerConfig.from_dict({**raw, "image_dim": 1280, "added_kv_proj_dim": 5120})
  with pytest.raises(ValueError, match="attention_head_dim"):
    WanTransformerConfig(attention_head_dim=7)
