"""`wan.transformer.original_names`: the original Wan names of every key, checked against diffusers'
own converter (`convert_wan_transformer_to_diffusers`, an independent reference) at real sizes."""

import pytest

from pipelines.wan.transformer import PRESETS, checkpoint_layout, diffusers_key, wan_key


@pytest.mark.parametrize("name", ["wan2.1-t2v-14b", "wan2.1-i2v-14b", "wan2.1-vace-1.3b"])
def test_diffusers_converter_agrees(name):
  from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

  keys = [key for key, *_ in checkpoint_layout(PRESETS[name])]
  original = {"model.diffusion_model." + wan_key(k): k for k in keys}
  converted = convert_wan_transformer_to_diffusers(dict(original))
  assert len(converted) == len(keys) and all(converted[k] == k for k in keys)
  assert all(diffusers_key(wan_key(k)) == k for k in keys)


def test_names():
  assert wan_key("blocks.3.attn1.to_out.0.weight") == "blocks.3.self_attn.o.weight"
  assert wan_key("blocks.3.norm2.bias") == "blocks.3.norm3.bias"  # Wan's affine norm3
  assert wan_key("scale_shift_table") == "head.modulation"
  # FLF2V's image positions: diffusers' single-file converter has no rule, its convert script does
  assert wan_key("condition_embedder.image_embedder.pos_embed") == "img_emb.emb_pos"
  assert diffusers_key("blocks.0.modulation") == "blocks.0.scale_shift_table"
  assert diffusers_key("blocks.0.self_attn.nothing.weight") is None and wan_key("no.such") is None
