"""`wan.pretrained.inference`: configs from shape-only state dicts at the real sizes of the released
Wan models (nothing allocated, no downloads); names in original Wan / ComfyUI keys are renamed by
the key maps first, as a single file's are."""

import dataclasses
import os

import pytest

from pipelines.storage import weights
from pipelines.storage.weights import CheckpointError
from pipelines.wan.encoders import umt5
from pipelines.wan.pretrained import TINY_DEFAULT_FOLDER, TINY_TRANSFORMER, inference
from pipelines.wan.transformer import PRESETS, WanTransformerConfig, checkpoint_layout, diffusers_key, wan_key
from pipelines.wan.vae import VAE_PRESETS, WanVAEConfig, encoder_key, original_keys

REAL = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b", "wan2.1-flf2v-14b", "wan2.2-ti2v-5b",
        "wan2.1-vace-1.3b", "wan2.1-vace-14b")


def _wan_named(config) -> dict[str, tuple[int, ...]]:
  """A transformer's shapes under original Wan names, then renamed back as `layouts` does."""
  original = {wan_key(key): shape for key, shape, *_ in checkpoint_layout(config)}
  return {diffusers_key(key): shape for key, shape in original.items()}


@pytest.mark.parametrize("name", REAL)
def test_transformer_config_at_real_sizes(name):
  got = inference.transformer_config(_wan_named(PRESETS[name]), name)
  assert got == PRESETS[name]


def test_real_sizes_are_what_they_are():
  """Positive control on the dicts: the 14B's are the 14B's (a D of 5120, 40 layers, 40 heads)."""
  shapes = _wan_named(PRESETS["wan2.1-t2v-14b"])
  assert shapes["patch_embedding.weight"] == (5120, 16, 1, 2, 2) and shapes["blocks.39.ffn.net.0.proj.weight"][0] == 13824
  assert inference.transformer_config(shapes).num_attention_heads == 40
  assert inference.transformer_config(_wan_named(PRESETS["wan2.2-ti2v-5b"])).num_attention_heads == 24


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2", "tiny"])
def test_vae_config_from_shapes(name):
  config = VAE_PRESETS[name]
  assert inference.vae_config(config.param_shapes(), name) == config
  # from the original names' encoder keys alone (what `layouts` reads before it knows the config)
  original = {o: config.param_shapes()[d] for d, o in original_keys(config).items()}
  partial = {encoder_key(k): s for k, s in original.items() if encoder_key(k)}
  partial["decoder.conv_out.weight"] = original["decoder.head.2.weight"]
  assert inference.vae_config(partial, name) == config


def test_umt5_config_from_shapes():
  assert inference.umt5_config(umt5.checkpoint_shapes(umt5.UMT5_PRESETS["umt5-xxl"])) == umt5.UMT5_PRESETS["umt5-xxl"]
  assert inference.umt5_config(umt5.checkpoint_shapes(umt5.UMT5_PRESETS["tiny"])) == umt5.UMT5_PRESETS["tiny"]


FIX = r"pass the model's config: --config FOLDER \(CLI\) or config=FOLDER \(Python\)"


def test_shapes_that_match_no_wan_config():
  shapes = _wan_named(PRESETS["wan2.1-t2v-1.3b"])
  shapes["patch_embedding.weight"] = (1000, 16, 1, 2, 2)
  with pytest.raises(CheckpointError, match=r"'x.safetensors': its shapes \(dim=1000, .*match no released Wan "
                                            r"transformer nor a shipped tiny one.*" + FIX):
    inference.transformer_config(shapes, "x.safetensors")
  vae = dict(VAE_PRESETS["wan2.1"].param_shapes())
  vae["post_quant_conv.weight"] = (20, 20, 1, 1, 1)
  with pytest.raises(CheckpointError, match=r"'v.safetensors': its shapes \(.*z_dim=20.*\) match no released Wan "
                                            r"VAE nor a shipped tiny one.*" + FIX):
    inference.vae_config(vae, "v.safetensors")


def _folder_config(name: str):
  return WanTransformerConfig.from_dict(weights.read_config(os.path.join(TINY_DEFAULT_FOLDER, name)))


def test_the_shipped_tiny_transformers_are_matched():
  """The trained tiny's shapes (and the random tiny's) give their configs, heads included: 8 of 16
  channels, not one head of 128."""
  folder = _folder_config("transformer")
  assert (folder.num_attention_heads, folder.attention_head_dim) == (8, 16)
  assert inference.transformer_config(_wan_named(folder)) == folder
  assert inference.transformer_config(_wan_named(TINY_TRANSFORMER)) == TINY_TRANSFORMER


@pytest.mark.parametrize("change", [dict(ffn_dim=384), dict(num_attention_heads=16), dict(num_layers=3)])
def test_a_transformer_of_other_shapes_is_refused(change):
  """Shapes near a tiny one's (another FFN width, D, depth) name what they are and the fix; the heads
  are no weight's shape, so no guess is made."""
  odd = dataclasses.replace(TINY_TRANSFORMER, **change)
  with pytest.raises(CheckpointError, match=rf"'odd.safetensors': its shapes \(dim={odd.dim}, .*ffn_dim="
                                            rf"{odd.ffn_dim}, num_layers={odd.num_layers}.*\) match no released "
                                            r"Wan transformer nor a shipped tiny one.*" + FIX):
    inference.transformer_config(_wan_named(odd), "odd.safetensors")
  assert inference.transformer_config(_wan_named(odd), heads=odd.num_attention_heads) == odd  # heads given


def test_a_released_width_keeps_its_heads():
  """A file of a released width with other shapes (an input-channel variant of the 1.3B, as Fun's
  control models have) reads with that width's heads: every released Wan's head dim is 128."""
  variant = dataclasses.replace(PRESETS["wan2.1-t2v-1.3b"], in_channels=48)
  assert inference.transformer_config(_wan_named(variant)) == variant


def test_the_shipped_tiny_vaes_are_refused_naming_both():
  """The trained tiny's VAE shapes are both shipped tiny folders' (tiny_default, tiny_i2v), whose latent
  statistics (no weights) differ: refused rather than read with either's."""
  folder = WanVAEConfig.from_diffusers(weights.read_config(os.path.join(TINY_DEFAULT_FOLDER, "vae")))
  with pytest.raises(CheckpointError, match=r"'v.safetensors': its shapes \(base_dim=4, .*dim_mult=\(1, 4, 8, 8\)"
                                            r".*\) are the VAE of tiny_default and of tiny_i2v, whose latent "
                                            r"statistics differ.*" + FIX):
    inference.vae_config(folder.param_shapes(), "v.safetensors")


def test_a_vae_of_other_shapes_is_refused():
  odd = dataclasses.replace(VAE_PRESETS["tiny"], base_dim=5)
  with pytest.raises(CheckpointError, match=r"its shapes \(base_dim=5, .*\) match no released Wan VAE nor a "
                                            r"shipped tiny one.*" + FIX):
    inference.vae_config(odd.param_shapes(), "v.safetensors")
